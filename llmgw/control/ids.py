"""Unpredictable ids for everything the control plane writes.

JetStream drops a message whose `Nats-Msg-Id` it has already seen inside the
stream's duplicate window, whoever wrote the first one: any identity that may
publish at all could pre-publish an id the leader is about to use, and the
leader's decision would be acknowledged as a duplicate and never stored. So
every id the control plane writes ends in 128 random bits from `secrets`.

`DecisionIds` keeps one random part per base id (`{epoch}-{basis_seq}-{index}`,
see llmgw.core.reconcile) while the basis stands: a pass retried after a failed
write, before the log moved on, publishes the same ids again, and JetStream's
de-duplication still turns a write that was stored but not acknowledged into a
duplicate rather than a second decision.
"""

from __future__ import annotations

import secrets

RANDOM_BYTES = 16
"""128 bits."""


def random_part() -> str:
    return secrets.token_hex(RANDOM_BYTES)


def unique(prefix: str) -> str:
    """`prefix` followed by 128 random bits: an id no other writer can predict."""
    return f"{prefix}-{random_part()}"


class DecisionIds:
    """Base id -> the id written: the base plus a random part, stable while the basis stands."""

    def __init__(self) -> None:
        self._basis = ""
        self._ids: dict[str, str] = {}

    def __call__(self, base: str) -> str:
        basis = base.rpartition("-")[0]
        if basis != self._basis:
            self._basis = basis
            self._ids.clear()
        found = self._ids.get(base)
        if found is None:
            found = self._ids[base] = unique(base)
        return found

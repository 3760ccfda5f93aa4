"""What a reconciler pass produces: its configuration, its decisions and their ids."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

import msgspec

from llmgw.core import events, vocabulary
from llmgw.core.limits import clip
from llmgw.core.refusals import Reason

Decision: TypeAlias = (
    events.ReplicaPlaced
    | events.ReplicaRetired
    | events.NodeUnreachable
    | events.NodeLost
    | events.NodeRecovered
    | events.GpuHealthChanged
    | events.EndpointUp
    | events.EndpointDown
    | events.StartShard
    | events.StopShard
    | events.DrainShard
)

IdFactory: TypeAlias = Callable[[str], str]
"""Base id `{epoch}-{basis_seq}-{index}` -> the id the decision is written with."""

OBSERVATIONS = vocabulary.OBSERVATIONS


class ReconcileConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Timings of the reconciler; part of the control plane's configuration."""

    unreachable_after_s: float = 10.0
    """No heartbeat for this long: unreachable (no new placements there)."""
    lost_after_s: float = 60.0
    """Unreachable for this long: lost (its replicas are replaced elsewhere)."""
    restart_backoff_s: float = 5.0
    """Wait before the first restart of a failed replica; doubles per failure."""
    restart_backoff_max_s: float = 300.0
    shard_drain_s: float = 30.0
    """How long a drained shard finishes in-flight requests before it is stopped."""
    stop_grace_s: float = 30.0
    """StopShard's grace: SIGTERM, then SIGKILL after this."""
    change_grace_s: float = 600.0
    """A changed model's old replicas are replaced by a rolling move bounded by this."""
    orphan_stop_retry_s: float = 30.0
    """A process its agent reported that no replica owns gets one StopShard; if it still
    runs, another after this, the wait doubling each time."""
    orphan_stop_retry_max_s: float = 3600.0


class Outcome(msgspec.Struct, kw_only=True):
    decisions: list[Decision]
    unplaceable: dict[str, str] = {}
    """Model -> why its missing replicas could not be placed this pass."""
    unplaceable_codes: dict[str, Reason] = {}
    """Model -> that reason's code (llmgw.core.refusals): the metrics label."""


class Batch:
    """Decisions of one pass, with base ids derived from (epoch, basis_seq, index)."""

    def __init__(self, now: float, epoch: int, basis_seq: int, ids: IdFactory | None) -> None:
        self.now = now
        self.epoch = epoch
        self.basis_seq = basis_seq
        self.ids = ids
        self.out: list[Decision] = []

    def next_id(self) -> str:
        """The next decision's base id (replica ids are made from it: reproducible)."""
        return f"{self.epoch}-{self.basis_seq}-{len(self.out)}"

    def add(self, cls: type[Any], **fields: Any) -> Any:
        base = self.next_id()
        if "reason" in fields:
            # Reasons quote what the log said (an engine's error, an operator's words);
            # the decision must stay within the bounds every reader decodes.
            fields["reason"] = clip(fields["reason"])
        event = cls(
            id=base if self.ids is None else self.ids(base),
            ts=self.now,
            epoch=self.epoch,
            basis_seq=self.basis_seq,
            **fields,
        )
        self.out.append(event)
        return event

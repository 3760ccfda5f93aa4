"""Who a certificate speaks for: a kind (node, router, operator, control) and a name.

The certificate's CN is the name (for a node: its node id) and its OU the kind, so
nats-server's `verify_and_map` maps the subject DN `CN=<name>,OU=<kind>,O=llmgw` to
exactly one configured user. Each identity also gets its own inbox namespace
(`_INBOX.<kind>.<name>.>`), so one client cannot read another's JetStream replies.
"""

from __future__ import annotations

from typing import Literal, get_args

import msgspec

from llmgw.core.subjects import check_token

Kind = Literal["node", "router", "operator", "control"]
KINDS: tuple[Kind, ...] = get_args(Kind)
ORGANIZATION = "llmgw"


class Identity(msgspec.Struct, frozen=True):
    kind: Kind
    name: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown identity kind {self.kind!r}: use one of {', '.join(KINDS)}")
        check_token(self.name, f"{self.kind} name")

    @property
    def dn(self) -> str:
        """The RFC 2253 subject DN nats-server maps to a user."""
        return f"CN={self.name},OU={self.kind},O={ORGANIZATION}"

    @property
    def inbox_prefix(self) -> str:
        return f"_INBOX.{self.kind}.{self.name}"

    def __str__(self) -> str:
        return f"{self.kind}/{self.name}"

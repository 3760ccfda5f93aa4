"""What a request holds of its key's limits, and what a key owes the fleet's counters.

A request of a fleet key holds tokens of the leases this router took of the counters
(llmgw.router.quotas); a keys-file key's, or any key's while the counters cannot be
reached, of this router's own buckets (llmgw.router.auth). What a request used beyond its
hold is owed (`Owed`) until the flusher adds it to the counters.
"""

from __future__ import annotations

from llmgw.core import quota, reserve, tenancy
from llmgw.router import admission, auth
from llmgw.router.errors import Refusal

Owing = str
"""What a charge is owed to: a key's tokens/min window (""), or its budget's period
(`tenancy.period_of`: d20261202, m202612)."""


class Owed:
    """A key's tokens used beyond their holds, not yet charged, and its limit; for its
    window, the `debt` no counter holds yet, due from window number `due` on."""

    __slots__ = ("amount", "debt", "due", "limit")

    def __init__(self) -> None:
        self.amount = 0
        self.limit = 0
        self.debt = 0
        self.due = 0

    def due_now(self, wall: float) -> int:
        """The debt to add to the counter of the window holding `wall`."""
        return self.debt if quota.window(wall, quota.TOKENS_WINDOW_S) >= self.due else 0


class Held:
    """The tokens a request holds of its key's window and budget until it is settled:
    `window` and `period` name the pools they came from (None: no such limit); `local`:
    its tokens/min from this router's own bucket (a keys file's key, or the counters out of
    reach), while `period` may still name its budget's pool."""

    __slots__ = ("local", "period", "principal", "tokens", "window")

    def __init__(
        self, principal: auth.Principal, tokens: int, window: int | None, period: str | None,
        *, local: bool = False,
    ) -> None:  # fmt: skip
        self.principal = principal
        self.tokens = tokens
        self.window = window
        self.period = period
        self.local = local


LONGEST_WAIT_S = 86_400.0
"""The longest wait a 429 of this router's buckets names (a rate of a request in years
would name an infinite one)."""


def local_limits(principal: auth.Principal, mono: float) -> Refusal | None:
    """This router's own requests bucket (a keys-file key, or the counters out of reach)."""
    bucket = principal.requests
    if bucket is not None and not bucket.take(mono):
        wait = min(bucket.refill_s(mono, 1.0), LONGEST_WAIT_S)
        return admission.over_requests(principal, 0, wait)
    return None


def local_hold(principal: auth.Principal, need: int, mono: float) -> Held | Refusal:
    """`need` tokens of this router's own tokens bucket, held until the request is settled.
    A 429 says when the bucket holds them again: after answers larger than their holds,
    minutes away."""
    bucket = principal.tokens
    if bucket is None:
        return Held(principal, need, None, None, local=True)
    if not bucket.take(mono, need):
        wait = min(bucket.refill_s(mono, need), LONGEST_WAIT_S)
        return admission.over_tokens(principal, 0, wait)
    return Held(principal, need, None, None, local=True)


def tightest_limit(s: tenancy.KeySettings) -> int:
    """The smallest of a metered key's token limits: its window's tokens, its budget."""
    window = reserve.window_limit(s.tokens_per_min) if s.tokens_per_min else None
    return min(n for n in (window, s.budget_tokens) if n)


class RequestLease:
    """The requests this router may still admit for a key in one window."""

    __slots__ = ("exhausted", "left", "window")

    def __init__(self) -> None:
        self.window = -1
        self.left = 0
        self.exhausted = False

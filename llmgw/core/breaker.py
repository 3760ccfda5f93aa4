"""Circuit breaker state for one router endpoint, as pure transitions.

The router keeps one `Breaker` per endpoint and replaces it on every outcome:
consecutive failures open it, and an open breaker refuses traffic until its
cool-down has passed, then lets exactly one probe request through (half-open);
that probe's success closes it, its failure opens it again for another
cool-down. Used by `llmgw.router` (the dispatch loop) and by the routing
filter `breaker_closed`.

Purely computational: `now` is passed in, nothing here reads a clock.
"""

from __future__ import annotations

from typing import Literal

import msgspec

BreakerState = Literal["closed", "open", "half_open"]


class BreakerPolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """When a breaker opens and how long it stays open."""

    failures_to_open: int = 5
    """Consecutive failures (connect errors, 5xx, deadlines) that open the breaker."""
    open_s: float = 5.0
    """Cool-down before one probe request is let through."""


class Breaker(msgspec.Struct, frozen=True, kw_only=True):
    state: BreakerState = "closed"
    failures: int = 0
    """Consecutive failures counted while closed."""
    opened_at: float = 0.0
    probing: bool = False
    """Half-open with its single probe in flight: everyone else is refused."""


CLOSED = Breaker()


def allows(b: Breaker, policy: BreakerPolicy, now: float) -> bool:
    """Whether a request may be sent now (an open breaker past its cool-down allows a probe)."""
    if b.state == "closed":
        return True
    if b.state == "open":
        return now >= b.opened_at + policy.open_s
    return not b.probing


def on_attempt(b: Breaker, policy: BreakerPolicy, now: float) -> Breaker:
    """The breaker after a request was sent: the first one past the cool-down is the probe."""
    if b.state == "closed":
        return b
    if b.state == "open" and now >= b.opened_at + policy.open_s:
        return Breaker(state="half_open", probing=True, opened_at=b.opened_at)
    if b.state == "half_open" and not b.probing:
        return Breaker(state="half_open", probing=True, opened_at=b.opened_at)
    return b


def on_success(b: Breaker) -> Breaker:
    """Any success closes the breaker and forgets earlier failures."""
    return b if b is CLOSED else CLOSED


def on_failure(b: Breaker, policy: BreakerPolicy, now: float) -> Breaker:
    """A failure: counted while closed; a failed probe re-opens for another cool-down."""
    if b.state == "half_open":
        return Breaker(state="open", opened_at=now)
    if b.state == "open":
        # A failure of a request sent before the breaker opened: keep the cool-down running.
        return b
    failures = b.failures + 1
    if failures >= policy.failures_to_open:
        return Breaker(state="open", opened_at=now)
    return Breaker(failures=failures)


def on_abandon(b: Breaker) -> Breaker:
    """A request ended with no verdict (the client left): a probe slot opens again.

    Without this a cancelled probe would leave the breaker half-open and probing forever.
    """
    if b.state == "half_open" and b.probing:
        return Breaker(state="half_open", opened_at=b.opened_at)
    return b

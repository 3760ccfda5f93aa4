"""What a request holds of its key's limits, and what a key owes the fleet's counters.

A request of a fleet key holds tokens of the leases this router took of the counters
(llmgw.router.quotas); a keys-file key's, or any key's while the counters cannot be
reached, of this router's own buckets (llmgw.router.auth). What a request used beyond its
hold is owed (`Owed`) until the flusher adds it to the counters (`pay_window`, `pay_budget`),
or, for a budget, a lease of it does.
"""

from __future__ import annotations

from llmgw import logs
from llmgw.bus.counters import CounterError, Counters
from llmgw.core import quota, reserve, subjects, tenancy
from llmgw.router import admission, auth
from llmgw.router.errors import Refusal

log = logs.get("llmgw.router.quotas")

Owing = str
"""What a charge is owed to: a key's tokens/min window (""), or its budget's period
(`tenancy.period_of`: d20261202, m202612)."""


class Owed:
    """A key's tokens used beyond their holds, not yet charged, and its limit; for its
    window, the `debt` no counter holds yet, due from window number `due` on. `paying`: of
    a budget's, what is on its way to the counter (an add not answered yet)."""

    __slots__ = ("amount", "debt", "due", "limit", "paying")

    def __init__(self) -> None:
        self.amount = 0
        self.limit = 0
        self.debt = 0
        self.due = 0
        self.paying = 0

    def due_now(self, wall: float) -> int:
        """The debt to add to the counter of the window holding `wall`."""
        return self.debt if quota.window(wall, quota.TOKENS_WINDOW_S) >= self.due else 0

    def owing(self) -> int:
        """What the counter does not hold yet: owed, or on its way."""
        return self.amount + self.paying

    def take(self) -> int:
        """All that is owed, on its way to the counter: taken before the add is sent, so
        that another add meanwhile (the flusher's, a lease's) does not send it again."""
        amount, self.amount, self.paying = self.amount, 0, self.paying + self.amount
        return amount

    def sent(self, amount: int, *, added: bool) -> None:
        """An add of `amount` taken (`take`) was answered (`added`), or failed: owed again."""
        self.paying -= amount
        if not added:
            self.amount += amount


class AnsweredCounters(Counters):
    """The counters, knowing whether the server answered the last add: while it does not,
    what the router owes is kept on disk (llmgw.router.spool). A turn of the flusher with
    nothing to add asks nothing, so only an add tells."""

    answering = True

    async def add(self, subject: str, amount: int) -> int:
        try:
            total = await super().add(subject, amount)
        except CounterError:
            self.answering = False
            raise
        self.answering = True
        return total


class OutageLog:
    """The counters going out of reach and coming back, each said once (and every 1,000th
    failure meanwhile) rather than at every request that falls back: a router whose
    connection came back by itself says so, and says the next outage again."""

    def __init__(self) -> None:
        self.errors = 0
        """Requests and flusher turns that found the counters out of reach, ever."""
        self.out = False

    def failed(self, exc: Exception) -> None:
        self.errors += 1
        if not self.out or self.errors % 1000 == 0:
            log.warning("fleet_limits_unavailable", error=str(exc), errors=self.errors,
                        advice="keys are limited per router until the counters answer")  # fmt: skip
        self.out = True

    def answered(self) -> None:
        if self.out:
            self.out = False
            log.info("fleet_limits_available", errors=self.errors)


def reached(counters: Counters | None) -> Counters:
    """The counters' connection, else CounterError: it closed (the router stopping) while a
    request's earlier round trip was under way, and the request falls back as for a counter
    that does not answer."""
    if counters is None:
        raise CounterError("the counters' connection is closed")
    return counters


DEBT_WINDOWS = 9
"""How many windows ahead a debt is added at once: the counters live ten minutes
(llmgw.bus.provisioning's LIMITS_MAX_AGE_S), so a later window's would be forgotten. What
is owed beyond them is kept (`Owed.debt`) and added when their turn comes."""


async def pay_window(counters: Counters, name: str, owed: Owed, wall: float) -> None:
    """Add what key `name` owes its tokens/min window to the window it is now; the part that
    window goes over by is carried into the next ones, a debt they start with, so the key's
    average over a few minutes stays at its limit."""
    amount = owed.amount
    due = owed.due_now(wall)
    w = quota.window(wall, quota.TOKENS_WINDOW_S)
    total = await counters.add(subjects.limit_counter(name, "t", w), amount + due)
    owed.amount, owed.debt = owed.amount - amount, owed.debt - due
    debt = reserve.carried(amount + due, total, owed.limit)
    for ahead in range(1, DEBT_WINDOWS):
        if not debt:
            return
        total = await counters.add(subjects.limit_counter(name, "t", w + ahead), debt)
        debt = reserve.carried(debt, total, owed.limit)
    if debt:  # beyond the counters' lifetime: added when its window comes
        owed.debt, owed.due = owed.debt + debt, w + DEBT_WINDOWS


async def pay_budget(counters: Counters, subject: str, owed: Owed, extra: int = 0) -> int:
    """Add what a key owes its budget's period (`Owed.take`), and `extra` more, to the
    counter on `subject`: the counter's total after it. What failed to be added is owed
    again."""
    amount = owed.take()
    try:
        total = await counters.add(subject, amount + extra)
    except BaseException:
        owed.sent(amount, added=False)
        raise
    owed.sent(amount, added=True)
    return total


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

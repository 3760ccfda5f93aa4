"""A key's tokens reserved while its requests run, as arithmetic.

A token limit checked after the fact lets a key start any number of requests at once
before the first one's usage is known. So a request is admitted only when what it *may*
cost (`reservation`: its prompt's estimate plus the completion tokens it asks for) fits
under the key's window (tokens/min) and budget, and that much is held while it runs; when
it ends, it is settled to what it used (`settle`): the rest goes back, a use beyond it is
charged.

Across a fleet the window is a JetStream counter (llmgw.core.quota). A router leases tokens
from it as it does requests (`Pool.lease_size`, `Pool.leased`: one round trip per lease, the
counter's total deciding what each lease grants) and reserves requests from its lease with
no round trip. The counter then holds what every router leased plus what was charged beyond
reservations, so the tokens reserved and used in a window, fleet-wide, never pass its
limit but by charges (`carried`): a charge's part above the limit is a *debt*, added to the
next window's counter, which starts that much fuller. Over any run of windows a key's
tokens average at most its limit, plus a debt not yet paid.

Pure: the router (llmgw.router.quotas) holds the counters and the clock.
"""

from __future__ import annotations

from llmgw.core import quota


def reservation(
    prompt: int, max_out: int | None, default_out: int, limit: int, choices: int = 1
) -> int:
    """What a request may cost: its prompt's tokens and the completion tokens it asks for
    (`default_out` where it names no maximum) for each of its `choices` answers, at least
    one token and at most the key's `limit`. The prompt's count is an estimate, so it never
    refuses a request: one whose estimate passes the limit holds the whole of it, and what
    it uses beyond is charged when it ends. Never 0: a hold of nothing would be admitted by
    a window already full."""
    out = default_out if max_out is None else max_out
    return max(1, min(prompt + out * choices, limit))


def never_fits(max_out: int | None, limit: int, choices: int = 1) -> bool:
    """Whether a request asks for more completion tokens than the key's whole limit: no
    wait would admit it. Only the client's own numbers decide (the prompt's is estimated)."""
    return max_out is not None and max_out * choices > limit


def window_limit(tokens_per_min: float) -> int:
    """The tokens a window of a minute grants a key of `tokens_per_min`: at least one (a
    rate under one a minute still admits a request now and then)."""
    return max(1, int(tokens_per_min))


class Pool:
    """The tokens this router leased from one counter (one key's window or budget period)
    and holds for its requests: `left` not yet reserved."""

    __slots__ = ("exhausted", "exhausted_at", "left", "outage_left", "period", "read", "total")

    def __init__(self, period: int | str) -> None:
        self.period = period
        self.left = 0
        self.exhausted = False
        """The counter granted less than asked: the limit (`exhausted_at`) is reached until
        the period turns or the limit is raised (`may_lease`)."""
        self.exhausted_at = 0
        self.total = 0
        """The counter's total at the last lease or reading (`reading`)."""
        self.read = False
        """Whether the counter ever answered for this period: `total` is a reading."""
        self.outage_left: int | None = None
        """What `outage_lease` may still grant from the last reading (None: not reckoned)."""

    def reserve(self, n: int) -> bool:
        """Hold `n` tokens of the lease for a request, if it has them."""
        if self.left >= n:
            self.left -= n
            return True
        return False

    def may_lease(self, limit: int) -> bool:
        """Whether a lease of the counter may grant anything: not once it granted less than
        asked, unless the key's `limit` was raised since (as a 429 tells its client to ask)."""
        return not self.exhausted or limit > self.exhausted_at

    def lease_size(self, need: int, limit: int) -> int:
        """What to ask the counter for so that `need` fits: a share of the limit, or more
        when one request needs more than that."""
        return max(quota.lease_size(limit), need - self.left)

    def leased(self, size: int, total_after: int, limit: int) -> int:
        """A lease of `size` answered with the counter's total after it: what it granted is
        added; the rest was counted but is not this router's (the window is full)."""
        got = quota.granted(total_after, size, limit)
        self.reading(total_after)
        self.left += got
        self.exhausted, self.exhausted_at = got < size, limit
        return got

    @classmethod
    def begun(cls, period: int | str) -> Pool:
        """A pool of a period that began while this router could not reach its counter:
        read at 0, as every period's counter begins (what other routers spent of it since is
        missing, as from any reading: their unpaid spending is, too)."""
        pool = cls(period)
        pool.reading(0)
        return pool

    def reading(self, total: int) -> None:
        """The counter's `total`, read (a lease's answer, or a read that adds nothing): the
        fleet's count as this router last saw it, which the next outage is reckoned from.
        The largest: a period's counter only grows, and answers may come out of order."""
        self.total = max(self.total, total)
        self.read = True
        self.outage_left = None

    def outage_lease(self, need: int, limit: int, processes: int, unpaid: int = 0) -> int:
        """While the counter cannot be reached: a lease from this router's own allowance
        (`outage_allowance` of the last reading, and of the `unpaid` tokens this router
        owes the counter beside it), sized as a lease of the counter, so that `need` fits.
        Returns what it granted, which the counter is owed when it answers again; nothing
        from a pool the counter never answered for (nothing is known)."""
        if not self.read:
            return 0
        if self.outage_left is None:
            self.outage_left = outage_allowance(limit, self.total + unpaid, processes)
        got = min(self.lease_size(need, limit), self.outage_left)
        self.outage_left -= got
        self.left += got
        return got

    def settle(self, reserved: int, used: int) -> int:
        """A request that held `reserved` used `used`: the unused rest goes back; what it
        used beyond is taken from the lease as far as it holds. Returns the tokens left to
        charge to the counter."""
        if used <= reserved:
            self.left += reserved - used
            return 0
        over = used - reserved
        taken = min(over, self.left)
        self.left -= taken
        return over - taken


def pool_for(pool: Pool | None, period: int | str) -> Pool:
    """The pool of `period`: `pool` when it is that period's, else a new one; read at 0
    (`Pool.begun`) when `pool` was a read budget of the period before (the period turned
    since this router last leased), so that an outage across the turn spends shares of the
    new period rather than nothing. Pure."""
    if pool is not None and pool.period == period:
        return pool
    if pool is not None and pool.read and turned(pool.period, period):
        return Pool.begun(period)
    return Pool(period)


def turned(read: int | str, now: int | str) -> bool:
    """Whether budget period `now` follows period `read` of the same kind (`d…` days or
    `m…` months, llmgw.core.tenancy.period_of): their names sort as their times. Pure."""
    return (
        isinstance(read, str)
        and isinstance(now, str)
        and read[:1] == now[:1]
        and len(read) == len(now)
        and read < now
    )


def outage_allowance(limit: int, total: int, processes: int) -> int:
    """What one of a fleet's `processes` router processes may lease of a limit on its own
    while the counter cannot be reached: an equal share of what the limit had left, unleased,
    at its last reading of the counter's `total`. The shares of all of them together are at
    most what was left at the oldest of their readings."""
    return max(0, limit - total) // max(1, processes)


def carried(amount: int, total_after: int, limit: int) -> int:
    """The part of a charge of `amount` above `limit`, given the counter's total after it:
    the debt the next window starts with. Charges are applied one after another and leases
    grant nothing once a window is full, so the debts of all charges to a window add up to
    exactly what it went over."""
    return max(0, min(amount, total_after - limit))

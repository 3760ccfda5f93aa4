"""Keys' limits and usage: fleet-wide on JetStream counters, else this router's buckets.

A key of the log (`llmgw ctl key create`) is counted in the fleet's counters
(llmgw.core.quota; llmgw.bus.counters): its requests/s and tokens/min in windows every
router adds to, its budget per day or month, its usage per model and hour for `ctl usage`.
So its limits hold for the fleet as a whole whatever the number of routers:

- requests/s: a router takes leases of requests from the window's counter (one round trip
  per lease, not per request); the total the server answers decides what a lease grants,
  so the fleet never admits more than the limit in a window. Every request the key
  authenticates counts, whatever its answer: a body read and refused (400, 403, 404,
  413) cost the router as much as one it serves;
- tokens/min and budgets: a request is admitted only when what it may cost (its prompt's
  estimate and its max_tokens) fits, and holds that much until it ends (`hold`, `settle`,
  llmgw.core.reserve). Routers lease tokens from the counters as they do requests, so the
  tokens held and used fleet-wide stay under the limit, with no round trip per request;
  what a request uses beyond its hold is charged after (batched, every `FLUSH_S`), and
  what that takes a window over its limit is carried into the next as a debt.

Usage is batched (`USAGE_FLUSH_S`): its rate of writes grows with the keys and models in
use, not with requests. A key of the keys file, or any key while the counters cannot be
reached, is limited by this router's own buckets (llmgw.router.auth), logged; its budget
by this router's share of what it last read to be left, owed to the counter after
(`_hold_unreached`); what it owes is kept on disk meanwhile (llmgw.router.spool), for a
router stopped or killed before the counters answer again to pay when it starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from llmgw import bus, logs
from llmgw import tasks as tasks_
from llmgw.bus.counters import CounterError, Counters
from llmgw.core import quota, reserve, subjects, tenancy
from llmgw.router import admission, auth, requests
from llmgw.router import ports as ports_
from llmgw.router.config import DEFAULT_MAX_TOKENS, LogSource
from llmgw.router.errors import Refusal
from llmgw.router.holds import (
    AnsweredCounters,
    Held,
    OutageLog,
    Owed,
    Owing,
    RequestLease,
    local_hold,
    local_limits,
    pay_budget,
    pay_window,
    reached,
    tightest_limit,
)
from llmgw.router.spool import OwedSpool, Spooled, keeping, owed_of
from llmgw.router.usage import UsageRows

log = logs.get("llmgw.router.quotas")

FLUSH_S = 0.25
"""How often this router adds its keys' tokens to the fleet's windows and budgets."""
USAGE_FLUSH_S = 10.0


class Quotas:
    """One router process's share of the fleet's counters."""

    def __init__(self, counters: Counters | None = None) -> None:
        self.counters = counters
        """None until connected (and while the connection is down)."""
        self._leases: dict[str, RequestLease] = {}
        self._windows: dict[str, reserve.Pool] = {}
        """Each key's lease of its tokens/min window."""
        self._budgets: dict[str, reserve.Pool] = {}
        """Each key's lease of its budget period."""
        self._owed: dict[tuple[str, Owing], Owed] = {}
        """(key, its budget's period or "" for its window) -> its tokens used beyond their
        holds, and what of its budget this router leased itself while the counters could not
        be reached: the charges the flusher adds to the counters."""
        self.processes = 1
        """The router processes serving the fleet (`auth.fleet_routers` times `workers`):
        while the counters cannot be reached, this one leases a key's budget on its own, an
        equal share of what it last read to be left (`_hold_unreached`)."""
        self.default_out = DEFAULT_MAX_TOKENS
        """The completion tokens a request naming no maximum is held to (the router's
        `auth.default_max_tokens`), at most the key's limit."""
        self.usage = UsageRows()
        """Keys' usage for `ctl usage`, counted on the hot path and sent by the flusher."""
        self.spool: OwedSpool | None = None
        self._task: asyncio.Task[None] | None = None
        self._spooler: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self.outage = OutageLog()
        self.clock: Callable[[], float] = time.time
        """UNIX time, by which windows and periods are named: the router's (llmgw.router.clock)."""

    # ------------------------------------------------------------------ admission

    def admit_now(self, p: auth.Principal, wall: float) -> bool:
        """True when a fleet key's request is within its requests/s by what this router
        holds now (a lease with requests left in this window): one request is taken, no
        round trip. False: `admit` decides (it may need the counters)."""
        per_s = p.settings.requests_per_s
        if not per_s:
            return True
        if not p.fleet or self.counters is None:
            return False
        lease = self._leases.get(p.name)
        w = quota.window(wall, quota.rate_window_s(per_s))
        if lease is None or lease.window != w or lease.left <= 0:
            return False
        lease.left -= 1
        return True

    async def admit(self, principal: auth.Principal, wall: float, mono: float) -> Refusal | None:
        """None when the key is within its requests/s (one request is taken), else the 429.
        Its tokens are held once its body is read (`hold`)."""
        per_s = principal.settings.requests_per_s
        if not per_s:
            return None
        if not principal.fleet or self.counters is None:
            return local_limits(principal, mono)
        try:
            return await self._take(principal, per_s, wall)
        except CounterError as exc:
            self.outage.failed(exc)
            return local_limits(principal, mono)

    async def _take(self, p: auth.Principal, per_s: float, wall: float) -> Refusal | None:
        span = quota.rate_window_s(per_s)
        w = quota.window(wall, span)
        lease = self._leases.get(p.name)
        if lease is None:
            lease = self._leases[p.name] = RequestLease()
        if lease.window != w:
            lease.window, lease.left, lease.exhausted = w, 0, False
        if lease.left <= 0 and not lease.exhausted:
            await self._lease_requests(lease, subjects.limit_counter(p.name, "r", w), per_s, w)
            if lease.window != w:
                # The window turned during the round trip: that lease was for the last one.
                return await self._take(p, per_s, max(wall, self.clock()))
        if lease.left <= 0:
            return admission.over_requests(p, 0, quota.reset_in(wall, span))
        lease.left -= 1
        return None

    async def _lease_requests(
        self, lease: RequestLease, subject: str, per_s: float, w: int
    ) -> None:
        """Lease requests of window `w`'s counter into `lease`. As a lease of tokens
        (`_lease`), it goes on if the request waiting for it is cancelled: the counter
        counts it either way, and a lease no router holds is lost to the key's window."""
        counters = reached(self.counters)
        allowed = quota.allowance(per_s)
        size = quota.lease_size(allowed)

        async def take() -> None:
            got = quota.granted(await counters.add(subject, size), size, allowed)
            if lease.window == w:  # else the window turned meanwhile: no use any more
                lease.left += got
                lease.exhausted = got < size

        await tasks_.uncancelled(take())

    # ------------------------------------------------------------------ tokens held

    def hold_now(
        self, p: auth.Principal, prompt_chars: int, max_out: int | None, wall: float,
        choices: int = 1, field: str = "max_tokens", choices_field: str = "n",
    ) -> Held | Refusal | int:  # fmt: skip
        """What a request of `prompt_chars` asking for `choices` answers of `max_out` tokens
        may cost, held of a fleet key's window and budget from what this router leased (no
        round trip); the 400 of one larger than the key's tightest token limit (no wait
        would admit it), naming the `field` it sent `max_out` in (`choices_field`: its
        `choices`); else the tokens `hold` is to take (it may need the counters)."""
        s = p.settings
        limit = tightest_limit(s)
        prompt = prompt_chars // requests.CHARS_PER_TOKEN
        if reserve.never_fits(max_out, limit, choices):
            return admission.never_fits(p, max_out or 0, limit, choices, field, choices_field)
        need = reserve.reservation(prompt, max_out, self.default_out, limit, choices)
        if not p.fleet or self.counters is None:
            return need
        w = quota.window(wall, quota.TOKENS_WINDOW_S) if s.tokens_per_min else None
        period = tenancy.period_of(wall, s.budget_period) if s.budget_tokens else None
        tpm = self._windows.get(p.name) if w is not None else None
        budget = self._budgets.get(p.name) if period is not None else None
        if w is not None and (tpm is None or tpm.period != w or tpm.left < need):
            return need
        if period is not None and (budget is None or budget.period != period
                                   or budget.left < need):  # fmt: skip
            return need
        if tpm is not None:
            tpm.left -= need
        if budget is not None:
            budget.left -= need
        return Held(p, need, w, period)

    async def hold(
        self, p: auth.Principal, need: int, wall: float, mono: float, field: str = "max_tokens"
    ) -> Held | Refusal:
        """`need` tokens held of the key's window and budget (leased from the fleet's
        counters when this router's leases lack them), else the 429 (naming `field`, the
        request's maximum). While the counters cannot be reached, its tokens/min are this
        router's bucket, and its budget this router's share of what it last read to be
        left (`_hold_unreached`)."""
        if not p.fleet:
            return local_hold(p, need, mono)
        if self.counters is not None:
            try:
                return await self._hold_fleet(p, need, wall, field)
            except CounterError as exc:
                self.outage.failed(exc)
        return self._hold_unreached(p, need, wall, mono, field)

    def _hold_unreached(
        self, p: auth.Principal, need: int, wall: float, mono: float, field: str
    ) -> Held | Refusal:
        """`need` tokens held while the counters cannot be reached: of the budget, from what
        this router leased and then its share of what it last read to be left (owed to the
        counter: `reserve.Pool.outage_lease`; a period that began since, as read at 0),
        refused with no reading; of tokens/min, from this router's bucket."""
        s = p.settings
        if not s.budget_tokens:
            return local_hold(p, need, mono)
        period = tenancy.period_of(wall, s.budget_period)
        pool = self._budgets[p.name] = reserve.pool_for(self._budgets.get(p.name), period)
        if not pool.read:
            return admission.budget_unchecked(p, need, None, field)
        if pool.left < need:
            unpaid = self.owes(p.name, period)
            got = pool.outage_lease(need, s.budget_tokens, self.processes, unpaid)
            self.owe(p.name, period, got, s.budget_tokens)
        if not pool.reserve(need):
            return admission.budget_unchecked(p, need, pool.left + (pool.outage_left or 0), field)
        held = local_hold(p, need, mono)
        if isinstance(held, Refusal):
            pool.settle(need, 0)
            return held
        held.period = period
        return held

    async def _hold_fleet(
        self, p: auth.Principal, need: int, wall: float, field: str
    ) -> Held | Refusal:
        s = p.settings
        period: str | None = None
        budget: reserve.Pool | None = None
        if s.budget_tokens:
            period = tenancy.period_of(wall, s.budget_period)
            subject = subjects.budget_counter(p.name, period)
            owed = self._owed.get((p.name, period))  # added with its lease, if any
            budget = await self._leased(self._budgets, p.name, period, subject, need,
                                        s.budget_tokens, owed)  # fmt: skip
            if not budget.reserve(need):
                spent = min(budget.total, s.budget_tokens) - budget.left  # fleet-wide
                return admission.over_budget(p, s.budget_tokens - spent, need, wall, field)
        try:
            w = await self._hold_window(p, need, wall)
        except BaseException:
            # The window's lease failed, or its client left while it was under way: what
            # the budget held would be no request's, lost to the key until its period ends.
            if budget is not None:
                budget.settle(need, 0)
            raise
        if isinstance(w, Refusal) and budget is not None:
            budget.settle(need, 0)  # what the budget held, back
        return w if isinstance(w, Refusal) else Held(p, need, w, period)

    async def _hold_window(self, p: auth.Principal, need: int, wall: float) -> int | Refusal | None:
        """`need` tokens held of the key's tokens/min window: the window's number (None: the
        key has no such limit), else the 429."""
        tpm = p.settings.tokens_per_min
        if not tpm:
            return None
        w = quota.window(wall, quota.TOKENS_WINDOW_S)
        subject = subjects.limit_counter(p.name, "t", w)
        pool = await self._leased(self._windows, p.name, w, subject, need,
                                  reserve.window_limit(tpm))  # fmt: skip
        if not pool.reserve(need):
            return admission.over_tokens(p, 0, quota.reset_in(wall, quota.TOKENS_WINDOW_S))
        return w

    async def _leased(
        self, pools: dict[str, reserve.Pool], name: str, period: int | str, subject: str,
        need: int, limit: int, owed: Owed | None = None,
    ) -> reserve.Pool:  # fmt: skip
        """The key's pool for `period`, with a lease taken when it holds under `need` and
        the counter may still grant (with what the key `owed` it, `_lease`)."""
        pool = pools[name] = reserve.pool_for(pools.get(name), period)
        if pool.left < need and pool.may_lease(limit):
            await self._lease(pool, subject, pool.lease_size(need, limit), limit, owed)
        return pool

    async def _lease(
        self, pool: reserve.Pool, subject: str, size: int, limit: int, owed: Owed | None
    ) -> None:
        """Lease `size` tokens of the counter on `subject` into `pool`, adding what the key
        `owed` it first: else a lease after an outage would be granted of a budget its
        outage spent, and the reading it answers would lack that spending. The lease goes on
        if the request waiting for it is cancelled (its client gone): the counter counts it
        either way, and a lease no pool holds is lost to the key for its window or period."""
        counters = reached(self.counters)

        async def lease() -> None:
            if owed is None:
                total = await counters.add(subject, size)
            else:
                total = await pay_budget(counters, subject, owed, size)
            pool.leased(size, total, limit)

        await tasks_.uncancelled(lease())

    def ended(
        self,
        p: auth.Principal | None,
        model: str,
        status: int,
        tokens: tuple[int, int],
        held: Held | None,
    ) -> None:
        """A request of key `p` ended with `status`, having used `tokens` (in, out)."""
        # A request charged tokens is one of the key's requests in its usage whatever its
        # status (a stream its client cut: 499), or `ctl usage` would show those tokens
        # without their request.
        if p is not None and (status < 400 or tokens != (0, 0)):
            self.usage.request_done(p, model)
        if held is not None:
            self.settle(held, sum(tokens))

    def settle(self, held: Held, used: int) -> None:
        """A request that held `held` ended having used `used` tokens (however it ended:
        answered, refused later, cut by its client or its engine): the rest of its hold
        goes back to its pools; what it used beyond is charged, by the flusher."""
        p = held.principal
        s = p.settings
        if held.local:  # its tokens/min held of this router's bucket
            if p.tokens is not None:
                p.tokens.spend(time.monotonic(), used - held.tokens)
        elif held.window is not None:
            limit = reserve.window_limit(s.tokens_per_min or 1)
            self._charge(self._windows, held.window, held, used, limit, "")
        if held.period is not None:
            self._charge(self._budgets, held.period, held, used, s.budget_tokens or 0,
                         held.period)  # fmt: skip

    def _charge(
        self, pools: dict[str, reserve.Pool], period: int | str, held: Held, used: int,
        limit: int, owed_to: Owing,
    ) -> None:  # fmt: skip
        name = held.principal.name
        pool = pools.get(name)
        if pool is not None and pool.period == period:
            over = pool.settle(held.tokens, used)
        else:  # its window or period is over: the rest it held is no one's any more
            over = max(0, used - held.tokens)
        self.owe(name, owed_to, over, limit)

    def owe(self, name: str, owed_to: Owing, amount: int, limit: int) -> None:
        """Key `name` owes `amount` tokens to its window ("") or budget period `owed_to`:
        the flusher adds them to its counter once it answers."""
        if amount:
            owed = self._owed.get((name, owed_to))
            if owed is None:
                owed = self._owed[(name, owed_to)] = Owed()
            owed.amount += amount
            owed.limit = limit

    def owes(self, name: str, owed_to: Owing) -> int:
        """What key `name` owes its window ("") or budget period `owed_to`, not yet added."""
        owed = self._owed.get((name, owed_to))
        return 0 if owed is None else owed.owing()

    async def _pay(self, name: str, owed_to: Owing, owed: Owed, wall: float) -> None:
        """Add what a key owes to its counter: a window's to the window it is now
        (`pay_window`); a budget's to the period it was used in, however long ago, and the
        total it answers is a reading the next outage is reckoned from."""
        assert self.counters is not None
        if not owed_to:
            return await pay_window(self.counters, name, owed, wall)
        total = await pay_budget(self.counters, subjects.budget_counter(name, owed_to), owed)
        if (pool := self._budgets.get(name)) is not None and pool.period == owed_to:
            pool.reading(total)

    # ------------------------------------------------------------------ what is owed, on disk

    def owed_now(self) -> Spooled:
        """All this router owes budgets and usage, as its spool keeps it."""
        return owed_of(self._owed, self.usage)

    def unreached(self) -> bool:
        """No connection to the counters, or no answer to its last add."""
        c = self.counters
        return c is None or (isinstance(c, AnsweredCounters) and not c.answering)

    def restore(self, owed: Spooled) -> None:
        """Owe what a spool holds (a stopped process's), as this router's own charges."""
        for b in owed.budgets:
            self.owe(b.key, b.period, b.tokens, 0)  # a budget's payment needs no limit
        for u in owed.usage:
            self.usage.add(u.key, u.model, (u.tokens_in, u.tokens_out, u.requests))

    # ------------------------------------------------------------------ the flusher

    def start(self, source: LogSource, spool: OwedSpool | None = None, workers: int = 1) -> None:
        """Start the flusher; with a `spool`, first owe what it holds, then keep it."""
        loop = asyncio.get_running_loop()
        if spool is not None:
            self.spool = spool
            self.restore(spool.load(workers))
            kept = keeping(spool, self.owed_now, self.unreached, self._stop, FLUSH_S)
            self._spooler = loop.create_task(kept, name="router-owed-spool")
        self._task = loop.create_task(
            tasks_.retrying(lambda: self._connected(source), stopped=self._stop.is_set,
                            wake=self._stop, what="quotas", logger=log),
            name="router-quotas",
        )  # fmt: skip

    async def close(self) -> None:
        self._stop.set()
        running = [t for t in (self._task, self._spooler) if t is not None]
        if running:
            await tasks_.stop(running, who="router quotas")
        if self.spool is not None:  # what the flusher's last turn could not add
            self.spool.keep(self.owed_now())
            self.spool.close()

    async def _connected(self, source: LogSource) -> None:
        # Unbuffered: a lease that fails while the server is away is never sent after it.
        nc = await ports_.connect(source, source.tls_context(), buffered=False)
        try:
            self.counters = AnsweredCounters(nc)
            self.outage.answered()
            await self.flush_until_stopped()
        finally:
            try:  # a stopping router's flusher is cancelled: its last turn, while NATS may answer
                with contextlib.suppress(CounterError):
                    await self.pay_owed(self.clock())
                with contextlib.suppress(CounterError):
                    await self._flush_usage()
            finally:
                self.counters = None
                await bus.close(nc)

    async def flush_until_stopped(self) -> None:
        next_usage = time.monotonic()  # the first turn adds what an outage left owed
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), FLUSH_S)
            try:
                await self.pay_owed(self.clock())
                if time.monotonic() >= next_usage:
                    next_usage = time.monotonic() + USAGE_FLUSH_S
                    await self._flush_usage()
                    await self.read_budgets(self.clock())
                if self.spool is not None:  # what it held and was added leaves it
                    await asyncio.to_thread(self.spool.settle, self.owed_now())
                if not self.unreached():
                    self.outage.answered()
            except CounterError as exc:
                self.outage.failed(exc)

    async def pay_owed(self, wall: float) -> None:
        """Charge every key's tokens used beyond their holds (`_pay`), at UNIX time `wall`."""
        if self.counters is None:
            return
        for (name, owed_to), owed in list(self._owed.items()):
            if owed.amount or owed.due_now(wall):
                await self._pay(name, owed_to, owed, wall)
            elif not (owed.debt or owed.paying):
                del self._owed[(name, owed_to)]

    async def read_budgets(self, wall: float) -> None:
        """Read the counter of every budget this router leased of (every `USAGE_FLUSH_S`,
        after what it owed was added): should the counters go out of reach, its share of a
        budget is reckoned from a reading this recent (`_hold_unreached`)."""
        if self.counters is None:
            return
        current = {tenancy.period_of(wall, "day"), tenancy.period_of(wall, "month")}
        for name, pool in list(self._budgets.items()):
            if pool.period not in current:  # its period is over: nothing more is leased of it
                del self._budgets[name]
                continue
            subject = subjects.budget_counter(name, str(pool.period))
            pool.reading(await self.counters.add(subject, 0))

    async def _flush_usage(self) -> None:
        """Add each (key, model)'s tokens and requests to its hourly counters."""
        if self.counters is not None:
            await self.usage.flush(self.counters, int(self.clock() // 3600))

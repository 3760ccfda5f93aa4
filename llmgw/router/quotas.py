"""Keys' limits and usage: fleet-wide on JetStream counters, else this router's buckets.

A key of the log (`llmgw ctl key create`) is counted in the fleet's counters
(llmgw.core.quota; llmgw.bus.counters): its requests/s and tokens/min in windows every
router adds to, its budget per day or month, its usage per model and hour for `ctl usage`.
So its limits hold for the fleet as a whole whatever the number of routers:

- requests/s: a router takes leases of requests from the window's counter (one round trip
  per lease, not per request); the total the server answers decides what a lease grants,
  so the fleet never admits more than the limit in a window;
- tokens/min and budgets: tokens are known when a response ends, so they are added after
  the fact (batched, every `FLUSH_S`) and a request is admitted while the fleet's total,
  read at most `FRESH_S` ago, plus this router's unsent tokens is under the limit. Streams
  in flight finish; a key may go over by what they use (as with any token limit).

Usage is batched (`USAGE_FLUSH_S`): its rate of writes grows with the keys and models in
use, not with requests. A key of the keys file, or any key while the counters cannot be
reached (no NATS, no stream yet), is limited by this router's own buckets (llmgw.router.auth):
a stated degradation to per-router limits, logged, never a refusal of the fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from llmgw import bus, logs
from llmgw import tasks as tasks_
from llmgw.bus.counters import CounterError, Counters
from llmgw.core import quota, subjects, tenancy
from llmgw.router import admission, auth
from llmgw.router import ports as ports_
from llmgw.router.config import LogSource
from llmgw.router.errors import Refusal

log = logs.get("llmgw.router.quotas")

FLUSH_S = 0.25
"""How often this router adds its keys' tokens to the fleet's windows and budgets."""
FRESH_S = 1.0
"""How old a fleet total may be before a request of its key reads it again."""
USAGE_FLUSH_S = 10.0


class _Lease:
    """The requests this router may still admit for a key in one window."""

    __slots__ = ("exhausted", "left", "window")

    def __init__(self) -> None:
        self.window = -1
        self.left = 0
        self.exhausted = False


class _Tally:
    """A key's tokens in one window (or budget period): the fleet's total when last read,
    and what this router used since."""

    __slots__ = ("pending", "read_at", "subject", "total")

    def __init__(self, subject: str) -> None:
        self.subject = subject
        self.total = 0
        self.pending = 0
        self.read_at = -1e9


LONGEST_WAIT_S = 86_400.0
"""The longest wait a 429 of this router's buckets names (a rate of a request in years
would name an infinite one)."""


def local_limits(principal: auth.Principal, mono: float) -> Refusal | None:
    """This router's own buckets (a keys-file key, or the counters out of reach). A 429
    says when the bucket takes a request again: for tokens, once the key's tokens are
    back above none, which after an answer larger than its limit is minutes away."""
    request_bucket, token_bucket = principal.requests, principal.tokens
    if request_bucket is not None and not request_bucket.take(mono):
        wait = min(request_bucket.refill_s(mono, 1.0), LONGEST_WAIT_S)
        return admission.over_requests(principal, 0, wait)
    if token_bucket is not None and not token_bucket.has_credit(mono):
        wait = min(token_bucket.refill_s(mono, 0.0), LONGEST_WAIT_S)
        return admission.over_tokens(principal, 0, wait)
    return None


class Quotas:
    """One router process's share of the fleet's counters."""

    def __init__(self, counters: Counters | None = None) -> None:
        self.counters = counters
        """None until connected (and while the connection is down)."""
        self._leases: dict[str, _Lease] = {}
        self._tokens: dict[str, _Tally] = {}
        self._budgets: dict[str, _Tally] = {}
        self._usage: dict[tuple[str, str], list[int]] = {}
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._degraded = False
        self.fleet_errors = 0

    # ------------------------------------------------------------------ admission

    def admit_now(self, p: auth.Principal, wall: float, mono: float) -> bool:
        """True when a fleet key's request is within its limits by what this router knows
        now (a lease with requests left in this window, totals read within FRESH_S): one
        request is taken, no round trip. False: `admit` decides (it may need the counters)."""
        if not p.fleet or self.counters is None:
            return False
        s = p.settings
        if s.budget_tokens:
            t = self._budgets.get(p.name)
            if t is None or mono - t.read_at > FRESH_S or t.total + t.pending >= s.budget_tokens:
                return False
            period = tenancy.period_of(wall, s.budget_period)
            if t.subject != subjects.budget_counter(p.name, period):
                return False
        if s.tokens_per_min:
            t = self._tokens.get(p.name)
            w = quota.window(wall, quota.TOKENS_WINDOW_S)
            if t is None or mono - t.read_at > FRESH_S or t.total + t.pending >= s.tokens_per_min:
                return False
            if t.subject != subjects.limit_counter(p.name, "t", w):
                return False
        if s.requests_per_s:
            lease = self._leases.get(p.name)
            w = quota.window(wall, quota.rate_window_s(s.requests_per_s))
            if lease is None or lease.window != w or lease.left <= 0:
                return False
            lease.left -= 1
        return True

    async def admit(self, principal: auth.Principal, wall: float, mono: float) -> Refusal | None:
        """None when the key is within its limits (one request is taken), else the 429."""
        if not principal.limited:
            return None
        if not principal.fleet or self.counters is None:
            return local_limits(principal, mono)
        try:
            return await self._fleet(principal, wall, mono)
        except CounterError as exc:
            self._fell_back(exc)
            return local_limits(principal, mono)

    async def _fleet(self, p: auth.Principal, wall: float, mono: float) -> Refusal | None:
        s = p.settings
        if s.budget_tokens:
            period = tenancy.period_of(wall, s.budget_period)
            t = await self._read(self._budgets, p.name, subjects.budget_counter(p.name, period),
                                 mono)  # fmt: skip
            if t.total + t.pending >= s.budget_tokens:
                left = tenancy.period_end(wall, s.budget_period) - wall
                return admission.over_budget(p, t.total + t.pending, left)
        if s.tokens_per_min:
            w = quota.window(wall, quota.TOKENS_WINDOW_S)
            t = await self._read(self._tokens, p.name, subjects.limit_counter(p.name, "t", w),
                                 mono)  # fmt: skip
            if t.total + t.pending >= s.tokens_per_min:
                return admission.over_tokens(p, 0, quota.reset_in(wall, quota.TOKENS_WINDOW_S))
        if s.requests_per_s:
            return await self._take(p, s.requests_per_s, wall)
        return None

    async def _take(self, p: auth.Principal, per_s: float, wall: float) -> Refusal | None:
        span = quota.rate_window_s(per_s)
        w = quota.window(wall, span)
        lease = self._leases.get(p.name)
        if lease is None:
            lease = self._leases[p.name] = _Lease()
        if lease.window != w:
            lease.window, lease.left, lease.exhausted = w, 0, False
        if lease.left <= 0 and not lease.exhausted:
            assert self.counters is not None
            allowed = quota.allowance(per_s)
            size = quota.lease_size(allowed)
            total = await self.counters.add(subjects.limit_counter(p.name, "r", w), size)
            got = quota.granted(total, size, allowed)
            if lease.window != w:
                # The window turned during the round trip: that lease was for the last one.
                return await self._take(p, per_s, max(wall, time.time()))
            lease.left += got
            lease.exhausted = got < size
        if lease.left <= 0:
            return admission.over_requests(p, 0, quota.reset_in(wall, span))
        lease.left -= 1
        return None

    async def _read(
        self, tallies: dict[str, _Tally], name: str, subject: str, mono: float
    ) -> _Tally:
        """The key's tally for `subject` (a new window starts at 0), its total read again
        when older than FRESH_S (adding what this router used meanwhile)."""
        t = tallies.get(name)
        if t is None or t.subject != subject:
            if t is not None and t.pending:
                await self._send(t)  # the last window's tokens, to its own counter
            t = tallies[name] = _Tally(subject)
        if mono - t.read_at > FRESH_S:
            await self._send(t, read=True, mono=mono)
        return t

    async def _send(self, t: _Tally, *, read: bool = False, mono: float = 0.0) -> None:
        if self.counters is None or (not t.pending and not read):
            return
        sent = t.pending
        total = await self.counters.add(t.subject, sent)
        t.pending -= sent
        t.total = total
        if read:
            t.read_at = mono

    # ------------------------------------------------------------------ usage

    def used(self, principal: auth.Principal, model: str, prompt: int, completion: int) -> None:
        """A response's tokens (the hot path: counted here, sent by the flusher)."""
        n = prompt + completion
        if principal.fleet:
            if principal.settings.tokens_per_min and principal.name in self._tokens:
                self._tokens[principal.name].pending += n
            if principal.settings.budget_tokens and principal.name in self._budgets:
                self._budgets[principal.name].pending += n
            row = self._row(principal.name, model)
            row[0] += prompt
            row[1] += completion
        elif principal.tokens is not None:
            principal.tokens.spend(time.monotonic(), n)

    def request_done(self, principal: auth.Principal, model: str) -> None:
        if principal.fleet:
            self._row(principal.name, model)[2] += 1

    def _row(self, name: str, model: str) -> list[int]:
        """(key, model)'s tokens in, out and requests since the last usage flush."""
        row = self._usage.get((name, model))
        if row is None:
            row = self._usage[(name, model)] = [0, 0, 0]
        return row

    # ------------------------------------------------------------------ the flusher

    def start(self, source: LogSource) -> None:
        self._task = asyncio.get_running_loop().create_task(
            tasks_.retrying(lambda: self._connected(source), stopped=self._stop.is_set,
                            wake=self._stop, what="quotas", logger=log),
            name="router-quotas",
        )  # fmt: skip

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            await tasks_.stop([self._task], who="router quotas")

    async def _connected(self, source: LogSource) -> None:
        nc = await ports_.connect(source, source.tls_context())
        try:
            self.counters = Counters(nc)
            self._degraded = False
            await self.flush_until_stopped()
        finally:
            self.counters = None
            await self._flush_usage()
            await bus.close(nc)

    async def flush_until_stopped(self) -> None:
        next_usage = time.monotonic() + USAGE_FLUSH_S
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), FLUSH_S)
            try:
                for tallies in (self._tokens, self._budgets):
                    for t in list(tallies.values()):
                        await self._send(t)
                if time.monotonic() >= next_usage:
                    next_usage = time.monotonic() + USAGE_FLUSH_S
                    await self._flush_usage()
            except CounterError as exc:
                self._fell_back(exc)

    async def _flush_usage(self) -> None:
        """Add each (key, model)'s tokens and requests to its hourly counters."""
        if self.counters is None or not self._usage:
            return
        hour = int(time.time() // 3600)
        rows, self._usage = self._usage, {}
        try:
            for (name, model), counts in rows.items():
                for i, what in enumerate(("in", "out", "req")):
                    if counts[i]:
                        await self.counters.add(
                            subjects.usage_counter(name, hour, model, what), counts[i]
                        )
                        counts[i] = 0
        except CounterError:
            # Every count not sent yet (the failed one, the rows after it) is kept for the
            # next flush rather than lost.
            for (name, model), counts in rows.items():
                if any(counts):
                    row = self._row(name, model)
                    for i, n in enumerate(counts):
                        row[i] += n
            raise

    def _fell_back(self, exc: Exception) -> None:
        self.fleet_errors += 1
        if not self._degraded or self.fleet_errors % 1000 == 0:
            log.warning("fleet_limits_unavailable", error=str(exc), errors=self.fleet_errors,
                        advice="keys are limited per router until the counters answer")  # fmt: skip
        self._degraded = True

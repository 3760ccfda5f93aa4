"""The NATS server's time, as a control plane or a router reads it: its host's clock plus a
measured offset.

The leader judges a node by the age of its last heartbeat: the time the NATS server
stored it against the leader's "now". If "now" were the leader host's own clock, a host
whose clock ran ahead by more than `lost_after_s` (a failed NTP daemon, a virtual
machine resumed from a pause) would find every node lost at once and replace every
replica of the fleet; one behind would keep a dead node alive as long. So a control
plane's "now" is the server's time: its host's clock plus an offset it measures when it
starts, before it reads the log, and every few seconds after, by asking the server for
its time (`ask`: the `ts` the log stream's info answers with).

A router reads the same time for what the fleet shares by UNIX time: its keys' rate-limit
windows and budget periods (counters every router adds to), their expiry, the stamps of its
load reports. A router a second off would count into other routers' windows.

A measurement brackets the request with two readings of the host's clock (`sent`,
`received`); the server answered somewhere in between, so the offset is its time less
the midpoint, within half the round trip. Of the last few measurements the one with the
shortest round trip is used (as NTP does): an answer slowed by a busy server says little.

The readings are the host's monotonic clock, not its wall clock: a wall clock stepped
(by NTP after a pause, by hand) would otherwise move "now" by the step until the next
measurement, long enough for the leader to find every node lost. So a measurement that
cannot agree with the offset in use means that the server's clock was stepped, or that
its answer is wrong: it is taken only once the next one agrees with it, and then starts
the count over; one wrong answer moves nothing.
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import json
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import NamedTuple

import nats.errors
from nats.aio.client import Client
from structlog.typing import FilteringBoundLogger

from llmgw.core import subjects

KEPT = 8
"""Measurements kept: at one every third of the lease's TTL, the last half minute or so."""
ASK_TIMEOUT_S = 2.0
"""How long a measurement waits for the server's answer: a later one measures nothing."""
WARN_S = 1.0
"""An offset beyond this is logged: the hosts' clocks should agree (NTP) even so."""


class Sample(NamedTuple):
    """One question, in the host's clock (`sent`, `received`) and the server's answer (`stored`)."""

    sent: float
    stored: float
    received: float

    @property
    def round_trip(self) -> float:
        return self.received - self.sent


def offset_of(samples: Iterable[Sample]) -> tuple[float, float] | None:
    """(offset, uncertainty) from the sample with the shortest round trip: the server's
    time less the host's, within the uncertainty (half that round trip); None without a
    usable sample (one whose round trip is negative or not finite is none). Pure."""
    usable = [s for s in samples if math.isfinite(s.round_trip) and s.round_trip >= 0]
    if not usable:
        return None
    best = min(usable, key=lambda s: s.round_trip)
    return best.stored - (best.sent + best.received) / 2, best.round_trip / 2


class ServerTime:
    """A clock that reads the server's time: `ticks()` plus the measured offset (the host's
    wall clock until a first measurement). Callable, so it stands wherever a clock is
    passed. `ticks` is the host's monotonic clock; a clock given as `wall` alone (a test's
    simulated time) is its own."""

    def __init__(self, wall: Callable[[], float], ticks: Callable[[], float] | None = None) -> None:
        self.wall = wall
        self.ticks = ticks if ticks is not None else wall
        self._base = wall() - self.ticks()
        """The server's time less `ticks()`."""
        self.uncertainty = math.inf
        self._samples: collections.deque[Sample] = collections.deque(maxlen=KEPT)
        self._doubted: tuple[Sample, tuple[float, float]] | None = None
        """A measurement that disagreed with the offset in use, until the next one."""

    def __call__(self) -> float:
        return self.ticks() + self._base

    @property
    def measured(self) -> bool:
        """Whether the server told its time at least once (else this is the host's)."""
        return bool(self._samples)

    @property
    def offset(self) -> float:
        """The server's time less the host's wall clock."""
        return self() - self.wall()

    def observe(self, sample: Sample) -> float:
        """Take one measurement (read on `ticks`) into account; how far it moved the time
        read. One that cannot agree with the offset in use (their ranges do not meet) is
        held back until the next: if that one agrees with it, the server's clock was
        stepped, and what was measured before is dropped; else it was a wrong answer."""
        alone = offset_of([sample])
        if alone is None:
            return 0.0
        if not _agree(alone, (self._base, self.uncertainty)):
            doubted, self._doubted = self._doubted, (sample, alone)
            if doubted is None or not _agree(alone, doubted[1]):
                return 0.0
            self._samples.clear()
            self._samples.append(doubted[0])
        self._doubted = None
        self._samples.append(sample)
        found = offset_of(self._samples)
        assert found is not None  # `sample` at least is usable
        before, (self._base, self.uncertainty) = self._base, found
        return self._base - before


def unix_time(stamp: str) -> float | None:
    """UNIX seconds of a time as the server writes it (RFC 3339 in UTC, up to nanoseconds),
    or None when it is not one. Pure."""
    head, dot, fraction = stamp.strip().removesuffix("Z").partition(".")
    if dot and not fraction.isdigit():
        return None
    try:
        when = datetime.datetime.fromisoformat(head)
    except ValueError:
        return None
    if when.tzinfo is not None:
        return None  # the server writes UTC as "Z": another offset is not its writing
    when = when.replace(tzinfo=datetime.UTC)
    return when.timestamp() + (float("0." + fraction) if dot else 0.0)


async def ask(nc: Client) -> float | None:
    """The server's clock now, as it answers a request, or None when it does not answer
    with one within `ASK_TIMEOUT_S`. Asked of the log's stream (the `ts` of its info): in a
    cluster that stream's leader stamps the heartbeats judged by this time, and another
    stream's leader (the lease bucket's) may be another server, with another clock. Every
    role that reads the log may ask."""
    try:
        msg = await nc.request(f"$JS.API.STREAM.INFO.{subjects.STREAM}", b"", timeout=ASK_TIMEOUT_S)
        answer = json.loads(msg.data)
    except (nats.errors.Error, TimeoutError, ValueError):
        return None
    stamp = answer.get("ts") if isinstance(answer, dict) else None
    when = unix_time(stamp) if isinstance(stamp, str) else None
    # Go's zero time (year 1) is a time the server did not set, not its clock.
    return when if when is not None and when > 0 else None


async def measure(clock: ServerTime, asked: Callable[[], Awaitable[float | None]]) -> Sample | None:
    """One measurement of `clock` against the server's answer to `asked` (`ask`, or a port
    of it), read on the clock's ticks; None when no answer came within `ASK_TIMEOUT_S`."""
    sent = clock.ticks()
    try:
        stamp = await asyncio.wait_for(asked(), ASK_TIMEOUT_S)
    except TimeoutError:
        stamp = None
    received = clock.ticks()
    return None if stamp is None else Sample(sent, stamp, received)


def observed(clock: ServerTime, sample: Sample, log: FilteringBoundLogger, judged: str) -> float:
    """`clock.observe(sample)` (its step returned), logged when the offset passes `WARN_S`
    (`clock_offset`, saying what is `judged` by the server's time) or comes back under it."""
    was = abs(clock.offset) > WARN_S
    step = clock.observe(sample)
    offset = clock.offset
    off = abs(offset) > WARN_S
    if off and not was:
        log.warning("clock_offset", offset_s=round(offset, 3),
                    detail=f"this host's clock differs from the NATS server's: {judged} by the "
                    "server's time, but fix the hosts' time sync (NTP)")  # fmt: skip
    elif was and not off:
        log.info("clock_offset_recovered", offset_s=round(offset, 3))
    return step


def of(wall: Callable[[], float]) -> ServerTime:
    """The server's time on a host whose wall clock is `wall`: read on the monotonic clock
    when `wall` is the host's own, else on `wall` itself (a test's simulated time)."""
    return ServerTime(wall, time.monotonic if wall is time.time else None)


def _agree(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether two (offset, uncertainty) ranges meet."""
    return abs(a[0] - b[0]) <= a[1] + b[1]

"""The NATS server's time, as a control plane reads it: its host's clock plus a measured offset.

The leader judges a node by the age of its last heartbeat: the time the NATS server
stored it against the leader's "now". If "now" were the leader host's own clock, a host
whose clock ran ahead by more than `lost_after_s` (a failed NTP daemon, a virtual
machine resumed from a pause) would find every node lost at once and replace every
replica of the fleet; one behind would keep a dead node alive as long. So a control
plane's "now" is the server's time: its host's clock plus an offset it measures when it
starts, before it reads the log, and every few seconds after, by asking the server for
its time (`LeasePort.server_time`: the `ts` a JetStream stream info answers with).

A measurement brackets the request with two readings of the host's clock (`sent`,
`received`); the server answered somewhere in between, so the offset is its time less
the midpoint, within half the round trip. Of the last few measurements the one with the
shortest round trip is used (as NTP does): an answer slowed by a busy server says little.
When the host's clock is stepped, the next measurement cannot agree with those before: it
starts the count over, so the step is out of the time read a few seconds later.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterable
from typing import NamedTuple

KEPT = 8
"""Measurements kept: at one a lease renewal, the last half minute or so."""
ASK_TIMEOUT_S = 2.0
"""How long a measurement waits for the server's answer: a later one measures nothing."""
WARN_S = 1.0
"""An offset beyond this is logged: the hosts' clocks should agree (NTP) even so."""


class Sample(NamedTuple):
    """One write, in the host's clock (`sent`, `received`) and the server's (`stored`)."""

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
    """A clock that reads the server's time: `wall()` plus the measured offset (0 until
    a first measurement). Callable, so it stands wherever a clock is passed."""

    def __init__(self, wall: Callable[[], float]) -> None:
        self.wall = wall
        self.offset = 0.0
        self.uncertainty = math.inf
        self._samples: collections.deque[Sample] = collections.deque(maxlen=KEPT)

    def __call__(self) -> float:
        return self.wall() + self.offset

    def observe(self, sample: Sample) -> None:
        """Take one measurement into account. One that cannot agree with the offset in
        use (their ranges do not meet) means that a clock was stepped since: what was
        measured before is dropped, so the step is out with this one measurement."""
        alone = offset_of([sample])
        if alone is not None and abs(alone[0] - self.offset) > alone[1] + self.uncertainty:
            self._samples.clear()
        self._samples.append(sample)
        found = offset_of(self._samples)
        if found is not None:
            self.offset, self.uncertainty = found

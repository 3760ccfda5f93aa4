"""A router's clock: the NATS server's time, as the control plane's (llmgw.bus.servertime).

What a router reads by UNIX time is shared with the rest of the fleet: its keys' requests/s
and tokens/min windows and budget periods are counters every router adds to
(llmgw.core.quota), named by the window's second; a key's expiry and a rotated secret's
overlap are times `ctl` wrote; its load reports are judged stale by the control plane's
clock. Read on a host clock a second off, a router would count into other routers' windows
(the fleet would admit up to twice a key's requests/s), and one an hour behind would honour
a key that expired an hour ago. So every router process reads its host's monotonic clock
plus an offset it measures against the server's: before it serves, when an answer comes
within `START_WAIT_S` (a router started while NATS is away serves meanwhile on its host's
clock), then every `EVERY_S`, on its counters' connection (llmgw.router.quotas).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from nats.aio.client import Client

from llmgw import logs
from llmgw import tasks as tasks_
from llmgw.bus import servertime
from llmgw.bus.servertime import ServerTime

log = logs.get("llmgw.router.clock")

START_WAIT_S = 3.0
"""How long a starting router waits for the server's time before it serves anyway."""
EVERY_S = 5.0
"""How often the offset is measured again once known."""
RETRY_S = 0.2
"""How often it is tried until a first measurement (the connection may not be up yet)."""


class ClockKeeper:
    """Measures a router process's `clock` against the server's, on the connection
    `connection()` returns (None while there is none), and reports the offset."""

    def __init__(
        self,
        clock: ServerTime,
        connection: Callable[[], Client | None],
        report: Callable[[float], None],
    ) -> None:
        self.clock = clock
        self.connection = connection
        self.report = report
        """Told the offset (the server's time less the host's) after every measurement."""
        self.measured = asyncio.Event()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Measure in the background; return once measured, or after `START_WAIT_S`."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="router-clock")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.measured.wait(), START_WAIT_S)
        if not self.measured.is_set():
            log.warning("clock_unmeasured", waited_s=START_WAIT_S,
                        detail="serving on this host's clock until the NATS server tells its "
                        "time: check that it answers STREAM.INFO of the log")  # fmt: skip

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            await tasks_.stop([self._task], who="router clock")

    async def _run(self) -> None:
        while not self._stop.is_set():
            await self.measure()
            wait = EVERY_S if self.measured.is_set() else RETRY_S
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), wait)

    async def measure(self) -> None:
        """One measurement, when connected and the server answers in time."""
        nc = self.connection()
        if nc is None:
            return
        sample = await servertime.measure(self.clock, lambda: servertime.ask(nc))
        if sample is not None:
            self.observe(sample)

    def observe(self, sample: servertime.Sample) -> None:
        judged = "keys' limits and expiry are read"
        servertime.observed(self.clock, sample, log, judged)
        self.report(self.clock.offset)
        self.measured.set()

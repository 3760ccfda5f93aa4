"""The fleet as it is now, followed from the log, for the console.

`LiveFleet` rebuilds the state once (newest snapshot + tail, as `llmgw ctl` does), then
follows the log with a Reader and folds each batch with the same `state.apply`. It keeps
the most recent event rows for the page's list and hands every batch to the pages
watching (`watch()`: one bounded queue each, so a page that stops reading loses rows,
never the console's memory). A lost connection or a NATS restart ends the follow; it
starts again after a pause, from the sequence it had folded, so nothing is folded twice
or missed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from llmgw import bus, logs
from llmgw import tasks as tasks_
from llmgw.bus import attestations as bus_attestations
from llmgw.core import attestation, state
from llmgw.ctl import history
from llmgw.ctl.console import views
from llmgw.ctl.session import Session

log = logs.get("llmgw.ctl.console")

RECENT = 5_000
"""Event rows kept for the page's list (older ones: the slider and the timeline)."""
WATCH_QUEUE = 256
"""Batches a watching page may fall behind by before it misses rows (it is told)."""


class LiveFleet:
    def __init__(self, session: Session, *, recent: int = RECENT) -> None:
        self.session = session
        self.state = state.ClusterState()
        self.last_time: float | None = None
        self.keep = recent
        self.recent: deque[dict[str, Any]] = deque(maxlen=recent)
        self.ready = asyncio.Event()
        self.following = False
        self.attested: attestation.Attestations | None = None
        """The log's attestations (the leader's digests): a point is checked by them."""
        self._end: int | None = None
        """The log's last sequence when the console started; None before it looked."""
        self.bounds: history.Bounds | None = None
        """What the stream held when last asked (the page's slider while NATS is away)."""
        self._watchers: set[asyncio.Queue[list[dict[str, Any]]]] = set()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="console-live")

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            await tasks_.stop([self._task], who="console live fleet")

    async def _run(self) -> None:
        await tasks_.retrying(self._follow, stopped=self._stop.is_set, wake=self._stop,
                              what="console_follow", logger=log)  # fmt: skip

    async def _follow(self) -> None:
        nc = self.session.nc
        if self._end is None:
            # Rebuilt to `recent` events before the end, so that the reader folds the last
            # ones as rows: the page's list starts full, not empty.
            end = (await history.bounds(nc)).last_seq
            if end > self.keep:
                rebuilt = await history.rebuild(nc, to_seq=end - self.keep)
                self.state, self.last_time = rebuilt.state, rebuilt.at
            self._end = end
            log.info("console_rebuilt", seq=self.state.last_seq, end=end)
        if self.attested is None:
            # Kept for every point the page asks for (each would read them all again),
            # and extended with those the leader writes from now on.
            self.attested = await bus.load_attestations(nc)
        reader = bus.Reader(nc, after_seq=self.state.last_seq, name="ctl",
                            attestations=self.attested)  # fmt: skip
        self.following = True
        # Ready (the live view served) once the fold reached the end the rebuild saw, or
        # the reader found nothing more to read (the last records may have expired).
        waiter = asyncio.create_task(self._ready_when(reader.caught_up))
        try:
            async with reader:
                async for batch in reader.batches():
                    self._fold(batch)
                    if self.state.last_seq >= self._end:
                        self.ready.set()
        finally:
            self.following = False
            waiter.cancel()

    async def _ready_when(self, caught_up: asyncio.Event) -> None:
        await caught_up.wait()
        self.ready.set()

    def _fold(self, batch: list[bus.Record]) -> None:
        rows = []
        for rec in batch:
            if rec.seq <= self.state.last_seq:
                continue  # already folded (a follow that started again)
            state.apply(self.state, rec.event, rec.seq, rec.time)
            self.last_time = rec.time
            rows.append(views.event_row(rec))
        if not rows:
            return
        if self.attested is not None:
            bus_attestations.add(self.attested, batch, after_seq=0)
        self.recent.extend(rows)
        for q in self._watchers:
            if q.full():
                with contextlib.suppress(asyncio.QueueEmpty):
                    q.get_nowait()  # the oldest batch goes; the page refetches the fleet
            q.put_nowait(rows)

    async def watch(self) -> AsyncIterator[list[dict[str, Any]]]:
        """Every batch of event rows folded from now on, until the caller stops."""
        q: asyncio.Queue[list[dict[str, Any]]] = asyncio.Queue(WATCH_QUEUE)
        self._watchers.add(q)
        try:
            while True:
                yield await q.get()
        finally:
            self._watchers.discard(q)

"""The router's KV feed: the engines' KV updates from NATS into its fleet KV index.

A `KvFeed` connects as the router's identity to the log's server, reads the stream
`llmgw-kv` from a few seconds back (`bus.KvReader`: long enough to include every
engine's latest full update, so a router that starts or restarts is warm at once,
without waiting for engines to store anything again) and then follows it, folding every
update into `llmgw.core.kvindex.KvIndex`. Which node published an update is its
subject's, which the server enforces and the signature proves; the index keeps it and
the router believes an endpoint's blocks only from the node its endpoint table has for
it (llmgw.router.kvroute). As updates come, every `SWEEP_EVERY_S` it drops what a node said
of an endpoint the table does not have on that node, once the index has held it for
`kvindex.UNLISTED_GRACE_S` (`KvIndex.sweep`: an endpoint the table lacks only briefly may
lose its blocks, which its next full update brings back), and logs it by node. It tells
the index which endpoints the table has on which node as it folds updates too, so a node
has a bounded number of others indexed
(`kvindex.MAX_UNLISTED_PER_NODE`); the updates refused for that, or any other bound, are
logged once per `REFUSALS_LOGGED_EVERY_S` per node at most.

It runs beside the LogFeed and never stops the router: while it cannot read, routing
goes on from the router's own recent routes and approximate index.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Callable

from llmgw import bus, logs
from llmgw import tasks as tasks_
from llmgw.bus import kvlog
from llmgw.bus.intake import Record
from llmgw.core import kvindex, subjects
from llmgw.core.kvindex import KvIndex
from llmgw.router import ports as ports_
from llmgw.router.config import LogSource

log = logs.get("llmgw.router.kv")

SWEEP_EVERY_S = 5.0
"""How often, as updates come, the index is swept of endpoints the table lacks (the agents'
full-update interval: a pass is cheap next to the updates of that long). A pass cut short
by its bound is followed by another on the next batch."""
REFUSALS_LOGGED_EVERY_S = 5.0
"""A node's refused updates are logged once per this long at most, each line with how
many were refused since the last one: a node publishing for hundreds of endpoints it may
not have indexed is refused hundreds of times per full update (the agents' interval)."""


class KvFeed:
    """Keeps one router's KvIndex in step with the stream `llmgw-kv`."""

    def __init__(
        self,
        source: LogSource,
        index: KvIndex,
        *,
        tls: ssl.SSLContext | None = None,
        window_s: float = kvlog.START_WINDOW_S,
        listed: Callable[[str, str], bool] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`window_s`: how far back to start reading; more than the agents' full-update
        interval (llmgw.agent.kvrelay.FULL_EVERY_S), so every engine's is in it.
        `listed(endpoint, node)`: whether the router's endpoint table has that endpoint on
        that node (None: no table, nothing is swept). `clock`: UNIX time, the router's
        (llmgw.router.clock): the server's, as the stream's start time is read."""
        self.source = source
        self.clock = clock
        self.index = index
        self.listed = listed
        self._swept_at = 0.0
        self._swept_all = True
        self._refusals: dict[str, tuple[float, int]] = {}
        """Node -> when its last refused update was logged, and how many since were not (on
        its next line; the index counts them all). One entry per node ever refused."""
        self._tls = tls
        self.window_s = window_s
        self.ready = asyncio.Event()
        """Set once the updates stored when the feed started are folded."""
        self._reader: kvlog.KvReader | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="router-kv-feed")

    async def close(self) -> None:
        self._stop.set()
        if self._reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._reader.close(), 5)
        if self._task is not None:
            await tasks_.stop([self._task], who="router kv feed")

    async def _run(self) -> None:
        # No stream yet, a refused consumer: try again later, backing off.
        await tasks_.retrying(self._follow, stopped=self._stop.is_set, wake=self._stop,
                              what="kv_feed", logger=log)  # fmt: skip

    async def _follow(self) -> None:
        tls = self._tls if self._tls is not None else self.source.tls_context()
        nc = await ports_.connect(self.source, tls)
        try:
            reader = kvlog.KvReader(
                nc, since=self.clock() - self.window_s, name=f"router-kv-{self.source.name}"
            )
            self._reader = reader
            async with reader:
                marker = asyncio.get_running_loop().create_task(self._mark_ready(reader))
                try:
                    async for batch in reader.batches():
                        self.apply(batch)
                finally:
                    marker.cancel()
        finally:
            self._reader = None
            await bus.close(nc)

    async def _mark_ready(self, reader: kvlog.KvReader) -> None:
        await reader.caught_up.wait()
        self.ready.set()
        log.info("kv_feed_caught_up", endpoints=len(self.index.endpoints),
                 blocks=len(self.index))  # fmt: skip

    def apply(self, batch: list[Record], now: float | None = None) -> None:
        now = self.clock() if now is None else now
        for record in batch:
            owner = subjects.kv_owner(record.subject)
            if owner is None:
                continue
            refused = self.index.apply(kvlog.update_of(record), owner[0], now, self.listed)
            if refused is not None:
                self._refused(owner[0], record, refused, now)
        # abs(): a clock set back does not put the next pass off.
        if not self._swept_all or abs(now - self._swept_at) >= SWEEP_EVERY_S:
            self.sweep(now)

    def _refused(self, node: str, record: Record, reason: str, now: float) -> None:
        """Log a refused update, unless one of `node`'s was logged within
        `REFUSALS_LOGGED_EVERY_S` (then count it for the next line)."""
        logged_at, not_logged = self._refusals.get(node, (None, 0))
        if logged_at is not None and abs(now - logged_at) < REFUSALS_LOGGED_EVERY_S:
            self._refusals[node] = (logged_at, not_logged + 1)
            return
        self._refusals[node] = (now, 0)
        log.warning("kv_update_refused", node=node, seq=record.seq, subject=record.subject,
                    reason=reason, not_logged=not_logged)  # fmt: skip

    def sweep(self, now: float) -> None:
        """One bounded pass of `KvIndex.sweep`, logged per node."""
        if self.listed is None:
            return
        dropped, self._swept_all = self.index.sweep(self.listed, now)
        self._swept_at = now
        by_node: dict[str, list[tuple[str, int]]] = {}
        for node, endpoint, blocks in dropped:
            by_node.setdefault(node, []).append((endpoint, blocks))
        for node, gone in sorted(by_node.items()):
            names = sorted(endpoint for endpoint, _ in gone)
            log.warning("kv_unlisted_dropped", node=node, endpoints=len(gone),
                        blocks=sum(blocks for _, blocks in gone), first=names[:8],
                        grace_s=kvindex.UNLISTED_GRACE_S)  # fmt: skip

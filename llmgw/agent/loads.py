"""The agent's report of its engines' load, for the autoscaler.

Every `EVERY_S` the agent reads the Prometheus page of each local engine that serves (shard
0 of each replica, with the engine's own key) and publishes one signed
`llmgw.core.loadreport.LoadReport` of their queued and running requests and KV-cache
usage on `llmgw.signals.node.<its id>`, which only this node may publish, into the stream
`llmgw-signals` (llmgw.bus.signals). The leader believes a node's figures only for
endpoints the log has up on that node, and there over any router's (llmgw.core.loadreport);
routers report the same figures from their own probes, for engines whose agent does not.

Fire and forget: an engine that does not answer within the interval is left out of that
report, a report that cannot be published is dropped, and the next report heals both.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
from nats.aio.client import Client

from llmgw import logs
from llmgw import tasks as tasks_
from llmgw.agent.kvrelay import KvRelays
from llmgw.agent.shards import ShardView
from llmgw.bus.signals import SignalsPublisher
from llmgw.core import loadreport
from llmgw.core.engine_metrics import parse_engine_metrics
from llmgw.engine_http import MAX_METRICS_BYTES, bounded_body

log = logs.get("llmgw.agent")

EVERY_S = loadreport.NODE_EVERY_S
"""Every five seconds (the leader counts a node's report that much longer than a router's):
a fleet of 1,000 nodes adds 200 signed messages a second to `llmgw-signals` (each checked
by the leader), and the routers' own probes report the same figures every second where they
reach the engine."""


class EngineLoads:
    """Follows the node's serving engines and reports their load every `every_s`."""

    def __init__(self, *, every_s: float = EVERY_S) -> None:
        self.every_s = every_s
        self.engines: dict[str, ShardView] = {}
        """Replica id (the endpoint's id in the log) -> its serving shard 0."""
        self.publisher: SignalsPublisher | None = None
        self.sent = 0
        self.dropped = 0
        self._task: asyncio.Task[None] | None = None
        self._http: aiohttp.ClientSession | None = None

    def bind(self, nc: Client | None, node: str) -> None:
        """Publish on `nc` as node `node` (None: an in-memory log; nothing goes) and start."""
        if nc is None:
            return
        self.publisher = SignalsPublisher(nc, node=node)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-loads")

    def observe(self, view: ShardView) -> None:
        """A shard changed: follow an engine that serves, forget one that stopped serving."""
        if view.shard != 0:
            return
        if view.phase == "serving" and view.endpoint:
            self.engines[view.replica_id] = view
        else:
            self.engines.pop(view.replica_id, None)

    async def close(self) -> None:
        if self._task is not None:
            await tasks_.stop([self._task], who="engine loads")
            self._task = None
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def _run(self) -> None:
        while True:
            began = time.monotonic()
            try:
                await self.report_once()
            except Exception as exc:  # a report lost: the next one heals
                self.dropped += 1
                log.debug("engine_loads_dropped", error=repr(exc))
            await asyncio.sleep(max(self.every_s - (time.monotonic() - began), 0.05))

    async def report_once(self) -> loadreport.LoadReport | None:
        """Read every serving engine and publish their load; the report, if one went."""
        if self.publisher is None or not self.engines:
            return None
        views = list(self.engines.values())
        found = await asyncio.gather(*(self._read(v) for v in views))
        report = loadreport.LoadReport(
            ts=time.time(),
            window_s=self.every_s,
            endpoints=tuple(e for e in found if e is not None),
        )
        await self.publisher.publish(report)
        self.sent += 1
        return report

    async def _read(self, view: ShardView) -> loadreport.EndpointLoad | None:
        if self._http is None:
            timeout = aiohttp.ClientTimeout(total=min(max(self.every_s * 0.8, 0.2), 2.0))
            self._http = aiohttp.ClientSession(timeout=timeout)
        headers = {"Authorization": f"Bearer {view.api_key}"} if view.api_key else None
        try:
            # Not followed elsewhere: a redirect is no 200 (as the prober's, llmgw.agent.probe).
            url = view.endpoint + "/metrics"
            async with self._http.get(url, headers=headers, allow_redirects=False) as resp:
                if resp.status != 200:
                    return None
                page = await bounded_body(resp, MAX_METRICS_BYTES)
                if page is None:
                    return None
                queue, running, kv = parse_engine_metrics(page.decode())
        except (aiohttp.ClientError, TimeoutError, OSError, UnicodeDecodeError):
            return None
        return loadreport.EndpointLoad(
            endpoint=view.replica_id,
            model=view.model,
            queue=max(queue or 0.0, 0.0),
            running=max(running or 0.0, 0.0),
            kv_usage=min(max(kv or 0.0, 0.0), 1.0),
        )


class EngineFeeds:
    """What the agent relays of its engines besides their shard reports: their KV blocks
    (llmgw.agent.kvrelay) and their load (`EngineLoads`), following the shards."""

    def __init__(self) -> None:
        self.kv = KvRelays()
        self.loads = EngineLoads()

    def bind(self, nc: Client | None, node: str) -> None:
        self.kv.bind(nc, node)
        self.loads.bind(nc, node)

    async def observe(self, view: ShardView) -> None:
        await self.kv.observe(view)
        self.loads.observe(view)

    async def close(self) -> None:
        await self.loads.close()
        await self.kv.close()

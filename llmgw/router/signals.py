"""The router's load reports for the autoscaler (llmgw.core.loadreport).

Every second each router process publishes what it saw over its last `WINDOW_S`: per
model, the requests it received, those held waiting for a first endpoint
(llmgw.router.holding) and its TTFT and inter-token p90 (from the deltas of its own
histograms, at their buckets' resolution); per endpoint of the log, the engine's queue,
running requests and KV-cache usage as its probes last read them. Reports go on the
router's own subject of `llmgw-signals` (llmgw.bus.signals) over a connection of its
own; while it cannot publish, routing goes on and the autoscaler holds its counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterable

import msgspec

from llmgw import bus, logs
from llmgw import tasks as tasks_
from llmgw.bus import signals as signals_
from llmgw.core import loadreport
from llmgw.core.routing import EndpointState
from llmgw.router import ports as ports_
from llmgw.router.config import LogSource
from llmgw.router.holding import Holds
from llmgw.router.metrics import ITL_BUCKETS, LATENCY_BUCKETS, Histogram

log = logs.get("llmgw.router.signals")

EVERY_S = 1.0
WINDOW_S = loadreport.WINDOW_S

_Counts = dict[str, list[float]]


def _copy(h: Histogram) -> _Counts:
    return {labels[0]: list(v) for labels, v in h.values.items() if labels}


def _delta(now: list[float], then: list[float] | None) -> list[float]:
    """Bucket counts gained since `then` (the sum, last, left out)."""
    if then is None:
        return now[:-1]
    return [a - b for a, b in zip(now[:-1], then[:-1], strict=True)]


def _engine(ep: EndpointState) -> loadreport.EndpointLoad:
    return loadreport.EndpointLoad(
        endpoint=ep.id,
        model=min(ep.models),
        queue=max(ep.queue_depth, 0.0),
        running=max(ep.running, 0.0),
        kv_usage=min(max(ep.kv_usage, 0.0), 1.0),
    )


class LoadTracker:
    """What one router process reports, from its metrics, table and holds."""

    def __init__(
        self,
        received: dict[str, int],
        ttft: Histogram,
        itl: Histogram,
        holds: Holds,
        window_s: float = WINDOW_S,
        queued: dict[str, int] | None = None,
    ) -> None:
        """`queued`: model -> requests waiting in the fair queue (llmgw.router.queueing),
        reported with the held ones as the model's waiting requests."""
        self.received = received
        self.ttft = ttft
        self.itl = itl
        self.holds = holds
        self.queued = queued if queued is not None else {}
        self.window_s = window_s
        self._past: deque[tuple[float, dict[str, int], _Counts, _Counts]] = deque()

    def report(self, endpoints: Iterable[EndpointState], now: float, mono: float) -> (
        loadreport.LoadReport
    ):  # fmt: skip
        """The report for this moment (`now` wall clock, `mono` monotonic)."""
        current = (mono, dict(self.received), _copy(self.ttft), _copy(self.itl))
        self._past.append(current)
        while len(self._past) > 1 and self._past[0][0] < mono - self.window_s:
            self._past.popleft()
        start, received, ttft, itl = self._past[0]
        window = max(mono - start, EVERY_S)
        models = sorted(
            set(current[1]) | set(self.holds.waiting) | set(self.queued) | set(current[2])
        )
        traffic = []
        for model in models:
            requests = current[1].get(model, 0) - received.get(model, 0)
            first = _delta(current[2][model], ttft.get(model)) if model in current[2] else []
            gaps = _delta(current[3][model], itl.get(model)) if model in current[3] else []
            waiting = self.holds.waiting.get(model, 0) + self.queued.get(model, 0)
            if not (requests or waiting or any(first)):
                continue
            traffic.append(loadreport.ModelTraffic(
                model=model, requests=max(requests, 0), waiting=waiting,
                ttft_p90_s=round(loadreport.quantile(0.9, LATENCY_BUCKETS, first), 4),
                itl_p90_s=round(loadreport.quantile(0.9, ITL_BUCKETS, gaps), 4),
                samples=int(sum(first)),
            ))  # fmt: skip
        engines = tuple(_engine(ep) for ep in endpoints if ep.models and ep.ready)
        return loadreport.LoadReport(
            ts=now, window_s=round(window, 3), models=tuple(traffic), endpoints=engines
        )


class SignalsFeed:
    """Publishes a router process's load report every `EVERY_S` while it runs."""

    def __init__(
        self,
        source: LogSource,
        tracker: LoadTracker,
        endpoints: dict[str, EndpointState],
        *,
        worker: int = 0,
        metrics: str = "",
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`clock`: UNIX time, the reports' stamps (the router's, llmgw.router.clock)."""
        self.source = source
        self.clock = clock
        self.metrics = metrics
        """`host:port` of the router's /metrics, in every report (service discovery)."""
        self.tracker = tracker
        self.endpoints = endpoints
        self.worker = worker
        self.sent = 0
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="router-signals")

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            await tasks_.stop([self._task], who="router signals")

    async def _run(self) -> None:
        # No server yet, no stream yet: try again later, backing off.
        await tasks_.retrying(self._publish_until_stopped, stopped=self._stop.is_set,
                              wake=self._stop, what="signals_publish", logger=log)  # fmt: skip

    async def _publish_until_stopped(self) -> None:
        nc = await ports_.connect(self.source, self.source.tls_context())
        try:
            publisher = signals_.SignalsPublisher(nc, self.source.name, self.worker)
            while not self._stop.is_set():
                report = self.tracker.report(
                    list(self.endpoints.values()), self.clock(), time.monotonic()
                )
                await publisher.publish(msgspec.structs.replace(report, metrics=self.metrics))
                self.sent += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), EVERY_S)
        finally:
            await bus.close(nc)

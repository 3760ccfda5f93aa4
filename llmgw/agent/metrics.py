"""The agent's own Prometheus metrics and health, on a listener of its own (`admin` in its
config; off unless set).

What the fleet's state cannot say about a node: its outbox backlog (events written while
NATS was unreachable, not yet published), whether it is connected to NATS, its shards by
phase as its supervisor sees them, shard transitions (engines started, serving, failed)
and how long each phase lasted, and its engines' startup probes (down, up, ready).
Counters and the phase histogram move as shards change; the rest is read from the
service when Prometheus scrapes.

- `GET /metrics`: Prometheus text;
- `GET /health`: 200 `{"ok": true}` once started and connected to NATS, else 503 saying
  which is missing.

A connection's first request head must arrive within `admin.header_timeout_s` of its
connect, a later one within that of its first byte, or the client gets a 408 and the
connection closes; a malformed request gets a 400 that quotes nothing it sent, and a
compressed body (never inflated) a 415 (llmgw.http_server).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from llmgw import http_server, listeners, logs
from llmgw.agent.config import AdminListener
from llmgw.agent.outbox import Outbox
from llmgw.agent.shards import ShardView
from llmgw.agent.supervisor import Supervisor
from llmgw.bus import natspy
from llmgw.core.phases import SHARD_PHASES, TERMINAL

log = logs.get("llmgw.agent")

_P = "llmgw_agent_"
# Phases last from seconds (starting) to hours (serving).
_PHASE_BUCKETS = (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 14400, 86400)


@dataclass(frozen=True)
class Live:
    """What the agent is now, read at each scrape."""

    started: bool
    connected: bool
    outbox_events: int
    outbox_bytes: int
    shards: list[ShardView] = field(default_factory=list)
    probes: Mapping[str, int] = field(default_factory=dict)
    heartbeats: int = 0


def live(
    started: asyncio.Event,
    nc: natspy.Client | None,
    outbox: Outbox | None,
    supervisor: Supervisor | None,
    heartbeats: int,
) -> Live:
    """The agent's parts as they are now (any not made yet: empty)."""
    return Live(
        started=started.is_set(),
        connected=nc is not None and nc.is_connected,
        outbox_events=len(outbox) if outbox is not None else 0,
        outbox_bytes=outbox.size_bytes if outbox is not None else 0,
        shards=supervisor.views() if supervisor is not None else [],
        probes=dict(supervisor.probes) if supervisor is not None else {},
        heartbeats=heartbeats,
    )


class AgentMetrics:
    """One registry per agent; `observe` on every shard transition, `live` read at scrape."""

    def __init__(self, live: Callable[[], Live]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.live = live
        self.transitions = Counter(
            _P + "shard_transitions",
            "Shard phase changes, by the phase entered (failed: an engine that died or "
            "never became ready; starting: an engine launched).",
            ("phase",),
            registry=r,
        )
        self.phase_seconds = Histogram(
            _P + "shard_phase_seconds",
            "How long a shard stayed in a phase before its next one.",
            ("phase",),
            buckets=_PHASE_BUCKETS,
            registry=r,
        )
        self._entered: dict[tuple[str, int, int], tuple[str, float]] = {}
        r.register(_LiveCollector(live))

    def observe(self, view: ShardView, now: float) -> None:
        """A shard changed phase (or reported it again) at `now`."""
        key = (view.replica_id, view.shard, view.generation)
        before = self._entered.get(key)
        if before is not None and before[0] == view.phase:
            return  # the same phase announced again
        self.transitions.labels(view.phase).inc()
        if before is not None:
            self.phase_seconds.labels(before[0]).observe(max(0.0, now - before[1]))
        if view.phase in TERMINAL:
            self._entered.pop(key, None)
        else:
            self._entered[key] = (view.phase, now)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LiveCollector(Collector):
    def __init__(self, live: Callable[[], Live]) -> None:
        self._live = live

    def describe(self) -> list[GaugeMetricFamily]:
        return []  # nothing to call at registration: the service may not be up yet

    def collect(self) -> Iterator[GaugeMetricFamily]:
        now = self._live()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(_P + name, doc, value=value)

        yield gauge("started", "1 once the agent adopted, discovered and connected.", now.started)
        yield gauge("nats_connected", "1 while connected to NATS.", now.connected)
        yield gauge(
            "outbox_events",
            "Events written to the on-disk outbox and not yet acknowledged by NATS.",
            now.outbox_events,
        )
        yield gauge("outbox_bytes", "Bytes of the outbox backlog.", now.outbox_bytes)
        yield gauge("heartbeats", "Heartbeats published since start.", now.heartbeats)
        shards = GaugeMetricFamily(
            _P + "shards", "Shards the supervisor holds, by phase.", labels=("phase",)
        )
        by_phase = {p: 0 for p in SHARD_PHASES}
        for view in now.shards:
            by_phase[view.phase] = by_phase.get(view.phase, 0) + 1
        for phase, count in by_phase.items():
            shards.add_metric((phase,), count)
        yield shards
        probes = GaugeMetricFamily(
            _P + "startup_probes",
            "Probes of starting engines since start, by result (down: not listening; up: "
            "listening, model not listed yet; ready).",
            labels=("result",),
        )
        for result in ("down", "up", "ready"):
            probes.add_metric((result,), now.probes.get(result, 0))
        yield probes


def build_app(metrics: AgentMetrics) -> web.Application:
    async def _metrics(_request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), content_type="text/plain")

    async def _health(_request: web.Request) -> web.Response:
        now = metrics.live()
        missing = [
            what
            for what, ok in (("started", now.started), ("connected to NATS", now.connected))
            if not ok
        ]
        body = {"ok": not missing, "missing": missing}
        return web.Response(
            body=msgspec.json.encode(body),
            status=503 if missing else 200,
            content_type="application/json",
        )

    app = web.Application()
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/health", _health)
    return app


async def serve(
    metrics: AgentMetrics, where: AdminListener | None
) -> tuple[web.AppRunner | None, str]:
    """Listen where configured (port 0: a free one): the runner and the listener's URL;
    (None, "") when the agent has no admin listener."""
    if where is None:
        return None, ""
    host, port = where.host, where.port
    rules = http_server.Rules(where.header_timeout_s, log)
    runner = http_server.app_runner(build_app(metrics), rules=rules, access_log=None)
    await runner.setup()
    try:
        sock = listeners.bind(host, port, setting="admin.port")
    except OSError:
        await runner.cleanup()
        raise
    await http_server.start_site(runner, sock, rules=rules)
    url = listeners.url("http", sock)
    log.info("admin_listening", url=url)
    return runner, url

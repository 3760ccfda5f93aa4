"""The router's live view of the fleet: models it can route and the endpoints serving them.

`Catalog` maps every name a client may ask for (model or alias) to its
`ModelProfile`; `EndpointTable` holds one `llmgw.core.routing.EndpointState`
per engine, with add / remove / mark-draining. Today the static router config
fills both at start; the control plane's ModelDeclared / ModelChanged /
ModelRemoved and EndpointUp / EndpointDown events will call the same methods.
`Prober` keeps each endpoint's readiness (/health) and load (/metrics) fresh.
Used by `llmgw.router.app`, `dispatch`, `admission` and `feed`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable

import aiohttp

from llmgw import logs
from llmgw.core import redaction
from llmgw.core.engine_metrics import parse_engine_metrics
from llmgw.core.profile import ModelProfile
from llmgw.core.routing import EndpointState
from llmgw.engine_http import MAX_METRICS_BYTES, bounded_body
from llmgw.router.metrics import Metrics

log = logs.get("llmgw.router")

TIMEOUTS_TO_UNREADY = 3
"""Consecutive health-probe timeouts that take an endpoint out of rotation."""
MAX_HEALTH_BYTES = 64 * 1024
"""The most of a /health answer read (engines send none): more is not a healthy engine."""


class Catalog:
    """Name or alias -> model profile."""

    def __init__(self, models: Iterable[ModelProfile] = ()) -> None:
        self.profiles: dict[str, ModelProfile] = {}
        self.names: dict[str, ModelProfile] = {}
        for m in models:
            self.put(m)

    def put(self, model: ModelProfile) -> None:
        """Declare or change a model (its old aliases go; one it still declares stays its
        own even where another model declares it too)."""
        self._drop(model.name)
        self.profiles[model.name] = model
        self.names[model.name] = model
        for alias in model.aliases:
            self.names.setdefault(alias, model)
        self._grant_freed_aliases()

    def remove(self, name: str) -> None:
        if self._drop(name) is not None:
            self._grant_freed_aliases()

    def _drop(self, name: str) -> ModelProfile | None:
        old = self.profiles.pop(name, None)
        if old is not None:
            for n in (old.name, *old.aliases):
                if self.names.get(n) is old:
                    del self.names[n]
        return old

    def _grant_freed_aliases(self) -> None:
        """An alias another model declares too was kept from it while one model held it
        (a router's own models beside the log's): freed, it is that other model's."""
        for other in self.profiles.values():
            for alias in other.aliases:
                self.names.setdefault(alias, other)

    def resolve(self, name: str) -> ModelProfile | None:
        return self.names.get(name)


class EndpointTable:
    """Endpoints by id and by the model they serve. Mutated in place, read per request."""

    def __init__(self) -> None:
        self.by_id: dict[str, EndpointState] = {}
        self.by_model: dict[str, list[EndpointState]] = {}
        self.on_remove: list[Callable[[str], None]] = []
        """Told of every endpoint that goes (its caches go with it: llmgw.router.kvroute)."""

    def add(
        self,
        id: str,
        url: str,
        models: Iterable[str],
        *,
        ready: bool = False,
        api_key: str = "",
        node: str = "",
    ) -> EndpointState:
        """Add an endpoint, or replace the one with this id (an engine restarted elsewhere).

        `api_key` is the engine's own key (from EndpointUp), presented on every request.
        """
        self.remove(id)
        ep = EndpointState(
            id=id,
            url=url.rstrip("/"),
            models=frozenset(models),
            ready=ready,
            api_key=api_key,
            node=node,
        )
        self.by_id[id] = ep
        for m in ep.models:
            self.by_model.setdefault(m, []).append(ep)
        return ep

    def remove(self, id: str) -> EndpointState | None:
        ep = self.by_id.pop(id, None)
        if ep is not None:
            for m in ep.models:
                eps = self.by_model.get(m, [])
                # Rebuild rather than mutate: a request may be iterating the old list.
                self.by_model[m] = [e for e in eps if e is not ep]
            for told in self.on_remove:
                told(id)
        return ep

    def has(self, id: str, node: str) -> bool:
        """Whether endpoint `id` is here on `node` (the only node believed about its cache)."""
        ep = self.by_id.get(id)
        return ep is not None and ep.node == node

    def mark_draining(self, id: str, draining: bool = True) -> bool:
        ep = self.by_id.get(id)
        if ep is None:
            return False
        ep.draining = draining
        return True

    def for_model(self, model: str) -> list[EndpointState]:
        return self.by_model.get(model, [])


class Prober:
    """Reads every endpoint's /health and /metrics every `interval` seconds."""

    def __init__(
        self,
        table: EndpointTable,
        session: aiohttp.ClientSession,
        metrics: Metrics,
        interval: float,
    ) -> None:
        self.table = table
        self.session = session
        self.metrics = metrics
        self.interval = interval
        self.rounds = 0
        self._slow: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def probe_all(self) -> None:
        eps = list(self.table.by_id.values())
        await asyncio.gather(*(self._probe(ep) for ep in eps))
        self.rounds += 1

    async def _run(self) -> None:
        while True:
            try:
                await self.probe_all()
            except Exception:  # a probe bug must not stop probing
                log.exception("probe_round_failed")
            await asyncio.sleep(self.interval)

    async def _probe(self, ep: EndpointState) -> None:
        timeout = aiohttp.ClientTimeout(total=min(max(2 * self.interval, 1.0), 3.0))
        was = ep.ready
        # /health is open on every engine; llama-server wants the key for /metrics.
        headers = {"Authorization": f"Bearer {ep.api_key}"} if ep.api_key else None
        # Redirects are not followed: the engine's port chooses the answer, and a redirect
        # to another host and path made the router fetch that URL each round, from its own
        # network (an internal service, a cloud's metadata address). A 3xx is not healthy.
        try:
            async with self.session.get(
                ep.url + "/health", timeout=timeout, allow_redirects=False
            ) as r:
                ok = r.status == 200 and await bounded_body(r, MAX_HEALTH_BYTES) is not None
            self._slow.pop(ep.id, None)
        except TimeoutError:
            # A busy engine (or a busy router) answers health checks late; only a run of
            # timeouts means it is gone. A refused connection is definite at once.
            n = self._slow[ep.id] = self._slow.get(ep.id, 0) + 1
            ok = was and n < TIMEOUTS_TO_UNREADY
        except (aiohttp.ClientError, OSError):
            self._slow.pop(ep.id, None)
            ok = False
        ep.ready = ok
        if was != ok:
            log.info("endpoint_ready" if ok else "endpoint_not_ready", endpoint=ep.id,
                     url=redaction.shown_url(ep.url))  # fmt: skip
        if ok:
            try:
                async with self.session.get(
                    ep.url + "/metrics", timeout=timeout, headers=headers, allow_redirects=False
                ) as r:
                    page = await bounded_body(r, MAX_METRICS_BYTES) if r.status == 200 else None
                    if page is not None:  # past the bound it is left unread, as a failed read
                        queue, running, kv = parse_engine_metrics(page.decode())
                        ep.queue_depth = queue or 0.0
                        ep.running = running or 0.0
                        ep.kv_usage = kv or 0.0
            except (aiohttp.ClientError, TimeoutError, OSError, UnicodeDecodeError):
                pass  # an engine without metrics is still routable, just scored as idle
        self.metrics.endpoint(
            ep.id,
            ready=ok,
            queue=ep.queue_depth,
            kv=ep.kv_usage,
            inflight=ep.inflight,
            breaker=ep.breaker.state,
        )

"""The HTTP shell of `llmgw sim`: aiohttp on uvloop around the pure engine.

One task drives `Engine.step` — back to back with a zero-latency model (a
bounded burst of steps between yields to the event loop, so handlers wake once
per burst, not once per token), or sleeping out each step's duration otherwise.
Each request handler submits its request, then waits on a future the engine loop
resolves when the request has new output, and writes everything new in one
write. A client that disconnects cancels its handler (aiohttp's
handler_cancellation), whose `finally` drops the request from the engine and
frees its blocks at once.

Routes: the OpenAI endpoints, `/health`, `/metrics`, vLLM's
`/reset_prefix_cache`, and the test-only `/sim/faults` (GET, POST, DELETE) and
`/sim/state` (GET). With `api_key` set, every route but `/health` and `/metrics`
answers 401 without `Authorization: Bearer <key>`, as vLLM's `--api-key` does for /v1.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import msgspec
import uvloop
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from llmgw import listeners, logs, otlp
from llmgw.core import simtokens as tokens
from llmgw.sim import api, apis, faultplan, kvevents, streaming
from llmgw.sim import tracing as sim_tracing
from llmgw.sim.config import Faults, SimConfig
from llmgw.sim.engine import Engine, Request
from llmgw.sim.metrics import registry_for

_MASK = (1 << 64) - 1
# Work done between two yields to the event loop with a zero-latency model, in
# generated tokens (a step of a batch of n sequences costs n): enough to finish
# short requests in one burst, little enough (a few ms) that new requests and
# /metrics are not starved by a big batch or a long generation.
_ZERO_LATENCY_BURST_TOKENS = 2048
_JSON = "application/json"
_OPEN_PATHS = frozenset({"/health", "/metrics"})
"""Open even with a key: probes and Prometheus carry none, in vLLM too."""
_KNOWN_PATHS = {
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/tokenize",
    "/detokenize",
    "/v1/rerank",
    "/rerank",
    "/v2/rerank",
    "/v1/score",
    "/score",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/models",
    "/health",
    "/metrics",
    "/sim/faults",
    "/sim/state",
    "/reset_prefix_cache",
}


def _error(exc: api.ApiError) -> web.Response:
    return web.Response(status=exc.status, body=exc.body(), content_type=_JSON)


class SimServer:
    """One simulated engine: its engine, fault plan, metrics and aiohttp app."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.engine = Engine(cfg)
        self.registry = registry_for(self.engine, cfg.served_model_names[0])
        self.faults = faultplan.FaultPlan(cfg.faults)
        self._id_prefix = os.urandom(3).hex()
        self._n = 0
        self._created = int(time.time())
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self.log = logs.get("llmgw.sim")
        self.kv_events: kvevents.Publisher | None = None
        self.traces: otlp.Exporter | None = None

    # --- application -------------------------------------------------------------

    def app(self) -> web.Application:
        # Long prompts are the point of prefix-cache tests; aiohttp's 1 MiB default
        # would refuse them before the sim could answer in OpenAI's shape.
        middlewares = [self._require_key] if self.cfg.api_key else []
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=middlewares)
        r = app.router
        r.add_post("/v1/chat/completions", self._chat)
        r.add_post("/v1/completions", self._completions)
        r.add_post("/v1/embeddings", self._embeddings)
        r.add_post("/v1/responses", self._responses)
        r.add_post("/v1/messages", self._messages)
        r.add_post("/v1/messages/count_tokens", self._count_tokens)
        r.add_post("/tokenize", self._tokenize)
        r.add_post("/detokenize", self._detokenize)
        for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
            r.add_post(path, self._rerank)
        for path in ("/v1/score", "/score"):
            r.add_post(path, self._score)
        r.add_get("/v1/models", self._models)
        r.add_get("/v1/models/{model:.+}", self._model)
        r.add_get("/health", self._health)
        r.add_get("/metrics", self._metrics)
        r.add_get("/sim/faults", self._faults_get)
        r.add_post("/sim/faults", self._faults_set)
        r.add_delete("/sim/faults", self._faults_clear)
        r.add_get("/sim/state", self._state)
        r.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        r.add_route("*", "/{tail:.*}", self._no_route)
        app.on_startup.append(self._start_engine)
        app.on_cleanup.append(self._stop_engine)
        return app

    @web.middleware
    async def _require_key(
        self, request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        if request.path in _OPEN_PATHS:
            response: web.StreamResponse = await handler(request)
            return response
        given = request.headers.get("Authorization", "")
        expected = f"Bearer {self.cfg.api_key}"
        # Constant time: a byte-by-byte comparison would tell a prober how far it got.
        if not hmac.compare_digest(given.encode(), expected.encode()):
            return _error(
                api.ApiError(
                    401,
                    "this engine requires its API key: send `Authorization: Bearer <key>`",
                    code="invalid_api_key",
                )
            )
        response = await handler(request)
        return response

    async def _start_engine(self, _app: web.Application) -> None:
        kv = self.cfg.kv_events
        if kv is not None:
            self.kv_events = kvevents.Publisher(kv, self.cfg.block_size)
            self.log.info("kv_events", endpoint=kv.endpoint, replay=kv.replay_endpoint)
        if self.cfg.otlp_traces_endpoint:
            self.traces = otlp.Exporter(self.cfg.otlp_traces_endpoint, "llmgw-sim")
            self.traces.start()
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run_engine(), name="sim-engine")

    async def _stop_engine(self, _app: web.Application) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.kv_events is not None:
            self.kv_events.close()
        if self.traces is not None:
            await self.traces.close()

    # --- engine loop -------------------------------------------------------------

    async def _run_engine(self) -> None:
        loop = asyncio.get_running_loop()
        engine = self.engine
        wake = self._wake
        assert wake is not None
        zero = self.cfg.latency.zero
        try:
            while True:
                if not engine.has_work:
                    wake.clear()
                    await wake.wait()
                    continue
                now = loop.time()
                if zero:
                    budget = _ZERO_LATENCY_BURST_TOKENS
                    while budget > 0:
                        engine.step(now)
                        if not engine.running:
                            break
                        budget -= len(engine.running)
                    self._publish_kv()
                    self._deliver()
                    await asyncio.sleep(0)
                else:
                    end = now + engine.step(now)
                    self._publish_kv()
                    # The step's tokens exist at its end: deliver them then, not before.
                    await asyncio.sleep(max(0.0, end - loop.time()))
                    self._deliver()
        except asyncio.CancelledError:
            raise
        except Exception:  # pragma: no cover - a bug; say so loudly rather than hang clients
            self.log.exception("engine_loop_failed")
            raise

    def _publish_kv(self) -> None:
        """The step's block events, as one batch (what vLLM sends per scheduler step)."""
        if self.kv_events is not None and self.engine.pool.events:
            self.kv_events.publish(self.engine.pool.take_events())

    def _deliver(self) -> None:
        for r in self.engine.drain_touched():
            w = r.waiter
            if w is not None and not w.done():
                w.set_result(None)

    # --- faults ------------------------------------------------------------------

    def _take_fault(self) -> Faults | None:
        return self.faults.take()

    async def _faults_get(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.faults.json(), content_type=_JSON)

    async def _faults_set(self, request: web.Request) -> web.Response:
        try:
            plan = self.faults.set(await request.read())
        except faultplan.InvalidPlan as exc:
            return _error(api.ApiError(400, f"invalid fault plan: {exc}", code="invalid_value"))
        self.log.info("faults_set", faults=msgspec.to_builtins(plan))
        return web.Response(body=self.faults.json(), content_type=_JSON)

    async def _faults_clear(self, _request: web.Request) -> web.Response:
        self.faults.clear()
        return web.Response(body=self.faults.json(), content_type=_JSON)

    # --- OpenAI endpoints ----------------------------------------------------------

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generation(request, api.prepare_chat, "chatcmpl-")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generation(request, api.prepare_completion, "cmpl-")

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        return await self._generation(request, apis.prepare_responses, "")

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        return await self._generation(request, apis.prepare_messages, "")

    async def _at_once(
        self, request: web.Request, answer: Callable[[bytes], bytes | tuple[bytes, int]]
    ) -> web.Response:
        """An API answered without the engine loop (tokens, scores): its body, its prompt
        tokens counted."""
        try:
            out = answer(await request.read())
        except api.ApiError as exc:
            return _error(exc)
        except web.HTTPRequestEntityTooLarge:
            return _error(api.ApiError(413, "the request body is too large (limit 64 MiB)"))
        body, n = out if isinstance(out, tuple) else (out, 0)
        self.engine.stats.prompt_tokens += n
        return web.Response(body=body, content_type=_JSON)

    async def _count_tokens(self, request: web.Request) -> web.Response:
        # As vLLM's: a count of the prompt, not a prompt the engine processed.
        return await self._at_once(request, lambda b: apis.count_tokens(b, self.cfg))

    async def _tokenize(self, request: web.Request) -> web.Response:
        return await self._at_once(request, lambda b: apis.tokenize(b, self.cfg))

    async def _detokenize(self, request: web.Request) -> web.Response:
        return await self._at_once(request, lambda b: apis.detokenize(b, self.cfg))

    def _rid(self) -> str:
        self._n += 1
        return f"{self._id_prefix}{self._n:x}"

    async def _rerank(self, request: web.Request) -> web.Response:
        return await self._at_once(request, lambda b: apis.rerank(b, self.cfg, self._rid()))

    async def _score(self, request: web.Request) -> web.Response:
        return await self._at_once(
            request, lambda b: apis.score(b, self.cfg, self._rid(), self._created)
        )

    async def _generation(
        self,
        request: web.Request,
        prepare: Callable[[bytes, SimConfig], api.Prepared],
        id_prefix: str,
    ) -> web.StreamResponse:
        try:
            p = prepare(await request.read(), self.cfg)
        except api.ApiError as exc:
            return _error(exc)
        except web.HTTPRequestEntityTooLarge:
            return _error(api.ApiError(413, "the request body is too large (limit 64 MiB)"))
        fault = self._take_fault()
        if fault is not None:
            early = await self._early_fault(request, fault, p.stream)
            if early is not None:
                return early

        loop = asyncio.get_running_loop()
        self._n += 1
        seed = (
            tokens.text_seed(p.seed, "".join(p.prompt))
            if p.seed is not None
            else (self.cfg.seed * 0x9E3779B97F4A7C15 + self._n) & _MASK
        )
        eos_at: int | None = None
        if not p.ignore_eos:
            lo, hi = self.cfg.eos_min_tokens, self.cfg.eos_max_tokens
            eos_at = lo + tokens.Generator(seed ^ 0x5EED).below(hi - lo + 1)
        req = Request(
            f"{id_prefix}{self._id_prefix}{self._n:x}",
            p.prompt,
            max_tokens=p.max_tokens,
            arrival=loop.time(),
            seed=seed,
            eos_at=eos_at,
            stops=p.stops,
            salt=p.salt,
        )
        self.engine.add(req)
        assert self._wake is not None
        self._wake.set()
        try:
            if p.stream:
                return await streaming.stream(request, p, req, fault, zero=self.cfg.latency.zero)
            return await streaming.complete(request, p, req, fault)
        finally:
            if not req.finished:
                self.engine.abort(req, loop.time())
            if self.traces is not None:
                self.traces.add([sim_tracing.request_span(request.headers, req, p.model,
                                                          loop.time())])  # fmt: skip

    async def _early_fault(
        self, request: web.Request, fault: Faults, stream: bool
    ) -> web.StreamResponse | None:
        if fault.stall_at == "headers":
            await asyncio.sleep(fault.stall_s)
        if fault.fail_status is not None:
            return web.Response(
                status=fault.fail_status,
                body=api.error_body(
                    f"injected failure (status {fault.fail_status}) from /sim/faults",
                    "server_error" if fault.fail_status >= 500 else "invalid_request_error",
                    code="injected_fault",
                ),
                content_type=_JSON,
            )
        if fault.die_mid_stream and not stream:
            await streaming.die(request)
        return None

    async def _embeddings(self, request: web.Request) -> web.StreamResponse:
        try:
            body, n = api.embeddings(await request.read(), self.cfg)
        except api.ApiError as exc:
            return _error(exc)
        except web.HTTPRequestEntityTooLarge:
            return _error(api.ApiError(413, "the request body is too large (limit 64 MiB)"))
        fault = self._take_fault()
        if fault is not None:
            early = await self._early_fault(request, fault, False)
            if early is not None:
                return early
            if fault.stall_at is not None and fault.stall_at != "headers":
                await asyncio.sleep(fault.stall_s)
        self.engine.stats.prompt_tokens += n
        return web.Response(body=body, content_type=_JSON)

    async def _models(self, _request: web.Request) -> web.Response:
        return web.Response(body=api.models_body(self.cfg, self._created), content_type=_JSON)

    async def _model(self, request: web.Request) -> web.Response:
        try:
            body = api.model_body(self.cfg, request.match_info["model"], self._created)
        except api.ApiError as exc:
            return _error(exc)
        return web.Response(body=body, content_type=_JSON)

    # --- operations ------------------------------------------------------------------

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response()

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def _state(self, _request: web.Request) -> web.Response:
        """The block pool and queues as numbers, for tests and curious operators."""
        e = self.engine
        pool = e.pool
        return web.Response(
            body=msgspec.json.encode(
                {
                    "running": len(e.running),
                    "waiting": len(e.waiting),
                    "blocks_total": pool.num_blocks,
                    "blocks_used": pool.num_used,
                    "blocks_free": pool.num_free,
                    "blocks_cached": len(pool.cached),
                    "evictions": pool.evictions,
                }
            ),
            content_type=_JSON,
        )

    async def _reset_prefix_cache(self, _request: web.Request) -> web.Response:
        """vLLM's endpoint of the same name: forget every cached block nobody holds."""
        forgotten = self.engine.pool.reset_cache()
        self._publish_kv()
        self.log.info("prefix_cache_reset", blocks=forgotten)
        return web.Response()

    async def _no_route(self, request: web.Request) -> web.Response:
        if request.path in _KNOWN_PATHS:
            exc = api.ApiError(
                405, f"{request.method} is not allowed on {request.path}", code="method_not_allowed"
            )
        else:
            exc = api.ApiError(404, f"no route {request.path} on llmgw sim", code="not_found")
        return _error(exc)


async def serve(cfg: SimConfig, *, announce: Callable[[str], None] = print) -> None:
    """Serve until SIGTERM or SIGINT; `announce` gets the start-up line once the
    socket accepts connections."""
    server = SimServer(cfg)
    if cfg.load_s:
        server.log.info("loading", seconds=cfg.load_s)
        await asyncio.sleep(cfg.load_s)
    runner = web.AppRunner(
        server.app(),
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=cfg.shutdown_timeout_s,
    )
    await runner.setup()
    try:
        sock = listeners.bind(cfg.host, cfg.port, setting="--port")
    except listeners.ListenError:
        await runner.cleanup()
        raise
    site = web.SockSite(runner, sock, backlog=2048)
    await site.start()
    port = runner.addresses[0][1]
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    url = f"http://{host}:{port}"
    server.log.info(
        "listening",
        url=url,
        models=list(cfg.served_model_names),
        blocks=cfg.num_blocks,
        block_size=cfg.block_size,
        max_num_seqs=cfg.max_num_seqs,
    )
    announce(f"llmgw sim listening on {url}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        server.log.info("stopping")
        await runner.cleanup()
    server.log.info("stopped")


def run(cfg: SimConfig) -> None:
    """Run `serve` on uvloop (the CLI's entry)."""

    def say(line: str) -> None:
        print(line, flush=True)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(cfg, announce=say))

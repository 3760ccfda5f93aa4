"""The router's HTTP application: the Router, its OpenAI endpoints and its servers.

`Router` holds one process's state (catalog, endpoint table, keys, the upstream
connection pool, the deadline watchdog, the dispatcher);
`llmgw.router.front.build_server` turns it into aiohttp's low-level server. The request
path is split in rooms, each testable on its own:

- `llmgw.router.admission`: the key, the model, the key's limits; a refusal is data;
- `llmgw.router.attempts`: the pure attempt planner (fallback chain, ranking,
  breakers, retry only before the first byte, the total deadline);
- `llmgw.router.dispatch`: the loop that drives the planner over real connections;
- `llmgw.router.relay`: the engine's SSE stream onto the client's response, with
  `llmgw.router.aiohttp_direct` holding the shortcuts through aiohttp behind a
  version guard;
- `llmgw.router.errors`: what attempts raise and how a refusal is answered;
- `llmgw.router.outcome`: what a request came to, and its access log line.

A request moves to the next endpoint (then to the model's fallbacks) only while
nothing has reached the client: connect errors, 5xx (but a 501: the engine was not
started to serve that API, on any replica), 429, a deadline before the
first byte. Once the first byte is relayed it never moves: a cut stream ends with
an OpenAI error event rather than being spliced onto another engine's answer. A
client that goes away cancels the handler (handler_cancellation), which closes
the upstream connection at once, so the engine frees the request's KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from socket import gethostname
from typing import Any

import aiohttp
from aiohttp import web

from llmgw import logs
from llmgw.bus import servertime
from llmgw.config import ConfigError
from llmgw.core import routing, state
from llmgw.listeners import scrape_target
from llmgw.router import (
    admission,
    aiohttp_direct,
    apis,
    auth,
    choice,
    cors,
    isolation,
    requests,
    tracing,
)
from llmgw.router import outcome as outcome_log
from llmgw.router import ports as feed_ports
from llmgw.router import upstream as upstream_http
from llmgw.router.accounting import asked_out
from llmgw.router.browsers import BrowserGuard
from llmgw.router.clock import ClockKeeper
from llmgw.router.config import RouterConfig
from llmgw.router.deadlines import Watchdog
from llmgw.router.dispatch import Dispatcher
from llmgw.router.errors import ClientGone, Refusal, error_response, refusal_response
from llmgw.router.feed import LogFeed
from llmgw.router.holds import Held
from llmgw.router.kvfeed import KvFeed
from llmgw.router.metrics import Metrics, metrics_dir
from llmgw.router.outcome import Outcome
from llmgw.router.relay import ClientStream
from llmgw.router.signals import LoadTracker, SignalsFeed
from llmgw.router.spool import OwedSpool
from llmgw.router.table import Catalog, EndpointTable, Prober
from llmgw.router.tracing import Tracer

log = logs.get("llmgw.router")

MODEL_PATH = apis.MODEL_PATH


class Router:
    """One router process's state and its request path."""

    def __init__(
        self,
        cfg: RouterConfig,
        *,
        worker: int = 0,
        limits: auth.SharedLimits | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`clock`: this host's wall clock; the router reads the server's (`self.clock`)."""
        self.cfg = cfg
        self.clock = servertime.of(clock)
        """UNIX time: the NATS server's, once measured (llmgw.router.clock)."""
        self.clock_keeper: ClockKeeper | None = None
        self.catalog = Catalog(cfg.models)
        self.table = EndpointTable()
        for ep in cfg.endpoints:
            self.table.add(ep.id, ep.url, ep.models, node=ep.node)
        self.metrics = Metrics(worker=worker)
        self._snapshots: asyncio.Task[None] | None = None
        seed = cfg.seed if cfg.seed is not None else int.from_bytes(os.urandom(8), "big")
        self.rng = random.Random(seed + worker)
        # The keys file's and, with a log, the log's (auth.merged). An anonymous router
        # still knows them: a request with one is its key's (limits, usage, metrics).
        self.keys = auth.Keys()
        self.anonymous = cfg.auth.allow_anonymous
        self.browsers = BrowserGuard(cfg.auth, cfg.listen.host) if self.anonymous else None
        self.file_keys: auth.Keys | None = None
        # With several workers, keys' limits are shared by all of them (see auth).
        self.limits = limits
        if cfg.auth.keys_file:
            self.keys = self.file_keys = auth.load_keys(
                cfg.auth.keys_file, time.monotonic(), limits
            )
        self.session: aiohttp.ClientSession | None = None
        self.prober: Prober | None = None
        self.feed: LogFeed | None = None
        self.kv_feed: KvFeed | None = None
        self.signals: SignalsFeed | None = None
        self.worker = worker
        self.admin_url = ""  # its admin listener's URL, set by the server once bound
        self.pool = upstream_http.Pool(max_idle_per_host=cfg.upstream_connections)
        self.deadlines = Watchdog()
        self.dispatcher = Dispatcher(cfg, self.catalog, self.table, self.metrics, self.pool,
                                     self.deadlines, self.rng, self.clock)  # fmt: skip
        # Decided once: without an access log, a request tests one attribute for it.
        self._access_log = outcome_log.access_log(cfg.access_log)
        self._rid_prefix = f"{os.urandom(4).hex()}-"
        self._rid = 0
        self._use_prefix = choice.wants_text(cfg)
        self._log_keys: dict[str, state.KeyState] = {}
        self.tracer = Tracer(cfg.traces) if cfg.traces is not None else None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        aiohttp_direct.explain()
        isolation.warn_uncached(self.cfg.tenancy.cache_isolation, list(self.cfg.models))
        # aiohttp serves the health and metrics probes; requests go through self.pool.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=256, keepalive_timeout=30.0),
            cookie_jar=aiohttp.DummyCookieJar(),
            timeout=aiohttp.ClientTimeout(total=None),
        )
        self.prober = Prober(self.table, self.session, self.metrics, self.cfg.probe_interval_s)
        await self.prober.probe_all()
        self.prober.start()
        if self.tracer is not None:
            self.tracer.start()
        if self.cfg.log is not None:
            # Keys' fleet-wide limits and usage, on the log's server (llmgw.router.quotas).
            # What a process before this one owed them, first (llmgw.router.spool).
            spool = OwedSpool.open(self.cfg.state_dir, self.worker)
            self.dispatcher.quotas.start(self.cfg.log, spool, self.cfg.workers)
            await self._keep_time()
            # The production wiring: the feed connects in the background (a router
            # started before NATS serves on its static config meanwhile).
            self.feed = LogFeed(
                self.cfg.log,
                self.catalog,
                self.table,
                ports=feed_ports.jetstream(self.cfg.log),
                static_models=frozenset(m.name for m in self.cfg.models),
                static_endpoints=frozenset(ep.id for ep in self.cfg.endpoints),
                on_keys=self.set_log_keys,
            )
            self.feed.start()
            if self.cfg.cache.enabled and self.cfg.cache.events:
                self.kv_feed = KvFeed(self.cfg.log, self.dispatcher.kv.index,
                                      listed=self.table.has, clock=self.clock)  # fmt: skip
                self.kv_feed.start()
            # The load reports the autoscaler decides on (llmgw.router.signals).
            d = self.dispatcher
            tracker = LoadTracker(d.received, self.metrics.ttft, self.metrics.itl, d.holds,
                                  queued=d.queues.waiting)  # fmt: skip
            scraped_at = scrape_target(self.admin_url, gethostname())
            self.signals = SignalsFeed(self.cfg.log, tracker, self.table.by_id,
                                       worker=self.worker, metrics=scraped_at,
                                       clock=self.clock)  # fmt: skip
            self.signals.start()
        folder = metrics_dir()
        if folder is not None:
            self._snapshots = asyncio.get_running_loop().create_task(self._write_snapshots(folder))

    async def _keep_time(self) -> None:
        """Read the server's time on the counters' connection (llmgw.router.clock): measured
        before the router serves, when the server answers soon enough."""
        quotas, gauge = self.dispatcher.quotas, self.metrics.clock_offset
        self.clock_keeper = ClockKeeper(
            self.clock,
            lambda: quotas.counters.nc if quotas.counters is not None else None,
            lambda offset: gauge.set((), offset),
        )
        await self.clock_keeper.start()

    async def _write_snapshots(self, folder: str) -> None:
        """Several workers: publish this one's metrics for whichever worker is scraped."""
        while True:
            try:
                self.metrics.write_snapshot(folder)
            except OSError as exc:
                log.warning("metrics_snapshot_failed", error=str(exc))
            await asyncio.sleep(1.0)

    async def stop(self) -> None:
        if self.clock_keeper is not None:
            await self.clock_keeper.close()
        await self.dispatcher.quotas.close()
        if self.signals is not None:
            await self.signals.close()
        if self.kv_feed is not None:
            await self.kv_feed.close()
        if self.feed is not None:
            await self.feed.close()
        if self._snapshots is not None:
            self._snapshots.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._snapshots
        if self.prober is not None:
            await self.prober.stop()
        if self.session is not None:
            await self.session.close()
        if self.tracer is not None:
            await self.tracer.close()
        self.pool.close()
        self.deadlines.close()

    def set_log_keys(self, log_keys: Mapping[str, state.KeyState]) -> None:
        """The log's keys changed (llmgw.router.feed): in force from the next request."""
        try:
            keys = auth.merged(self.file_keys, log_keys, time.monotonic(), self.limits, self.keys)
        except ConfigError as exc:  # more limited keys than the workers' shared file holds
            log.error("keys_not_applied", error=str(exc), kept=len(self.keys.by_digest))
            return
        self._log_keys = dict(log_keys)
        self.keys = keys

    def reload_keys(self) -> None:
        """Re-read the keys file; a broken file keeps the keys in force (and says why)."""
        if not self.cfg.auth.keys_file:
            return
        try:
            keys = auth.load_keys(self.cfg.auth.keys_file, time.monotonic(), self.limits)
        except ConfigError as exc:
            log.error("keys_reload_failed", error=str(exc), kept=len(self.keys.by_digest))
            return
        if self.file_keys is not None:
            # Keep the buckets of keys that stay, so a reload does not reset their limits.
            for digest, principal in keys.by_digest.items():
                old = self.file_keys.by_digest.get(digest)
                if old is not None and old.settings == principal.settings:
                    keys.by_digest[digest] = old
        try:
            in_force = auth.merged(keys, self._log_keys, time.monotonic(), self.limits, self.keys)
        except ConfigError as exc:  # no room left in the workers' shared limits
            log.error("keys_reload_failed", error=str(exc), kept=len(self.keys.by_digest))
            return
        self.file_keys, self.keys = keys, in_force
        log.info("keys_reloaded", keys=len(keys.by_digest))

    # ------------------------------------------------------------------ handlers

    def _request_id(self, request: web.BaseRequest) -> str:
        rid = request.headers.get("X-Request-Id")
        # Passed upstream as a header: only short printable ASCII is taken as is.
        if rid and len(rid) <= 128 and rid.isascii() and rid.isprintable():
            return rid
        self._rid += 1
        return f"{self._rid_prefix}{self._rid}"

    def _caller(self, request: web.BaseRequest) -> auth.Principal | Refusal | None:
        """The request's key (None: served without one), or why it is refused; a request
        without a key is refused to web pages (llmgw.router.browsers)."""
        principal = admission.authenticate(
            self.keys, admission.credential(request.headers), self.clock(), self.anonymous
        )
        if principal is None and self.browsers is not None:
            return self.browsers.refusal(request.headers)
        return principal

    async def handle_models(self, request: web.BaseRequest) -> web.Response:
        rid = self._request_id(request)
        principal = self._caller(request)
        if isinstance(principal, Refusal):
            return refusal_response(principal, rid)
        data = []
        for name, profile in sorted(self.catalog.names.items()):
            if not admission.may_use(principal, name, profile):
                continue
            data.append({"id": name, "object": "model", "created": 0, "owned_by": "llmgw",
                         "root": profile.name})  # fmt: skip
        return web.json_response({"object": "list", "data": data})

    async def handle_model(self, request: web.BaseRequest) -> web.Response:
        """`GET /v1/models/{id}`: one model (by name or alias) this key may use; else 404."""
        rid = self._request_id(request)
        principal = self._caller(request)
        if isinstance(principal, Refusal):
            return refusal_response(principal, rid)
        name = request.path[len(MODEL_PATH) :]
        profile = admission.resolve(self.catalog, name)
        if isinstance(profile, Refusal) or not admission.may_use(principal, name, profile):
            # The same 404 whether it does not exist or this key may not see it.
            return refusal_response(admission.no_model(name), rid)
        return web.json_response({"id": name, "object": "model", "created": 0,
                                  "owned_by": "llmgw", "root": profile.name})  # fmt: skip

    async def handle_health(self, request: web.BaseRequest) -> web.Response:
        return web.json_response({"status": "ok"})

    async def handle_ready(self, request: web.BaseRequest) -> web.Response:
        """Whether any model has an endpoint to take requests (the status, for a load
        balancer's probe, which sends no key), and each model's count of them: only the
        models the caller's key may use, as `/v1/models` lists them (all of them on an
        anonymous router; none without a key the router knows, nor to a web page that a
        router without keys refuses)."""
        principal = self._caller(request)
        per_model = {
            name: routing.routable(self.table.for_model(name)) for name in self.catalog.profiles
        }
        ready = any(per_model.values())
        shown = {} if isinstance(principal, Refusal) else {
            name: n for name, n in per_model.items()
            if admission.may_use(principal, name, self.catalog.profiles[name])
        }  # fmt: skip
        answer: dict[str, Any] = {"ready": ready, "ready_endpoints": shown}
        isolated = isolation.readiness(
            self.cfg.tenancy.cache_isolation, list(self.catalog.profiles.values())
        )
        if isolated is not None:
            answer["cache_isolation"] = isolated
        return web.json_response(answer, status=200 if ready else 503)

    async def handle_options(self, request: web.BaseRequest) -> web.Response:
        """A browser's CORS preflight of a path the router serves (llmgw.router.cors): no
        key, no limit, no engine. Any other OPTIONS is a wrong method (405) or path (404)."""
        allowed = apis.served_method(request.path)
        if allowed is None or not cors.is_preflight(request):
            return await self.handle_fallthrough(request)
        return cors.answer_preflight(request, allowed)

    async def handle_fallthrough(self, request: web.BaseRequest) -> web.Response:
        """Unknown paths (404) and wrong methods on known paths (405), in OpenAI's shape."""
        return apis.unserved(request.method, request.path)

    def handler(
        self, kind: requests.Kind
    ) -> Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]:
        # A partial, not a wrapping coroutine: one frame less to resume at every await.
        return functools.partial(self.handle_openai, kind=kind)

    async def read_body(self, request: web.BaseRequest) -> bytes | Refusal:
        """The whole body within `body_timeout_s` and `max_body_bytes`, or the refusal."""
        try:
            if request.content.is_eof():
                return await request.read()  # all here already: no timer needed
            async with asyncio.timeout(self.cfg.body_timeout_s):
                return await request.read()
        except TimeoutError:
            # The rest of that body may still come: the connection cannot be reused.
            return admission.body_late(self.cfg.body_timeout_s)
        except web.HTTPRequestEntityTooLarge:
            return admission.body_too_large(self.cfg.max_body_bytes)

    async def handle_openai(
        self, request: web.BaseRequest, kind: requests.Kind
    ) -> web.StreamResponse:
        start = time.monotonic()
        rid = self._request_id(request)
        outcome = Outcome()
        trace = outcome.trace = (
            self.tracer.begin(request.headers, rid, start) if self.tracer is not None else None
        )
        bound = tracing.bind_logs(trace, request.headers)
        try:
            resp = await self._serve(request, kind, rid, start, outcome)
            outcome.status = outcome.status or resp.status
            return resp
        except (asyncio.CancelledError, ConnectionResetError):
            outcome.status = 499  # client closed the request (nginx's convention)
            raise
        except Exception:
            # A bug, not bad input: say so in the API's error shape, keep serving.
            log.exception("request_crashed", request_id=rid)
            outcome.status = 500
            return error_response(
                500, "the router failed on this request (a bug): see its log", "server_error",
                "internal_error", rid, kind,
            )  # fmt: skip
        finally:
            took = time.monotonic() - start
            asked, status = outcome.model, outcome.status or 500
            self.metrics.request_done(asked, status, took)
            p = outcome.principal
            if p is not None:
                self.metrics.key_request(p.name, p.settings.team, asked, status)
            self.dispatcher.quotas.ended(p, asked, status, outcome.tokens, outcome.held)
            if self._access_log is not None:
                outcome.write(self._access_log, rid, kind, took, status)
            if trace is not None:
                assert self.tracer is not None
                t_in, t_out = outcome.tokens
                self.tracer.finish(trace, start + took, kind=kind, model=asked, status=status,
                                   tokens_in=t_in, tokens_out=t_out)  # fmt: skip
            if bound is not None:
                tracing.unbind_logs(bound)

    async def counted(self, principal: auth.Principal | None) -> Refusal | None:
        """One request of the key taken of its requests/s (the 429 when it has none left),
        before its body is read: a key's refused requests cost the router too, and so does
        `POST /route` on the admin listener (llmgw.router.admin), which ranks as they do."""
        if principal is None or not principal.limited:
            return None
        q, wall = self.dispatcher.quotas, self.clock()
        if q.admit_now(principal, wall):
            return None
        return await q.admit(principal, wall, time.monotonic())

    async def _hold(
        self, principal: auth.Principal, prompt_chars: int, parsed: requests.Parsed
    ) -> Held | Refusal:
        """What a metered key's request may cost, held of its limits (llmgw.router.quotas)."""
        q, asks = self.dispatcher.quotas, parsed.choices_field
        answers = parsed.choices * parsed.prompts
        if parsed.prompts > 1:  # each of a completions request's prompts answered alike
            asks = f"{asks} times the {parsed.prompts} prompts"
        held = q.hold_now(principal, prompt_chars, parsed.max_out, self.clock(),
                          answers, parsed.max_field, asks)  # fmt: skip
        if isinstance(held, int):  # more than this router holds for the key
            held = await q.hold(principal, held, self.clock(), time.monotonic(), parsed.max_field)
        return held

    async def _serve(
        self, request: web.BaseRequest, kind: requests.Kind, rid: str, start: float,
        outcome: Outcome,
    ) -> web.StreamResponse:  # fmt: skip
        """Admission, then dispatch; `outcome` gets the model's name once it is known, and
        the status when it is not the response's own."""
        principal = self._caller(request)
        if isinstance(principal, Refusal):
            return refusal_response(principal, rid, kind)
        if principal is not None:
            outcome.key = principal.name
        over = await self.counted(principal)
        if over is not None:
            return refusal_response(over, rid, kind)
        body = await self.read_body(request)
        if isinstance(body, Refusal):
            return refusal_response(body, rid, kind)
        try:
            parsed = requests.parse(kind, body, want_text=self._use_prefix)
        except requests.BadRequest as exc:
            return refusal_response(admission.bad_body(str(exc)), rid, kind)
        profile = admission.resolve(self.catalog, parsed.model)
        if isinstance(profile, Refusal):
            return refusal_response(profile, rid, kind)
        outcome.model = profile.name
        refused = choice.refusal(self.cfg, kind, request.path, principal, parsed, profile)
        # The text is a completions request's first prompt alone: of several, the body.
        prompt_chars = (parsed.prompts == 1 and len(parsed.text)) or len(body)
        if refused is None and principal is not None:
            outcome.principal = principal
            if principal.metered:  # what it may cost, held until it ends
                held = await self._hold(principal, prompt_chars, parsed)
                refused, outcome.held = (held, None) if isinstance(held, Refusal) else (None, held)
        if refused is not None:
            return refusal_response(refused, rid, kind)
        if outcome.trace is not None:
            outcome.trace.admitted = time.monotonic()
        inject_usage = parsed.stream and self.cfg.count_stream_tokens and not parsed.wants_usage
        state = ClientStream(request, rid, start, kind=kind, stream=parsed.stream,
                             drop_usage=inject_usage, principal=principal,
                             trace=outcome.trace, prompt_chars=prompt_chars,
                             usage_coming=inject_usage or parsed.wants_usage,
                             asked_out=asked_out(kind, parsed.max_out, parsed.choices,
                                                 parsed.prompts))  # fmt: skip
        if parsed.stream and self.cfg.keepalive_s > 0:
            state.start_keepalive(self.cfg.keepalive_s)
        try:
            # Where it went is recorded for the access log only.
            seen = outcome if self._access_log is not None else None
            resp = await self.dispatcher.dispatch(request, body, parsed, profile, state, seen)
        except ClientGone:
            outcome.status = 499
            return state.response or web.Response(status=499)
        finally:
            state.stop_keepalive()
            # However it ended: a stream the client cut is charged too (llmgw.router.accounting).
            outcome.tokens = state.tokens
        outcome.status = state.failed_status
        return resp

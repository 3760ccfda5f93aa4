"""The router's HTTP application: OpenAI endpoints, auth, dispatch and the streaming relay.

`Router` holds one process's state (catalog, endpoint table, breakers, prefix
index, keys, the upstream connection pool, the deadline watchdog) and
`build_server` turns it into aiohttp's low-level server. A request is
authenticated, decoded just enough to route, ranked by `llmgw.core.routing`,
and sent to the best endpoint; it moves to the next endpoint (then to the
model's fallbacks) only while nothing has reached the client — connect errors,
5xx, 429, a deadline before the first byte. Once the first byte is relayed it
never moves: a cut stream ends with an OpenAI error event rather than being
spliced onto another engine's answer.

SSE is relayed as raw bytes, whole events at a time, written as soon as they
arrive; only a chunk that carries usage is decoded. Chunks are written from the
engine connection's data callback straight to the client's transport: the first
token with the response's headers, the last events with the end of the body,
and everything between, without waking the handler, which waits for the end. A
client that reads slower than the engine writes goes back to awaited writes,
which wait for it. A client that goes away cancels the handler
(handler_cancellation), which closes the upstream connection at once, so the
engine frees the request's KV blocks. Deadlines (`llmgw.router.deadlines`) share
one loop timer; keep-alive comments before the first token come from a timer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import os
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar, cast

import aiohttp
from aiohttp import web
from aiohttp.http import StreamWriter

from llmgw import logs
from llmgw.config import ConfigError
from llmgw.core import breaker, routing
from llmgw.core.prefix import PrefixIndex, block_hashes
from llmgw.core.profile import Deadlines, ModelProfile
from llmgw.router import auth, protocol, requests, sse
from llmgw.router import upstream as upstream_http
from llmgw.router.config import RouterConfig
from llmgw.router.deadlines import Deadline, Watchdog
from llmgw.router.feed import LogFeed
from llmgw.router.metrics import Metrics, metrics_dir
from llmgw.router.table import Catalog, EndpointTable, Prober

log = logs.get("llmgw.router")

JSON = "application/json"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"
MAX_EVENT_BYTES = 4 * 1024 * 1024
"""An upstream 'event' this long without a blank line is relayed as is rather than buffered."""
SESSIONS_KEPT = 100_000
SCORE_SAMPLE = 8
PATHS: dict[str, requests.Kind] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
}
KNOWN_GET = ("/v1/models", "/health", "/ready")


class Retry(Exception):
    """An attempt failed before anything reached the client: another endpoint may take it."""

    def __init__(self, reason: str, status: int, message: str, *, fault: bool = True) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status
        self.message = message
        self.fault = fault
        """Counts against the endpoint's breaker (a 429 is load, not a fault)."""


def error_response(
    status: int, message: str, type_: str, code: str | None = None, rid: str = ""
) -> web.Response:
    headers = {"X-Request-Id": rid} if rid else None
    return web.Response(
        status=status,
        body=requests.error_body(message, type_, code),
        content_type=JSON,
        headers=headers,
    )


class Router:
    """One router process's state and its request path."""

    def __init__(
        self,
        cfg: RouterConfig,
        *,
        worker: int = 0,
        limits: auth.SharedLimits | None = None,
    ) -> None:
        self.cfg = cfg
        self.catalog = Catalog(cfg.models)
        self.table = EndpointTable()
        for ep in cfg.endpoints:
            self.table.add(ep.id, ep.url, ep.models)
        self.metrics = Metrics(worker=worker)
        self._snapshots: asyncio.Task[None] | None = None
        self.prefix = PrefixIndex(capacity=cfg.prefix.capacity)
        self.sessions: OrderedDict[str, str] = OrderedDict()
        seed = cfg.seed if cfg.seed is not None else int.from_bytes(os.urandom(8), "big")
        self.rng = random.Random(seed + worker)
        self.keys: auth.Keys | None = None
        # With several workers, keys' limits are shared by all of them (see auth).
        self.limits = limits
        if cfg.auth.keys_file:
            self.keys = auth.load_keys(cfg.auth.keys_file, time.monotonic(), limits)
        self.session: aiohttp.ClientSession | None = None
        self.prober: Prober | None = None
        self.feed: LogFeed | None = None
        self._routed = 0
        self._bases: dict[str, tuple[tuple[str, int, bool], str, str]] = {}
        self.pool = upstream_http.Pool(max_idle_per_host=cfg.upstream_connections)
        self.deadlines = Watchdog()
        # An access log at debug level; the check is made once (the default level is info).
        self._access_log = log.is_enabled_for(logging.DEBUG)
        self._rid_prefix = f"{os.urandom(4).hex()}-"
        self._rid = 0
        self._use_prefix = cfg.weights.prefix > 0
        self._session_header = cfg.session_header

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        # aiohttp serves the health and metrics probes; requests go through self.pool.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=256, keepalive_timeout=30.0),
            cookie_jar=aiohttp.DummyCookieJar(),
            timeout=aiohttp.ClientTimeout(total=None),
        )
        self.prober = Prober(self.table, self.session, self.metrics, self.cfg.probe_interval_s)
        await self.prober.probe_all()
        self.prober.start()
        if self.cfg.log is not None:
            self.feed = LogFeed(
                self.cfg.log,
                self.catalog,
                self.table,
                static_models=frozenset(m.name for m in self.cfg.models),
                static_endpoints=frozenset(ep.id for ep in self.cfg.endpoints),
            )
            self.feed.start()
        folder = metrics_dir()
        if folder is not None:
            self._snapshots = asyncio.get_running_loop().create_task(self._write_snapshots(folder))

    async def _write_snapshots(self, folder: str) -> None:
        """Several workers: publish this one's metrics for whichever worker is scraped."""
        while True:
            try:
                self.metrics.write_snapshot(folder)
            except OSError as exc:
                log.warning("metrics_snapshot_failed", error=str(exc))
            await asyncio.sleep(1.0)

    async def stop(self) -> None:
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
        self.pool.close()
        self.deadlines.close()

    def reload_keys(self) -> None:
        """Re-read the keys file; a broken file keeps the keys in force (and says why)."""
        if not self.cfg.auth.keys_file:
            return
        try:
            keys = auth.load_keys(self.cfg.auth.keys_file, time.monotonic(), self.limits)
        except ConfigError as exc:
            log.error("keys_reload_failed", error=str(exc), kept=len(self.keys.by_digest) if
                      self.keys else 0)  # fmt: skip
            return
        if self.keys is not None:
            # Keep the buckets of keys that stay, so a reload does not reset their limits.
            for digest, principal in keys.by_digest.items():
                old = self.keys.by_digest.get(digest)
                if old is not None and old.entry == principal.entry:
                    keys.by_digest[digest] = old
        self.keys = keys
        log.info("keys_reloaded", keys=len(keys.by_digest))

    # ------------------------------------------------------------------ handlers

    def _request_id(self, request: web.BaseRequest) -> str:
        rid = request.headers.get("X-Request-Id")
        # Passed upstream as a header: only short printable ASCII is taken as is.
        if rid and len(rid) <= 128 and rid.isascii() and rid.isprintable():
            return rid
        self._rid += 1
        return f"{self._rid_prefix}{self._rid}"

    def _authenticate(
        self, request: web.BaseRequest, rid: str
    ) -> auth.Principal | web.Response | None:
        if self.keys is None:
            return None
        header = request.headers.get("Authorization")
        if not header:
            return error_response(
                401,
                "no API key: send it as `Authorization: Bearer <key>`",
                "invalid_request_error",
                "missing_api_key",
                rid,
            )
        principal = self.keys.lookup(header)
        if principal is None:
            return error_response(
                401,
                "invalid API key: check the key, or ask the router's operator for one",
                "invalid_request_error",
                "invalid_api_key",
                rid,
            )
        return principal

    async def handle_models(self, request: web.BaseRequest) -> web.Response:
        rid = self._request_id(request)
        principal = self._authenticate(request, rid)
        if isinstance(principal, web.Response):
            return principal
        data = []
        for name, profile in sorted(self.catalog.names.items()):
            if principal is not None and not (
                principal.may_use(name) or principal.may_use(profile.name)
            ):
                continue
            data.append({"id": name, "object": "model", "created": 0, "owned_by": "llmgw",
                         "root": profile.name})  # fmt: skip
        return web.json_response({"object": "list", "data": data})

    async def handle_health(self, request: web.BaseRequest) -> web.Response:
        return web.json_response({"status": "ok"})

    async def handle_ready(self, request: web.BaseRequest) -> web.Response:
        per_model = {
            name: routing.routable(self.table.for_model(name)) for name in self.catalog.profiles
        }
        ready = any(per_model.values())
        return web.json_response(
            {"ready": ready, "ready_endpoints": per_model}, status=200 if ready else 503
        )

    async def handle_fallthrough(self, request: web.BaseRequest) -> web.Response:
        """Unknown paths (404) and wrong methods on known paths (405), in OpenAI's shape."""
        path = request.path
        if path in PATHS or path in KNOWN_GET:
            allowed = "POST" if path in PATHS else "GET"
            resp = error_response(
                405,
                f"{request.method} is not allowed on {path}: use {allowed}",
                "invalid_request_error",
                "method_not_allowed",
            )
            resp.headers["Allow"] = allowed
            return resp
        return error_response(
            404,
            f"unknown path {path}: this router serves /v1/chat/completions, /v1/completions,"
            " /v1/embeddings and /v1/models",
            "invalid_request_error",
            "unknown_url",
        )

    def handler(
        self, kind: requests.Kind
    ) -> Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]:
        # A partial, not a wrapping coroutine: one frame less to resume at every await.
        return functools.partial(self.handle_openai, kind=kind)

    async def handle_openai(
        self, request: web.BaseRequest, kind: requests.Kind
    ) -> web.StreamResponse:
        start = time.monotonic()
        rid = self._request_id(request)
        asked = "unknown"
        status = 500
        try:
            principal = self._authenticate(request, rid)
            if isinstance(principal, web.Response):
                status = principal.status
                return principal
            try:
                if request.content.is_eof():
                    body = await request.read()  # all here already: no timer needed
                else:
                    async with asyncio.timeout(self.cfg.body_timeout_s):
                        body = await request.read()
            except TimeoutError:
                status = 408
                timed_out = error_response(
                    408,
                    f"the request body did not arrive within {self.cfg.body_timeout_s} s:"
                    " send the whole body at once",
                    "invalid_request_error",
                    "request_timeout",
                    rid,
                )
                # The rest of that body may still come: the connection cannot be reused.
                timed_out.force_close()
                return timed_out
            except web.HTTPRequestEntityTooLarge:
                status = 413
                return error_response(
                    413,
                    f"the request body is larger than {self.cfg.max_body_bytes} bytes:"
                    " send a shorter prompt or ask the operator to raise max_body_bytes",
                    "invalid_request_error",
                    "request_too_large",
                    rid,
                )
            try:
                parsed = requests.parse(kind, body, want_text=self._use_prefix)
            except requests.BadRequest as exc:
                status = 400
                return error_response(400, str(exc), "invalid_request_error", "invalid_body", rid)
            profile = self.catalog.resolve(parsed.model)
            if profile is None:
                status = 404
                return error_response(
                    404,
                    f"the model {parsed.model!r} does not exist here: GET /v1/models lists"
                    " the models this router serves",
                    "invalid_request_error",
                    "model_not_found",
                    rid,
                )
            asked = profile.name
            if principal is not None:
                if not (principal.may_use(parsed.model) or principal.may_use(profile.name)):
                    status = 403
                    return error_response(
                        403,
                        f"this API key may not use the model {parsed.model!r}",
                        "permission_error",
                        "model_not_allowed",
                        rid,
                    )
                now = time.monotonic()
                if principal.requests is not None and not principal.requests.take(now):
                    status = 429
                    return error_response(
                        429,
                        f"this API key is over its limit of {principal.entry.requests_per_s}"
                        " requests/s: retry later",
                        "rate_limit_error",
                        "rate_limit_exceeded",
                        rid,
                    )
                if principal.tokens is not None and not principal.tokens.has_credit(now):
                    status = 429
                    return error_response(
                        429,
                        f"this API key is over its limit of {principal.entry.tokens_per_min}"
                        " tokens/min: retry later",
                        "rate_limit_error",
                        "tokens_exceeded",
                        rid,
                    )
            inject_usage = parsed.stream and self.cfg.count_stream_tokens and not parsed.wants_usage
            state = _Relay(request, rid, start, stream=parsed.stream, drop_usage=inject_usage)
            state.kind = kind
            if parsed.stream and self.cfg.keepalive_s > 0:
                state.start_keepalive(self.cfg.keepalive_s)
            try:
                resp = await self.dispatch(request, body, parsed, profile, principal, state)
            except _ClientGone:
                status = 499
                return state.response or web.Response(status=499)
            finally:
                state.stop_keepalive()
            status = state.failed_status or resp.status
            return resp
        except asyncio.CancelledError:
            status = 499  # client closed the request (nginx's convention)
            raise
        except ConnectionResetError:
            status = 499
            raise
        except Exception:
            # A bug, not bad input: say so in OpenAI's shape, keep serving.
            log.exception("request_crashed", request_id=rid)
            status = 500
            return error_response(
                500, "the router failed on this request (a bug): see its log", "server_error",
                "internal_error", rid,
            )  # fmt: skip
        finally:
            took = time.monotonic() - start
            self.metrics.request_done(asked, status, took)
            if self._access_log:
                log.debug("request", request_id=rid, model=asked, status=status, duration_s=took)

    # ------------------------------------------------------------------ dispatch

    async def dispatch(
        self,
        request: web.BaseRequest,
        body: bytes,
        parsed: requests.Parsed,
        profile: ModelProfile,
        principal: auth.Principal | None,
        state: _Relay,
    ) -> web.StreamResponse:
        cfg = self.cfg
        rid = state.rid
        kind = state.kind
        hashes = (
            block_hashes(parsed.text, cfg.prefix.block_chars, cfg.prefix.max_blocks)
            if parsed.text
            else []
        )
        session_key = request.headers.get(self._session_header, "")
        if len(session_key) > 128:
            # Keys are kept (100,000 of them): a long header must not cost its length each.
            session_key = hashlib.blake2b(session_key.encode(), digest_size=16).hexdigest()
        session_ep = self.sessions.get(session_key, "") if session_key else ""
        inject_usage = state.drop_usage
        last: Retry | None = None
        chain = [profile]
        for fb in profile.fallbacks:
            p = self.catalog.resolve(fb)
            if p is None or p in chain:
                continue
            if principal is not None and not (principal.may_use(fb) or principal.may_use(p.name)):
                # A key allowed A is not allowed A's fallback B unless it says so: skipping
                # B answers as if B were down (A's own 503), since the client asked for a
                # model it may use; a 403 would name a model it never asked for.
                log.info(
                    "fallback_not_allowed", request_id=rid, model=profile.name, fallback=p.name
                )
                continue
            chain.append(p)
        for n, prof in enumerate(chain):
            if n > 0:
                self.metrics.fallback(profile.name, prof.name)
                log.info("fallback", request_id=rid, model=profile.name, fallback=prof.name)
            now = time.monotonic()
            q = routing.Query(
                model=prof.name,
                now=now,
                policy=cfg.breaker,
                prefix_blocks=len(hashes),
                prefix_hits=self.prefix.match(hashes) if hashes else {},
                session_endpoint=session_ep,
            )
            ranking = routing.rank(
                self.table.for_model(prof.name), q, cfg.weights, self.rng.random()
            )
            self._routed += 1
            # Scorer values are sampled (1 request in SCORE_SAMPLE): five histogram
            # observations on every request would cost more than the routing itself.
            self.metrics.routed(
                ranking.drops, ranking.winner_scores if self._routed % SCORE_SAMPLE == 0 else {}
            )
            if not ranking.order:
                last = last or Retry(
                    "no_endpoint",
                    503,
                    f"no ready endpoint serves the model {prof.name!r} right now: retry shortly",
                    fault=False,
                )
                continue
            rename = prof.name if prof.name != parsed.model else None
            up_body = (
                requests.rewrite(
                    body, model=rename, include_usage=inject_usage, has_options=parsed.has_options
                )
                if rename is not None or inject_usage
                else body
            )
            for ep in ranking.order[: cfg.max_attempts]:
                if time.monotonic() - state.start >= prof.deadlines.total_s:
                    # The request's whole budget is spent: another try would only time out
                    # at once and count against a healthy endpoint's breaker.
                    break
                if not breaker.allows(ep.breaker, cfg.breaker, time.monotonic()):
                    continue
                try:
                    resp = await self._attempt(ep, kind, prof, up_body, state, principal)
                except Retry as exc:
                    last = exc
                    self.metrics.retry(profile.name, exc.reason)
                    log.info(
                        "attempt_failed",
                        request_id=rid,
                        endpoint=ep.id,
                        reason=exc.reason,
                        detail=exc.message,
                    )
                    continue
                if hashes:
                    self.prefix.record(hashes, ep.id)
                if session_key:
                    self._remember_session(session_key, ep.id)
                return resp
        if last is None:
            # Every candidate's breaker closed between ranking and sending.
            last = Retry(
                "no_endpoint",
                503,
                f"no endpoint of the model {profile.name!r} can take requests right now:"
                " retry shortly",
                fault=False,
            )
        log.warning("request_failed", request_id=rid, model=profile.name, reason=last.reason)
        if state.response is not None and state.response.prepared:
            # Keep-alive comments already went out as a 200: the status can no longer change.
            await state.finish_with_error(last.message, "server_error", last.reason, last.status)
            return state.response
        type_ = "rate_limit_error" if last.status == 429 else "server_error"
        return error_response(last.status, last.message, type_, last.reason, rid)

    def _remember_session(self, key: str, ep_id: str) -> None:
        s = self.sessions
        if s.get(key) == ep_id:
            return
        s[key] = ep_id
        s.move_to_end(key)
        if len(s) > SESSIONS_KEPT:
            s.popitem(last=False)

    async def _attempt(
        self,
        ep: routing.EndpointState,
        kind: requests.Kind,
        prof: ModelProfile,
        body: bytes,
        state: _Relay,
        principal: auth.Principal | None,
    ) -> web.StreamResponse:
        """One try on one endpoint. Raises Retry while nothing has reached the client."""
        cfg = self.cfg
        policy = cfg.breaker
        ep.breaker = breaker.on_attempt(ep.breaker, policy, time.monotonic())
        ep.inflight += 1
        ep.last_sent = time.monotonic()
        self.metrics.attempt(ep.id)
        verdict: bool | None = None  # True success, False fault, None no verdict
        try:
            resp = await self._exchange(ep, kind, prof, body, state, principal)
            verdict = True
            return resp
        except Retry as exc:
            verdict = False if exc.fault else None
            raise
        except _EngineFault:
            verdict = False
            assert state.response is not None
            return state.response
        finally:
            ep.inflight -= 1
            before = ep.breaker.state
            if verdict is True:
                ep.breaker = breaker.on_success(ep.breaker)
            elif verdict is False:
                ep.breaker = breaker.on_failure(ep.breaker, policy, time.monotonic())
            else:
                ep.breaker = breaker.on_abandon(ep.breaker)
            if ep.breaker.state != before:
                log.warning("breaker_" + ep.breaker.state, endpoint=ep.id, url=ep.url)
                self.metrics.breaker_changed(ep.id, ep.breaker.state)

    async def _exchange(
        self,
        ep: routing.EndpointState,
        kind: requests.Kind,
        prof: ModelProfile,
        body: bytes,
        state: _Relay,
        principal: auth.Principal | None,
    ) -> web.StreamResponse:
        d = prof.deadlines
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        total_at = state.loop_start + d.total_s
        base = self._bases.get(ep.url)
        if base is None:
            base = self._bases[ep.url] = upstream_http.parse_base(ep.url)
        key, host_header, prefix = base
        path = prefix + ("/v1/chat/completions" if kind == "chat" else f"/v1/{kind}")
        extra = [("X-Request-Id", state.rid)]
        if ep.api_key:
            extra.append(("Authorization", f"Bearer {ep.api_key}"))
        head = upstream_http.request_head(path, host_header, len(body), extra)
        upstream = await self._open(key, head, body, d, t0, total_at)
        try:
            if (
                state.stream
                and upstream.status == 200
                and upstream.content_type == "text/event-stream"
            ):
                return await self._relay(ep, upstream, prof, principal, state, t0, total_at)
            # A whole body: a non-streamed answer, or one the client must see as is (a 4xx,
            # or an engine's JSON answer to a stream request).
            data = await self._read_body(upstream, d, total_at)
            if upstream.status == 200:
                self._account(prof, principal, data)
            self.metrics.first_token(prof.name, loop.time() - state.loop_start)
            if state.response is not None and state.response.prepared:
                # Keep-alive comments went out as a 200 stream: pass the body as an event.
                state.stop_keepalive()
                await state._write(b"data: " + data + b"\n\n")
                await state.response.write_eof()
                return state.response
            return web.Response(
                status=upstream.status,
                body=data,
                content_type=(upstream.content_type or JSON),
                headers={"X-Request-Id": state.rid},
            )
        finally:
            upstream.close()

    async def _open(
        self,
        key: tuple[str, int, bool],
        head: bytes,
        body: bytes,
        d: Deadlines,
        t0: float,
        total_at: float,
    ) -> upstream_http.Response:
        """Send the request and wait for the response head (connect and headers deadlines).

        Raises Retry for what another endpoint may do better: no connection, no head in
        time, 5xx, 429.
        """
        upstream: upstream_http.Response | None = None
        try:
            async with self.deadlines.at(min(t0 + d.headers_s, total_at)):
                upstream = await self.pool.request(key, head, body, connect_timeout=d.connect_s)
                status = upstream.status
                if status == 401:
                    # The router checked the client itself: an engine's 401 means the key
                    # the router holds for it is not the engine's (a stale EndpointUp).
                    raise Retry(
                        "engine_unauthorized",
                        502,
                        "engine refused the router's key for it: the endpoint's EndpointUp"
                        " does not carry the key its engine was started with",
                    )
                if status >= 500 or status == 429:
                    detail = b""
                    with contextlib.suppress(TimeoutError, upstream_http.UpstreamError, OSError):
                        async with asyncio.timeout(1.0):
                            detail = await upstream.read(2048)
                    raise Retry(
                        "overloaded" if status == 429 else f"status_{status}",
                        429 if status == 429 else 502,
                        f"engine answered {status}: {detail.decode('utf-8', 'replace')[:300]}",
                        fault=status != 429,
                    )
            return upstream
        except BaseException as exc:
            if upstream is not None:
                upstream.close()
            if isinstance(exc, TimeoutError):
                raise Retry("headers_timeout", 504, "engine sent no response headers within"
                            f" {d.headers_s} s") from None  # fmt: skip
            if isinstance(exc, upstream_http.ConnectTimeout):
                raise Retry("connect_timeout", 504, str(exc)) from None
            if isinstance(exc, upstream_http.ConnectError):
                raise Retry("connect_error", 502, str(exc)) from None
            if isinstance(exc, upstream_http.UpstreamError | OSError):
                raise Retry("upstream_error", 502, f"engine connection failed: {exc}") from None
            raise

    async def _read_body(
        self, upstream: upstream_http.Response, d: Deadlines, total_at: float
    ) -> bytes:
        try:
            async with self.deadlines.at(total_at):
                return await upstream.read()
        except TimeoutError:
            raise Retry(
                "total_timeout", 504, f"engine did not finish within {d.total_s} s"
            ) from None
        except (upstream_http.UpstreamError, OSError) as exc:
            raise Retry("upstream_error", 502, f"engine response failed: {exc}") from None

    def _account(self, prof: ModelProfile, principal: auth.Principal | None, data: bytes) -> None:
        u = requests.usage_of(data)
        if u is None or u.usage is None:
            return
        self._count(prof, principal, u.usage)

    def _count(
        self, prof: ModelProfile, principal: auth.Principal | None, usage: requests.Usage
    ) -> None:
        self.metrics.count_tokens(prof.name, usage.prompt_tokens, usage.completion_tokens)
        if principal is not None and principal.tokens is not None:
            principal.tokens.spend(time.monotonic(), usage.prompt_tokens + usage.completion_tokens)

    async def _relay(
        self,
        ep: routing.EndpointState,
        upstream: upstream_http.Response,
        prof: ModelProfile,
        principal: auth.Principal | None,
        state: _Relay,
        t0: float,
        total_at: float,
    ) -> web.StreamResponse:
        """Relay an SSE stream from the engine's data callback (`_Stream.sink`).

        Until the first token the request may still move to another endpoint (Retry):
        nothing has reached the client. The first token leaves from the callback it
        arrived in, with the response's headers, and so does every later chunk: the
        handler wakes only at the end, or when a slow client needs awaited writes.
        """
        loop = asyncio.get_running_loop()
        d = prof.deadlines
        stream = _Stream(self, state, upstream, prof, principal, total_at)
        problem: tuple[str, str] | None = None
        try:
            async with self.deadlines.at(min(t0 + d.first_token_s, total_at)) as cm:
                stream.deadline = cm
                upstream.relay_to(stream.sink)
                try:
                    early = upstream.take_pending()  # body bytes that came with the head
                    if early:
                        stream.sink(early)
                    await upstream.wait_end()
                finally:
                    upstream.relay_to(None)
                if stream.gone:
                    raise _ClientGone
                if stream.failed:
                    problem = ("relay_error", "the router failed relaying the stream (a bug):"
                               " see its log")  # fmt: skip
                elif not stream.t_first:
                    raise Retry("empty_stream", 502, "engine ended the stream before any token")
                else:
                    # A slow client (or none of the above: the body is complete, and this
                    # reads nothing): awaited writes, which wait for it.
                    resp = await state.prepare()
                    while True:
                        chunk = await upstream.read_any()
                        if not chunk:
                            break
                        stream.arrived(loop.time())
                        out = stream.take(chunk)
                        if out:
                            # (`held` is empty here: the sink gives up only right
                            # after a write, which takes it.)
                            try:
                                await resp.write(out)
                            except ConnectionResetError:
                                raise _ClientGone from None
        except TimeoutError:
            if not stream.t_first:
                raise Retry(
                    "first_token_timeout", 504, f"engine sent no first token within"
                    f" {d.first_token_s} s"
                ) from None  # fmt: skip
            if stream.deadline is not None and stream.deadline.when >= total_at:
                problem = ("total_timeout", f"the engine did not finish within {d.total_s} s")
            else:
                problem = ("idle_timeout", f"the engine sent nothing for {d.idle_s} s")
        except (upstream_http.UpstreamError, OSError) as exc:
            if not stream.t_first:
                raise Retry("upstream_error", 502, f"engine response failed: {exc}") from None
            problem = ("engine_disconnected", f"the engine's stream broke off: {exc}")
        if stream.chunks > 1:
            self.metrics.inter_token(
                prof.name, (stream.t_last - stream.t_first) / (stream.chunks - 1)
            )
        if problem is None and not stream.tail.endswith(DONE):
            problem = ("engine_disconnected", "the engine ended the stream before it was complete")
        if problem is not None:
            log.warning("stream_cut", request_id=state.rid, endpoint=ep.id, reason=problem[0])
            upstream.close()
            if stream.held:
                # Whole events kept for the end of the body: the client gets them (with
                # [DONE]), then the error.
                resp = await state.prepare()
                with contextlib.suppress(ConnectionResetError):
                    await resp.write(stream.held)
            await state.finish_with_error(
                problem[1], "server_error", problem[0], 504 if "timeout" in problem[0] else 502
            )
            raise _EngineFault
        resp = await state.prepare()
        try:
            # The rest (for a fast engine: the whole answer, headers included) and the end
            # of the body, in one send.
            await resp.write_eof(stream.held)
        except ConnectionResetError:
            raise _ClientGone from None
        return resp


DIRECT_HIGH_WATER = 64 * 1024
"""Bytes waiting in the client's transport that take a stream off the direct path."""
END_NOW_MAX = 16 * 1024
"""The most bytes a stream's end is written with from the data callback (see `_Stream.sink`)."""
OPENERS_HELD = 4096
"""Role-only opening events held back for the first token, at most this many bytes."""


class _Stream:
    """One relayed stream: whole events out of the engine's bytes, usage counted, the
    deadlines moved with each chunk, written to the client from the engine's data
    callback (`sink`)."""

    __slots__ = (
        "buf", "chunked", "chunks", "deadline", "drop", "failed", "first", "gone", "held",
        "idle", "loop", "principal", "prof", "router", "state", "t_first", "t_last", "tail",
        "total_at", "transport", "upstream",
    )  # fmt: skip

    def __init__(
        self,
        router: Router,
        state: _Relay,
        upstream: upstream_http.Response,
        prof: ModelProfile,
        principal: auth.Principal | None,
        total_at: float,
    ) -> None:
        self.router = router
        self.state = state
        self.upstream = upstream
        self.prof = prof
        self.principal = principal
        self.drop = state.drop_usage
        self.loop = asyncio.get_running_loop()
        self.first = b""
        """Role-only opening events, held until the first token comes."""
        self.buf = b""
        self.tail = b""
        """The last bytes relayed: a complete stream ends with [DONE]."""
        self.held = b""
        """Events ending in [DONE], kept to leave with the end of the body."""
        self.chunks = 0
        self.t_first = 0.0
        """When the first token came (0: not yet, the request may still move elsewhere)."""
        self.t_last = 0.0
        self.idle = prof.deadlines.idle_s
        self.total_at = total_at
        self.deadline: Deadline | None = None
        self.transport: asyncio.WriteTransport | None = None
        """The client's, once the response has started."""
        self.chunked = True
        self.failed = False
        """The direct path hit a bug (logged); the stream is cut."""
        self.gone = False
        """The client went away while the callback wrote to it."""

    def take(self, data: bytes) -> bytes:
        """The whole events now complete (usage counted, a requested usage chunk dropped)."""
        buf = self.buf + data if self.buf else data
        cut = buf.rfind(b"\n\n")
        if cut < 0 and len(buf) <= MAX_EVENT_BYTES:
            self.buf = buf
            return b""
        end = cut + 2 if cut >= 0 else len(buf)
        if end < len(buf):
            out, self.buf = buf[:end], buf[end:]
        else:
            out, self.buf = buf, b""
        at = out.find(sse.USAGE_KEY)
        if at >= 0:
            out, usages = sse.take_usage(out, at, drop=self.drop)
            for usage in usages:
                self.router._count(self.prof, self.principal, usage)
        if out:
            self.tail = out
        return out

    def arrived(self, now: float) -> None:
        """A chunk came: count it and move the idle deadline past it."""
        self.chunks += 1
        self.t_last = now
        d = self.deadline
        if d is not None and d.when < self.total_at and not d.expired():
            d.reschedule(min(now + self.idle, self.total_at))

    def _first_token(self, data: bytes, now: float) -> bytes | None:
        """The bytes to relay once the first token is in (None: not yet, or too late)."""
        first = self.first + data if self.first else data
        if len(first) < OPENERS_HELD and sse.only_openers(first):
            # A chat stream opens with a role-only chunk before any token (vLLM sends it
            # with the first token, others at once): held back, so the first-token
            # deadline still covers the wait and the request can still move elsewhere.
            self.first = first
            return None
        d = self.deadline
        if d is None or d.expired():
            return None  # the first-token deadline fired: the request moves on
        self.first = b""
        self.t_first = self.t_last = now
        self.chunks = 1
        d.reschedule(min(now + self.idle, self.total_at))  # from here: the idle gap
        self.state.stop_keepalive()
        self.router.metrics.first_token(self.prof.name, now - self.state.loop_start)
        return first

    def sink(self, data: bytes) -> None:
        try:
            now = self.loop.time()
            if self.t_first:
                self.arrived(now)
            else:
                first = self._first_token(data, now)
                if first is None:
                    return
                data = first
            out = self.take(data)
            if not out:
                return
            if self.held:
                out = self.held + out
                self.held = b""
            if out.endswith(DONE):
                client = self.state.request.transport
                if (
                    self.upstream.at_eof()
                    and len(out) < END_NOW_MAX
                    and client is not None
                    and not client.is_closing()
                    and not client.get_write_buffer_size()
                ):
                    # The end: the last events and the end of the body leave together,
                    # now. (Nothing waits in the client's transport and this is small, so
                    # aiohttp's write_eof has nothing to wait for.)
                    self.state.end_now(out)
                    return
                self.held = out  # most likely the end: it leaves with the last chunk marker
                return
            t = self.transport
            if t is None:
                # The response starts: aiohttp's headers leave in the same send.
                self.state.write_now(out)
                self.chunked = bool(self.state.response and self.state.response.chunked)
                # uvloop's transports are not asyncio.Transport subclasses, only alike.
                t = self.transport = cast(asyncio.WriteTransport, self.state.request.transport)
            elif t.is_closing():
                return  # the client left; its handler is being cancelled
            elif self.chunked:
                t.write(b"%x\r\n%b\r\n" % (len(out), out))
            else:
                t.write(out)  # HTTP/1.0: the body ends with the connection
            if t.get_write_buffer_size() > DIRECT_HIGH_WATER:
                self.router.metrics.slow_client(self.prof.name)
                self.upstream.relay_to(None)
        except ConnectionResetError:
            self.gone = True
            self.upstream.relay_to(None)
        except Exception:  # a bug: never raise into the engine connection's callback
            log.exception("relay_failed")
            self.failed = True
            self.upstream.relay_to(None)


class _SSEResponse(web.StreamResponse):
    """A streamed response whose headers leave with its first bytes: one send, not two.

    (aiohttp's web.Response buffers headers the same way; StreamResponse sends them at
    prepare() unless told otherwise.) On loopback every send also runs the receiver's
    TCP path in the sender's context, so saved sends are saved CPU.
    """

    _send_headers_immediately = False


class _EngineFault(Exception):
    """The stream broke after the first byte; the client already got an error event."""


class _ClientGone(Exception):
    """Writing to the client failed: it went away. Upstream is closed on the way out."""


class _Relay:
    """Per-request relay state shared across attempts (the client response, once started)."""

    __slots__ = (
        "drop_usage", "failed_status", "keepalive", "keepalive_s", "kind", "loop",
        "loop_start", "request", "response", "rid", "start", "stream",
    )  # fmt: skip

    def __init__(
        self, request: web.BaseRequest, rid: str, start: float, *, stream: bool, drop_usage: bool
    ) -> None:
        self.request = request
        self.rid = rid
        self.start = start
        self.kind: requests.Kind = "chat"
        self.response: web.StreamResponse | None = None
        self.stream = stream
        self.drop_usage = drop_usage
        self.failed_status = 0
        """The status metrics record for a stream that ended with an error event."""
        self.loop = asyncio.get_running_loop()
        # Deadlines run on the loop's clock; start was taken on time.monotonic (the same clock
        # under asyncio's default and uvloop), so the phases line up with the request's start.
        self.loop_start = self.loop.time() - (time.monotonic() - start)
        self.keepalive: asyncio.TimerHandle | None = None
        self.keepalive_s = 0.0

    def _sse_response(self) -> web.StreamResponse:
        if self.response is None:
            resp = _SSEResponse(status=200, headers=SSE_HEADERS)
            resp.headers["X-Request-Id"] = self.rid
            if self.request.version >= aiohttp.HttpVersion11:
                # What aiohttp does anyway for a body of unknown length, said up front: the
                # relay writes the next chunks itself (`_Stream.sink`).
                resp.enable_chunked_encoding()
            self.response = resp
        return self.response

    async def prepare(self) -> web.StreamResponse:
        resp = self._sse_response()
        if not resp.prepared:
            try:
                await resp.prepare(self.request)
            except ConnectionResetError:
                raise _ClientGone from None
        return resp

    def write_now(self, data: bytes) -> None:
        """Write to the client here and now, from a protocol callback or a timer.

        aiohttp's prepare and write are coroutines, but as the relay uses them (a plain
        request, no compression, no signals, `drain=False`) they never wait: they run to
        their end at once, without a task. Raises ConnectionResetError if the client left.
        """
        writer = _run_now(self._sse_response().prepare(self.request))
        if not isinstance(writer, StreamWriter):
            raise RuntimeError(f"unexpected response writer {writer!r} (the response ended?)")
        _run_now(writer.write(data, drain=False))

    def end_now(self, data: bytes) -> None:
        """Write the last bytes and end the response here and now (see `write_now`): the
        caller knows aiohttp's write_eof has nothing to wait for."""
        resp = self._sse_response()
        _run_now(resp.prepare(self.request))
        _run_now(resp.write_eof(data))

    def start_keepalive(self, every: float) -> None:
        """SSE comments every `every` seconds until the first token (for load balancers
        that close idle connections)."""
        self.keepalive_s = every
        self.keepalive = self.loop.call_later(every, self._keep_alive)

    def _keep_alive(self) -> None:
        self.keepalive = None
        try:
            self.write_now(KEEPALIVE)
        except ConnectionResetError:
            return  # the client left; its handler is being cancelled
        except Exception:  # a bug: never raise into the loop
            log.exception("keepalive_failed", request_id=self.rid)
            return
        self.keepalive = self.loop.call_later(self.keepalive_s, self._keep_alive)

    def stop_keepalive(self) -> None:
        if self.keepalive is not None:
            self.keepalive.cancel()
            self.keepalive = None

    async def _write(self, data: bytes) -> None:
        resp = await self.prepare()
        try:
            await resp.write(data)
        except ConnectionResetError:
            raise _ClientGone from None

    async def finish_with_error(self, message: str, type_: str, code: str, status: int) -> None:
        self.stop_keepalive()  # nothing may follow the end of the body
        self.failed_status = status
        resp = await self.prepare()
        with contextlib.suppress(ConnectionResetError):
            await resp.write_eof(requests.error_event(message, type_, code))


_T = TypeVar("_T")


def _run_now(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run a coroutine that does not wait to its end, here and now; one that would
    wait is closed and raises RuntimeError."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return cast(_T, stop.value)
    coro.close()
    raise RuntimeError(f"{coro!r} waited where it was expected not to")


def build_server(router: Router) -> web.Server:
    """The client-facing HTTP server: aiohttp's low-level server and one dispatch function.

    An Application would add URL resolution, match info, middlewares and signals to every
    request; five fixed paths need a dict lookup. The caller starts and stops `router`.
    """
    posts = {path: router.handler(kind) for path, kind in PATHS.items()}
    gets = {
        "/v1/models": router.handle_models,
        "/health": router.handle_health,
        "/ready": router.handle_ready,
    }
    max_size = router.cfg.max_body_bytes
    loop = asyncio.get_running_loop()

    def handle(request: web.BaseRequest) -> Awaitable[web.StreamResponse]:
        # Returns the handler's coroutine for aiohttp to await: no frame of its own.
        table = posts if request.method == "POST" else gets if request.method == "GET" else None
        h = table.get(request.path) if table is not None else None
        if h is None:
            return router.handle_fallthrough(request)
        return h(request)

    def make_request(
        message: Any, payload: Any, protocol: Any, writer: Any, task: Any
    ) -> web.BaseRequest:
        return web.BaseRequest(
            message, payload, protocol, writer, task, loop, client_max_size=max_size
        )

    # handler_cancellation: a client that disconnects cancels its handler, which closes the
    # upstream connection, so the engine stops generating and frees the KV blocks.
    return protocol.Server(
        handle,
        request_factory=make_request,
        handler_cancellation=True,
        access_log=None,
        head_timeout_s=router.cfg.header_timeout_s,
    )


def build_admin_app(router: Router) -> web.Application:
    """Metrics and health, on the admin listener."""
    app = web.Application()

    async def metrics(_: web.Request) -> web.Response:
        # On the loop, not in a thread: the hot path mutates the same dicts without locks.
        body = router.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    return app

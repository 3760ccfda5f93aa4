"""The dispatch loop: the attempt planner (`llmgw.router.attempts`) driven with real I/O.

`Dispatcher.dispatch` asks the planner for an endpoint, sends the request over
the upstream pool (`llmgw.router.upstream`), and relays the answer
(`llmgw.router.relay`); an attempt that fails before anything reached the
client raises `Retry` and the planner is asked again. It also keeps the
per-endpoint bookkeeping the planner reads: in-flight counts, breakers (a
verdict per attempt), the prefix index and the session map. It implements the
relay's `Hooks` (token counting, by llmgw.router.accounting, and stream metrics).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from aiohttp import web

from llmgw import logs
from llmgw.core import breaker, redaction, routing
from llmgw.core.prefix import ChatHashes, PrefixIndex
from llmgw.core.profile import Deadlines, ModelProfile
from llmgw.router import admission, apis, choice, errors, isolation, requests, tracecontext
from llmgw.router import upstream as upstream_http
from llmgw.router.accounting import Accounting
from llmgw.router.attempts import Attempt, Rules
from llmgw.router.config import RouterConfig
from llmgw.router.deadlines import Watchdog
from llmgw.router.errors import JSON, EngineFault, Refusal, Retry, as_retry, refusal_response
from llmgw.router.holding import Holds
from llmgw.router.kvroute import CachePlan, KvRouting
from llmgw.router.metrics import Metrics
from llmgw.router.outcome import Outcome
from llmgw.router.queueing import Queues
from llmgw.router.quotas import Quotas
from llmgw.router.relay import ClientStream, EngineStream, relay
from llmgw.router.table import Catalog, EndpointTable

log = logs.get("llmgw.router")

SESSIONS_KEPT = 100_000
SCORE_SAMPLE = 8
NOT_IMPLEMENTED = 501
"""An engine's answer for an API it serves only when started so: relayed, not retried."""


class Dispatcher:
    """Sends requests to endpoints: one per router process, shared by its requests."""

    usage: Callable[[ModelProfile, ClientStream, requests.Usage], None]
    first_token: Callable[[str, float], None]
    slow_client: Callable[[str], None]
    inter_token: Callable[[str, float], None]

    def __init__(
        self,
        cfg: RouterConfig,
        catalog: Catalog,
        table: EndpointTable,
        metrics: Metrics,
        pool: upstream_http.Pool,
        watchdog: Watchdog,
        rng: random.Random,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        """UNIX time, the router's (llmgw.router.clock)."""
        self.catalog = catalog
        self.table = table
        self.metrics = metrics
        self.pool = pool
        self.watchdog = watchdog
        self.rng = rng
        self.prefix = PrefixIndex(capacity=cfg.prefix.capacity)
        self.chat_hashes = ChatHashes()
        """The text index's hashes of chat prompts, by their leading messages."""
        self.kv = KvRouting.configured(cfg.cache)
        table.on_remove.append(self.kv.forget)
        self.holds = Holds(table.for_model)
        self.queues = Queues(table.for_model, metrics)
        self.quotas = Quotas()
        """Keys' limits and usage (llmgw.router.quotas); the Router starts its flusher."""
        self.quotas.clock = clock
        self.quotas.default_out = cfg.auth.default_max_tokens
        self.quotas.processes = cfg.auth.fleet_routers * cfg.workers
        self.accounting = Accounting(metrics, self.kv, self.quotas)
        self.received: dict[str, int] = {}
        """Model -> requests dispatched (the load reports' request counts)."""
        # The relay's hooks are the accounting's and the metrics' own methods: no forwarding.
        self.usage = self.accounting.usage
        self.first_token = metrics.first_token
        self.slow_client = metrics.slow_client
        self.inter_token = metrics.inter_token
        self.sessions: OrderedDict[str, str] = OrderedDict()
        self._routed = 0
        self._bases: dict[str, tuple[tuple[str, int, bool], str, str]] = {}
        self._session_header = cfg.session_header
        self._isolation = cfg.tenancy.cache_isolation
        self._debug = log.is_enabled_for(logging.DEBUG)
        self.rules = Rules(
            self._routable,
            weights=cfg.weights,
            policy=cfg.breaker,
            max_attempts=cfg.max_attempts,
            draw=rng.random,
            cost=cfg.cache.cost,
        )

    # ------------------------------------------------------------------ the loop

    def _routable(self, model: str) -> Sequence[routing.EndpointState]:
        """The endpoints of `model` ranking may choose: those with room, for a model whose
        profile bounds them (llmgw.router.queueing)."""
        eps = self.table.for_model(model)
        profile = self.catalog.profiles.get(model)
        return eps if profile is None else self.queues.with_room(profile, eps)

    def _chain(
        self, profile: ModelProfile, state: ClientStream, choices: int
    ) -> list[ModelProfile]:
        """The models a request of `choices` answers may be served by (llmgw.router.choice),
        its skipped fallbacks logged."""
        models, skipped = choice.chain(self, profile, state.principal, state.kind, choices)
        isolated = choice.isolated(self.cfg)
        for p in skipped:  # the key may not use it, or its engine lacks the API
            served = apis.serves(state.kind, p, choices, isolated)
            log.info("fallback_skipped", request_id=state.rid, model=profile.name,
                     fallback=p.name, api_served=served)  # fmt: skip
        return models

    def _ranked(self, n: int, prof: ModelProfile, ranking: routing.Ranking) -> None:
        """The planner ranked a model's endpoints: the routing metrics."""
        self._routed += 1
        # Scorer values are sampled (1 request in SCORE_SAMPLE): five histogram
        # observations on every request would cost more than the routing itself.
        self.metrics.routed(
            ranking.drops, ranking.winner_scores if self._routed % SCORE_SAMPLE == 0 else {}
        )

    def _fallback_hook(
        self, asked: str, rid: str
    ) -> Callable[[int, ModelProfile, routing.Ranking], None]:
        """`_ranked`, and for a fallback reached its metric and log line."""

        def ranked(n: int, prof: ModelProfile, ranking: routing.Ranking) -> None:
            if n > 0:
                self.metrics.fallback(asked, prof.name)
                log.info("fallback", request_id=rid, model=asked, fallback=prof.name)
            self._ranked(n, prof, ranking)

        return ranked

    # long: the request path, written flat: a helper's call would be paid by every request
    async def dispatch(
        self,
        request: web.BaseRequest,
        body: bytes,
        parsed: requests.Parsed,
        profile: ModelProfile,
        state: ClientStream,
        seen: Outcome | None = None,
    ) -> web.StreamResponse:
        """Send the request and relay its answer; where it went is told to `seen` (the
        access log's: None when that log is off)."""
        self.received[profile.name] = self.received.get(profile.name, 0) + 1
        waited = await self._wait_for_room(profile, state)
        if waited is not None:
            return await self._refuse(waited, profile, state)
        g = choice.grounds(self, parsed, profile, state.principal,
                           request.headers.get(self._session_header, ""), self.clock())  # fmt: skip
        salt, hashes, session_key, plan = g.salt, g.hashes, g.session_key, g.plan
        # Without fallbacks (the common case) no closure is made per request.
        planner = choice.planner(self, self._chain(profile, state, parsed.choices), state.start, g,
                                 self._fallback_hook(profile.name, state.rid)
                                 if profile.fallbacks else self._ranked)  # fmt: skip
        up_body, body_of = body, ""  # the body as the engine gets it, and for which model
        sent: Attempt | None = None  # the last attempt sent, and how many were
        tries = 0
        try:
            while True:
                step = planner.next(time.monotonic())
                if not isinstance(step, Attempt):
                    break
                if body_of != step.profile.name:
                    body_of = step.profile.name
                    salting = isolation.salting(self._isolation, step.profile, salt)
                    rewrite = (body_of != parsed.model or state.drop_usage or parsed.priority
                               or salting)  # fmt: skip
                    try:
                        up_body = (
                            self._body_for(body, parsed, step.profile, state, salting)
                            if rewrite
                            else body
                        )
                    except requests.BadRequest as exc:
                        return await self._refuse(admission.bad_body(str(exc)), profile, state)
                if plan is not None:
                    self._sending_on_cache(plan, step, state)
                sent, tries = step, tries + 1
                try:
                    resp = await self._attempt(step, up_body, state)
                except Retry as exc:
                    planner.failed(exc)
                    self.metrics.retry(profile.name, exc.reason)
                    log.info("attempt_failed", request_id=state.rid, endpoint=step.endpoint.id,
                             reason=exc.reason, detail=exc.message)  # fmt: skip
                    continue
                planner.answered()
                if hashes:
                    self.prefix.record(hashes, step.endpoint.id)
                if plan is not None and step.profile.name == plan.model:
                    self._routed_on_cache(plan, step.endpoint, state)
                if session_key:
                    self._remember_session(session_key, step.endpoint.id)
                return resp
            assert isinstance(step, Refusal)
            return await self._refuse(step, profile, state)
        finally:
            if seen is not None:  # however it ended: a client gone mid-stream too
                seen.routed(sent, tries, state.cached_predicted)

    async def _wait_for_room(self, profile: ModelProfile, state: ClientStream) -> Refusal | None:
        """Hold a request while its model is at zero replicas (until one serves), queue it
        while every endpoint is full (llmgw.router.queueing); the refusal when it gives up."""
        waited = 0.0  # when the wait began; the common path reads no clock
        refused: Refusal | None = None
        if profile.autoscale is not None and self.holds.needed(profile):
            waited = time.monotonic()
            refused = await self.holds.wait(profile)
        if refused is None and self.queues.needed(profile):
            waited = waited or time.monotonic()
            deadline = state.start + profile.deadlines.total_s
            refused = await self.queues.wait(profile, state.principal, deadline)
        if waited and state.trace is not None:
            state.trace.queue = (waited, time.monotonic())
        return refused

    def _sending_on_cache(self, plan: CachePlan, step: Attempt, state: ClientStream) -> None:
        """An attempt of a request ranked on the cache is about to go out: remember its
        blocks at its endpoint now (the next request with its prefix may come before it is
        answered, and before the engine's events say so), and the prediction the engine's
        usage will be compared with. A fallback model's attempt was not ranked on it."""
        if step.profile.name != plan.model:
            state.cached_predicted = -1
            return
        state.cached_predicted = self.kv.routed(plan, step.endpoint, self.clock())
        state.cached_endpoint = step.endpoint.id

    def _routed_on_cache(
        self, plan: CachePlan, ep: routing.EndpointState, state: ClientStream
    ) -> None:
        """Where a request ranked on the cache went: the prediction's metrics and, at debug,
        a line of what it was predicted on."""
        predicted = max(state.cached_predicted, 0)
        source = plan.by_endpoint[ep.id].source if ep.id in plan.by_endpoint else "none"
        self.metrics.cache_predicted(plan.model, plan.prompt_tokens, predicted, source)
        if self._debug:
            log.debug("routed_on_cache", request_id=state.rid, model=plan.model, endpoint=ep.id,
                      prompt_tokens=plan.prompt_tokens, predicted_cached=predicted,
                      source=source, candidates=plan.cached, families=plan.families,
                      prefix=f"{plan.tie_key:016x}")  # fmt: skip

    def _body_for(
        self,
        body: bytes,
        parsed: requests.Parsed,
        prof: ModelProfile,
        state: ClientStream,
        salting: requests.Salting = None,
    ) -> bytes:
        """The body an engine of `prof` gets: the model renamed for a fallback or an alias,
        the usage chunk asked for when the router counts a stream's tokens, no `priority`,
        the tenant's `cache_salt` under isolation (`salting`: llmgw.router.isolation)."""
        rename = prof.name if prof.name != parsed.model else None
        if rename is None and not state.drop_usage and not parsed.priority and not salting:
            return body
        return requests.rewrite(body, model=rename, include_usage=state.drop_usage,
                                has_options=parsed.has_options,
                                drop_priority=parsed.priority, salt=salting)  # fmt: skip

    async def _refuse(
        self, refusal: Refusal, profile: ModelProfile, state: ClientStream
    ) -> web.StreamResponse:
        code = refusal.code or ""
        log.warning("request_failed", request_id=state.rid, model=profile.name, reason=code)
        if state.response is not None and state.started:
            # Keep-alive comments already went out as a 200: the status can no longer change.
            await state.finish_with_error(refusal.message, "server_error", code, refusal.status)
            return state.response
        return refusal_response(refusal, state.rid, state.kind)

    def _remember_session(self, key: str, ep_id: str) -> None:
        """The latest SESSIONS_KEPT sessions, the least recently served forgotten first: a
        session that goes on at its endpoint is as recent as its last request."""
        s = self.sessions
        if s.get(key) == ep_id:
            s.move_to_end(key)
            return
        s[key] = ep_id
        s.move_to_end(key)
        if len(s) > SESSIONS_KEPT:
            s.popitem(last=False)

    # ------------------------------------------------------------------ one attempt

    async def _attempt(self, at: Attempt, body: bytes, state: ClientStream) -> web.StreamResponse:
        """One try on one endpoint. Raises Retry while nothing has reached the client."""
        ep = at.endpoint
        policy = self.cfg.breaker
        ep.breaker = breaker.on_attempt(ep.breaker, policy, time.monotonic())
        ep.inflight += 1
        ep.last_sent = time.monotonic()
        self.metrics.attempt(ep.id)
        trace = state.trace
        if trace is not None:
            trace.attempt_begin(ep.id, ep.url, at.profile.name, ep.last_sent)
        verdict: bool | None = None  # True success, False fault, None no verdict
        error = "cancelled"  # what the attempt's span says went wrong ("" nothing)
        try:
            resp = await self._exchange(at, body, state)
            verdict, error = True, ""
            return resp
        except Retry as exc:
            verdict, error = False if exc.fault else None, exc.reason
            raise
        except EngineFault:
            verdict, error = False, "engine_fault"
            assert state.response is not None
            return state.response
        finally:
            if trace is not None:
                trace.attempt_end(error, time.monotonic())
            ep.inflight -= 1
            self.queues.release(at.profile.name)
            before = ep.breaker.state
            if verdict is True:
                ep.breaker = breaker.on_success(ep.breaker)
            elif verdict is False:
                ep.breaker = breaker.on_failure(ep.breaker, policy, time.monotonic())
            else:
                ep.breaker = breaker.on_abandon(ep.breaker)
            if ep.breaker.state != before:
                log.warning("breaker_" + ep.breaker.state, endpoint=ep.id,
                            url=redaction.shown_url(ep.url))  # fmt: skip
                self.metrics.breaker_changed(ep.id, ep.breaker.state)

    async def _exchange(self, at: Attempt, body: bytes, state: ClientStream) -> web.StreamResponse:
        ep, prof = at.endpoint, at.profile
        d = prof.deadlines
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        total_at = state.loop_start + d.total_s
        base = self._bases.get(ep.url)
        if base is None:
            base = self._bases[ep.url] = upstream_http.parse_base(ep.url)
        key, host_header, prefix = base
        kind = state.kind
        path = prefix + apis.UPSTREAM[kind]
        extra = [("X-Request-Id", state.rid)]
        if ep.api_key:
            extra.append(("Authorization", f"Bearer {ep.api_key}"))
        if state.trace is not None:
            extra += state.trace.headers()  # this attempt's span: the engine's parent
        elif "traceparent" in state.request.headers:
            extra += tracecontext.forwarded(state.request.headers)
        head = upstream_http.request_head(path, host_header, len(body), extra)
        upstream = await self._open(key, head, body, d, t0, total_at, ep.api_key)
        stream: EngineStream | None = None
        try:
            if (
                state.stream
                and upstream.status == 200
                and upstream.content_type == "text/event-stream"
            ):
                stream = EngineStream(state, upstream, prof, self, total_at, ep.id)
                relayed = await relay(stream, self.watchdog, d, t0)
                self.accounting.ended(prof, state, stream.events)
                return relayed
            # A whole body: a non-streamed answer, or one the client must see as is (a 4xx,
            # or an engine's JSON answer to a stream request).
            status, data = await self._read_body(upstream, d, total_at)
            if status == 200:
                self.accounting.answer(prof, state, data)
            else:
                data = apis.engine_answer(kind, status, data, ep.api_key)
            self.metrics.first_token(prof.name, loop.time() - state.loop_start)
            if state.trace is not None:
                state.trace.first_token = time.monotonic()
            if state.response is not None and state.started:
                return await _as_event(state, status, data)
            return web.Response(
                status=status,
                body=data,
                content_type=apis.relayed_type(upstream.content_type) if status < 400 else JSON,
                headers=errors.id_headers(state.rid, kind),
            )
        except BaseException:
            # A stream cut after its first token (the client left: a cancellation; or the
            # engine broke off) is charged for what it took. Here rather than in a
            # coroutine around the relay: no frame more to resume at each of its awaits.
            if stream is not None and stream.t_first:
                self.accounting.cut(prof, state, stream.events)
            raise
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
        engine_key: str,
    ) -> upstream_http.Response:
        """Send the request and wait for the response head (connect and headers deadlines).

        Raises Retry for what another endpoint may do better: no connection, no head in
        time, 5xx but 501, 429 (what its message quotes of the engine is without
        `engine_key`). A 501 is the engine's configuration (llama-server started without
        `--embeddings` answers one for embeddings), the same on every replica of the model:
        the client gets it, as a 4xx, rather than a 502 after every replica was tried and
        counted as failing.
        """
        upstream: upstream_http.Response | None = None
        try:
            async with self.watchdog.at(min(t0 + d.headers_s, total_at)):
                upstream = await self.pool.request(
                    key, head, body, connect_timeout=d.connect_s, engine_key=engine_key
                )
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
                if (status >= 500 and status != NOT_IMPLEMENTED) or status == 429:
                    raise await errors.status_retry(upstream, engine_key)
            return upstream
        except BaseException as exc:
            if upstream is not None:
                upstream.close()
            raise as_retry(exc, d) from None

    async def _read_body(
        self, upstream: upstream_http.Response, d: Deadlines, total_at: float
    ) -> tuple[int, bytes]:
        """The answer's status and body: a 502 past `max_answer_bytes` (no more is read)."""
        most = self.cfg.max_answer_bytes
        try:
            async with self.watchdog.at(total_at):
                data = await upstream.read(most + 1)
            return (upstream.status, data) if len(data) <= most else apis.too_large(most)
        except TimeoutError:
            raise Retry(
                "total_timeout", 504, f"engine did not finish within {d.total_s} s"
            ) from None
        except (upstream_http.UpstreamError, OSError) as exc:
            raise Retry("upstream_error", 502, f"engine response failed: {exc}") from None


async def _as_event(state: ClientStream, status: int, data: bytes) -> web.StreamResponse:
    """A whole answer where keep-alive comments already began a 200 stream: its body as an
    event (an error as the API's error event), then the stream's end."""
    assert state.response is not None
    state.stop_keepalive()
    if status >= 400:
        await state.write(requests.error_event(state.kind, data))
    else:
        await state.write(requests.data_event(data))
    await state.response.write_eof()
    return state.response

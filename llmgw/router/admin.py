"""The router's admin listener: `GET /metrics`, `GET /health` and `POST /route` (where a
prompt would go: llmgw.router.explain).

It is reachable wherever Prometheus scrapes, and `/route` takes a tenant's key as the
front door does. No web page may use it (llmgw.router.browsers, whatever the front door's
keys): a request with an `Origin` not in `auth.allowed_origins`, or, on a loopback
listener, with a `Host` naming no loopback address nor a name in `auth.allowed_hosts` (a
DNS name rebound to 127.0.0.1 after its page loaded) gets a 403, so that no page the
operator opens reads the metrics (keys' and teams' names, models) or where prompts would
go and what they would find cached. Prometheus and curl send no `Origin`. It is served by
the front door's connection handling
(llmgw.router.protocol): a request head must arrive within `header_timeout_s` and a
body within `body_timeout_s` (or the connection is answered 408 and closed), and a
malformed head gets a 400 that quotes nothing it sent (aiohttp's own answer, and its log
line, quote the offending header: an `Authorization` header with the key in it). Three
fixed paths: a dict lookup, as the front door's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from llmgw.router import admission, protocol
from llmgw.router.app import Router
from llmgw.router.browsers import BrowserGuard
from llmgw.router.errors import Refusal
from llmgw.router.explain import ExplainError, explain

Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


def _handlers(router: Router) -> dict[tuple[str, str], Handler]:
    async def metrics(_: web.BaseRequest) -> web.Response:
        # On the loop, not in a thread: the hot path mutates the same dicts without locks.
        body = router.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})

    async def health(_: web.BaseRequest) -> web.Response:
        return web.json_response({"status": "ok"})

    async def route(request: web.BaseRequest) -> web.Response:
        """Where a request body would go, and why (llmgw.router.explain), for a caller the
        front door would serve."""
        principal = admission.authenticate(
            router.keys, admission.credential(request.headers), router.clock(), router.anonymous
        )
        if isinstance(principal, Refusal):
            return web.json_response({"error": principal.message}, status=principal.status)
        # A key's requests/s holds here too: else /route probed engines' caches unmetered.
        over = await router.counted(principal)
        if over is not None:
            return _refused(over)
        body = await router.read_body(request)
        if isinstance(body, Refusal):  # late (the connection closes) or too large
            refused = web.json_response({"error": body.message}, status=body.status)
            if body.close:
                refused.force_close()
            return refused
        try:
            session = request.headers.get(router.cfg.session_header, "")
            answer = explain(body, router.dispatcher, principal,
                             path=request.query.get("path"), session=session)  # fmt: skip
        except ExplainError as exc:
            return web.json_response({"error": str(exc)}, status=exc.status)
        return web.json_response(answer)

    return {
        ("GET", "/metrics"): metrics,
        ("HEAD", "/metrics"): metrics,
        ("GET", "/health"): health,
        ("HEAD", "/health"): health,
        ("POST", "/route"): route,
    }


def _refused(refusal: Refusal) -> web.Response:
    """A 429 in the admin listener's shape, with the front door's Retry-After and
    rate-limit headers."""
    resp = web.json_response({"error": refusal.message}, status=refusal.status)
    if refusal.retry_after:
        resp.headers["Retry-After"] = str(refusal.retry_after)
    resp.headers.update(dict(refusal.headers))
    return resp


def build_admin_server(router: Router) -> web.Server:
    """The admin listener's low-level server (head deadline, quiet 400s)."""
    handlers = _handlers(router)
    paths = {path for _, path in handlers}

    async def unknown(request: web.BaseRequest) -> web.Response:
        if request.path in paths:
            return web.json_response(
                {"error": f"{request.path} does not take {request.method}"}, status=405
            )
        return web.json_response(
            {"error": f"{request.path} is not on the admin listener: /metrics, /health, /route"},
            status=404,
        )

    guard = BrowserGuard(router.cfg.auth, router.cfg.admin.host)

    async def refuse(refused: Refusal) -> web.Response:
        return web.json_response({"error": refused.message}, status=refused.status)

    def handle(request: web.BaseRequest) -> Awaitable[web.StreamResponse]:
        refused = guard.refusal(request.headers)
        if refused is not None:
            return refuse(refused)
        return handlers.get((request.method, request.path), unknown)(request)

    # /route takes the body a client would send.
    return protocol.server(handle, access_log=None, head_timeout_s=router.cfg.header_timeout_s,
                           client_max_size=router.cfg.max_body_bytes)  # fmt: skip

"""The router's client-facing server: each request's path and method to the Router's
handler, behind the connection handling of llmgw.router.protocol (the request head's
deadline, quiet 400s) and the CORS of the origins listed in `auth.allowed_origins`
(llmgw.router.cors)."""

from __future__ import annotations

from collections.abc import Awaitable

from aiohttp import web

from llmgw.router import cors, protocol
from llmgw.router.apis import MODEL_PATH, PATHS
from llmgw.router.app import Router


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

    def handle(request: web.BaseRequest) -> Awaitable[web.StreamResponse]:
        # Returns the handler's coroutine for aiohttp to await: no frame of its own.
        table = posts if request.method == "POST" else gets if request.method == "GET" else None
        h = table.get(request.path) if table is not None else None
        if h is None:
            if table is gets and request.path.startswith(MODEL_PATH):
                return router.handle_model(request)
            if request.method == "OPTIONS":
                return router.handle_options(request)
            return router.handle_fallthrough(request)
        return h(request)

    origins = router.cfg.auth.allowed_origins
    listed = cors.Cors(origins) if origins else None
    # handler_cancellation: a client that disconnects cancels its handler, which closes the
    # upstream connection, so the engine stops generating and frees the KV blocks.
    return protocol.server(
        handle,
        request_type=listed.request_type if listed is not None else None,
        late_headers=listed.late_head_headers if listed is not None else None,
        handler_cancellation=True,
        access_log=None,
        head_timeout_s=router.cfg.header_timeout_s,
        client_max_size=router.cfg.max_body_bytes,
    )

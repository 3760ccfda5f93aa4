"""The router's connection handling: llmgw.http_server's (a deadline on request heads,
quiet 400s), answering in OpenAI's error shape.

A connection's first request head must be complete within `header_timeout_s` of its
connect, a later one within that of its first byte, or the client gets a 408
(`request_timeout`) and the connection is closed; a request that is not valid HTTP gets a
400 (`bad_http_request`) naming only the kind of problem, never the bytes sent (an
`Authorization` header with its key); a body is never inflated, and one sent with a
`Content-Encoding` gets a 415 (`compressed_body`). Used by `llmgw.router.front.build_server`
and the admin listener (llmgw.router.admin).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web

from llmgw import http_server, logs
from llmgw.router.requests import error_body

log = logs.get("llmgw.router")


def _openai_error(message: str, code: str) -> bytes:
    return error_body(message, "invalid_request_error", code)


def server(
    handler: Any,
    *,
    head_timeout_s: float,
    client_max_size: int,
    late_headers: Callable[[str | None], Mapping[str, str]] | None = None,
    **kwargs: Any,
) -> web.Server:
    """The router's low-level server (llmgw.http_server.server) with its answers; requests
    take bodies of up to `client_max_size` bytes, as sent (a compressed one gets 415
    `compressed_body`, on any path, before the handler); a late head's 408 carries
    `late_headers` (http_server.Rules.late_headers)."""
    rules = http_server.Rules(head_timeout_s, log, _openai_error, late_headers)
    return http_server.server(handler, rules=rules, client_max_size=client_max_size, **kwargs)

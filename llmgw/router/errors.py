"""The router's failures in one place: what an attempt raises, what a client is told.

`Retry` is an attempt that failed before anything reached the client (another
endpoint may take the request; `as_retry` makes one of an engine's connection failing,
`status_retry` one of its 5xx or 429);
`EngineFault` and `ClientGone` end a request
whose stream has started. `Refusal` is an answer as data (status, message and
OpenAI's error type and code): admission and the attempt planner return one,
and only `refusal_response` turns it into an aiohttp response.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from aiohttp import web

from llmgw.core import redaction
from llmgw.core.profile import Deadlines
from llmgw.router import requests
from llmgw.router import upstream as upstream_http
from llmgw.router.metrics import status_label

JSON = "application/json"


class Retry(Exception):
    """An attempt failed before anything reached the client: another endpoint may take it."""

    def __init__(self, reason: str, status: int, message: str, *, fault: bool = True) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status
        self.message = message
        self.fault = fault
        """Counts against the endpoint's breaker (a 429 is load, not a fault)."""


class EngineFault(Exception):
    """The stream broke after the first byte; the client already got an error event."""


class ClientGone(Exception):
    """Writing to the client failed: it went away. Upstream is closed on the way out."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request answered with an OpenAI error instead of a model's answer."""

    status: int
    message: str
    type: str
    """OpenAI's error type: invalid_request_error, permission_error, rate_limit_error, ..."""
    code: str | None = None
    close: bool = False
    """The connection cannot be reused (the rest of a late body may still arrive)."""
    retry_after: int = 0
    """Seconds for a `Retry-After` header (0: none)."""
    headers: tuple[tuple[str, str], ...] = ()
    """More headers (a rate limit's `x-ratelimit-*`)."""

    def body(self) -> bytes:
        return requests.error_body(self.message, self.type, self.code)


ENGINES_BUSY_RETRY_AFTER_S = 1
"""`Retry-After` when every engine tried answered 429, or none was ready (503): an engine's
load changes within a second, and a client that waits for that rather than retrying at once
lets it drain."""


def retry_refusal(last: Retry) -> Refusal:
    """What the client is told when no attempt got through: the last attempt's failure."""
    type_ = "rate_limit_error" if last.status == 429 else "server_error"
    wait = ENGINES_BUSY_RETRY_AFTER_S if last.status in (429, 503) else 0
    return Refusal(last.status, last.message, type_, last.reason, retry_after=wait)


ENGINE_SAID_READ = 2048
"""The most bytes of an engine's 5xx or 429 body read for the message that quotes it."""
ENGINE_SAID_QUOTED = 300
"""The most characters of it quoted (after the engine's key is out)."""


async def status_retry(upstream: upstream_http.Response, engine_key: str) -> Retry:
    """The Retry of an engine's 5xx or 429: its message quotes what the engine said (read
    for at most a second) without `engine_key`, the key the router presented to it, which
    an engine or a proxy that echoes the request's headers would otherwise show to the
    client and to the log."""
    status = upstream.status
    detail = b""
    with contextlib.suppress(TimeoutError, upstream_http.UpstreamError, OSError):
        async with asyncio.timeout(1.0):
            detail = await upstream.read(ENGINE_SAID_READ)
    said = redaction.engine_words(detail, engine_key, ENGINE_SAID_QUOTED)
    return Retry(
        # The reason labels the retries' metrics: an unknown status by its class (`status_label`).
        "overloaded" if status == 429 else f"status_{status_label(status)}",
        429 if status == 429 else 502,
        f"engine answered {status}: {said}",
        fault=status != 429,
    )


NOSNIFF = {"X-Content-Type-Options": "nosniff"}
"""On every answer to an API request: a browser takes its Content-Type as sent and never
guesses a page from an engine's bytes."""


def id_headers(rid: str, kind: requests.Kind) -> dict[str, str]:
    """The headers of an answer to an API request: `NOSNIFF`, the request's id
    (`X-Request-Id`), and for the Messages API also Anthropic's `request-id`, which its
    SDK reads (`_request_id`)."""
    if kind in requests.ANTHROPIC:
        return {"X-Request-Id": rid, "request-id": rid, **NOSNIFF}
    return {"X-Request-Id": rid, **NOSNIFF}


def as_retry(exc: BaseException, d: Deadlines) -> BaseException:
    """What a failure to get a response head becomes: a Retry, or itself (a Retry
    already, a cancellation, a bug)."""
    if isinstance(exc, TimeoutError):
        return Retry("headers_timeout", 504, f"engine sent no response headers within"
                     f" {d.headers_s} s")  # fmt: skip
    if isinstance(exc, upstream_http.ConnectTimeout):
        return Retry("connect_timeout", 504, str(exc))
    if isinstance(exc, upstream_http.ConnectError):
        return Retry("connect_error", 502, str(exc))
    if isinstance(exc, upstream_http.UpstreamError | OSError):
        return Retry("upstream_error", 502, f"engine connection failed: {exc}")
    return exc


def error_response(
    status: int,
    message: str,
    type_: str,
    code: str | None = None,
    rid: str = "",
    kind: requests.Kind = "chat",
) -> web.Response:
    """The error in the shape of API `kind` (`requests.api_error_body`)."""
    headers = id_headers(rid, kind) if rid else NOSNIFF
    return web.Response(
        status=status,
        body=requests.api_error_body(kind, status, message, type_, code),
        content_type=JSON,
        headers=headers,
    )


def refusal_response(refusal: Refusal, rid: str = "", kind: requests.Kind = "chat") -> web.Response:
    resp = error_response(refusal.status, refusal.message, refusal.type, refusal.code, rid, kind)
    if refusal.retry_after:
        resp.headers["Retry-After"] = str(refusal.retry_after)
    for name, value in refusal.headers:
        resp.headers[name] = value
    if refusal.close:
        resp.force_close()
    return resp

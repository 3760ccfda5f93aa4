"""CORS for the web applications of the origins in `auth.allowed_origins`.

A page's fetch() to the router is cross-origin: the browser sends it only after a
preflight (`OPTIONS`, for a JSON body or an `Authorization` header) that the router
answers, and lets the page read an answer only if it names the page's origin in
`Access-Control-Allow-Origin`. A listed origin gets both, with a key or without:

- the preflight of an API path (`answer_preflight`) needs no key (browsers send none) and
  reaches nothing but this module: no limit, metric or engine sees it. It allows the
  path's one method, the request headers the browser asked for (echoed once they are
  valid header names: the OpenAI and Anthropic SDKs send `x-stainless-*` headers whose
  set changes with their versions), for `MAX_AGE_S`;
- every answer to a listed origin, streams and errors included, names the origin (the
  exact string listed, never `*`), exposes the headers a client reads (`EXPOSED`) and
  says `Vary: Origin`. The headers are added as aiohttp prepares the response
  (`ListedOriginRequest`), so no answer of the router can miss them; the 408 of a request
  head that came too late, answered before there is any request, gets them from
  `Cors.late_head_headers` when the part of the head that came names the origin.

An unlisted origin gets no CORS header at all: its pages cannot read any answer, their
preflights get a 403, and a request without a key from them is still refused
(llmgw.router.browsers). No `Access-Control-Allow-Credentials` is sent: the router reads
no cookies, and a page passes its key in a header it sets itself. Every answer of a router
that lists origins says `Vary: Origin`, a request without an Origin or from an unlisted
one too (`VaryingRequest`): each answer's headers depend on its Origin, and a shared cache
must not hand one origin's answer to another.

What a request without an `Origin` costs: one header lookup, made as its request object
is built (`Cors.request_type`), and one header set as its answer is prepared; a router
listing no origin makes neither.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web
from aiohttp.web_response import StreamResponse

from llmgw.router.browsers import quoted
from llmgw.router.errors import Refusal, refusal_response

MAX_AGE_S = 7200
"""How long a browser may reuse a preflight's answer (Chromium's own cap)."""

RATE_LIMIT_HEADERS = tuple(
    f"x-ratelimit-{part}-{kind}"
    for kind in ("requests", "tokens")
    for part in ("limit", "remaining", "reset")
)
EXPOSED = ", ".join(("Retry-After", "X-Request-Id", "request-id", *RATE_LIMIT_HEADERS))
"""The response headers a page may read besides the CORS-safelisted ones: when to retry,
the request's id (Anthropic's SDK reads `request-id`) and a key's rate limits
(llmgw.core.quota.rate_headers)."""

MAX_REQUESTED_HEADERS = 64
"""The most header names a preflight may ask for (browsers ask for those a page sets)."""
MAX_REQUESTED_CHARS = 2048
"""The longest `Access-Control-Request-Headers` answered: 64 names of 30 characters."""

_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
"""A header name as HTTP writes one (RFC 9110's token)."""


VARY = {"Vary": "Origin"}
"""What every other answer of a router that lists origins carries."""


class VaryingRequest(web.BaseRequest):
    """A request to a router that lists origins: every response to it gets `cors_headers`
    as aiohttp prepares it (its `_prepare_hook`, which aiohttp calls for every response
    between making its headers and sending them); `VARY` unless it is a
    `ListedOriginRequest`."""

    ATTRS = web.BaseRequest.ATTRS | frozenset(["cors_headers"])

    def __init__(self, *args: Any, cors_headers: Mapping[str, str] = VARY, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cors_headers = cors_headers

    async def _prepare_hook(self, response: StreamResponse) -> None:
        response.headers.update(self.cors_headers)


class ListedOriginRequest(VaryingRequest):
    """A request from a listed origin: its responses get that origin's CORS headers."""


RequestType = Callable[..., web.BaseRequest]
"""What makes one request object, called with `web.BaseRequest`'s arguments."""


class Cors:
    """One router's CORS: the listed origins' headers and its preflights' answers."""

    __slots__ = ("headers", "types")

    def __init__(self, origins: tuple[str, ...]) -> None:
        self.headers = {origin: answer_headers(origin) for origin in origins}
        self.types: dict[str, RequestType] = {
            origin: functools.partial(ListedOriginRequest, cors_headers=headers)
            for origin, headers in self.headers.items()
        }

    def request_type(self, message: Any) -> RequestType:
        """The request type for a request's head (aiohttp's parsed message)."""
        origin = message.headers.get("Origin")
        if origin is None:
            return VaryingRequest
        return self.types.get(origin, VaryingRequest)

    def late_head_headers(self, origin: str | None) -> Mapping[str, str]:
        """The headers of the 408 answered to a head that came too late, given the Origin
        its part that came names (None: none): as `request_type`'s would add."""
        return VARY if origin is None else self.headers.get(origin, VARY)


def answer_headers(origin: str) -> dict[str, str]:
    """The headers every answer to `origin`'s pages carries."""
    return {
        "Access-Control-Allow-Origin": origin,
        "Access-Control-Expose-Headers": EXPOSED,
        "Vary": "Origin",
    }


def preflight_headers(method: str, requested: str | None) -> dict[str, str] | Refusal:
    """A listed origin's preflight answer for a path served with `method`, allowing the
    headers in `requested` (its `Access-Control-Request-Headers`); a Refusal when they are
    more than `MAX_REQUESTED_HEADERS`, longer than `MAX_REQUESTED_CHARS` or not header
    names."""
    headers = {"Access-Control-Allow-Methods": method, "Access-Control-Max-Age": str(MAX_AGE_S)}
    if requested is None:
        return headers
    names = allowed_headers(requested)
    if isinstance(names, Refusal):
        return names
    if names:
        headers["Access-Control-Allow-Headers"] = ", ".join(names)
    return headers


def allowed_headers(requested: str) -> list[str] | Refusal:
    """The header names in a preflight's `Access-Control-Request-Headers`, lower case and
    each once; a Refusal, quoting a bounded part of it, when it is no such list."""
    if len(requested) > MAX_REQUESTED_CHARS:
        return bad_request_headers(
            f"is {len(requested)} characters long; at most {MAX_REQUESTED_CHARS} are answered"
        )
    names: dict[str, None] = {}
    for part in requested.split(","):
        name = part.strip(" \t").lower()
        if not name:
            continue
        if not _TOKEN.fullmatch(name):
            return bad_request_headers(f"names {quoted(name)}, which is no header name")
        names[name] = None
    if len(names) > MAX_REQUESTED_HEADERS:
        return bad_request_headers(
            f"names {len(names)} headers; at most {MAX_REQUESTED_HEADERS} are allowed"
        )
    return list(names)


def bad_request_headers(why: str) -> Refusal:
    return Refusal(
        400,
        f"the preflight's Access-Control-Request-Headers {why}: send only the headers the"
        " request needs",
        "invalid_request_error",
        "bad_preflight",
    )


def origin_not_listed(origin: str) -> Refusal:
    """A preflight from an origin not in `auth.allowed_origins`."""
    return Refusal(
        403,
        f"the origin {quoted(origin)} is not in this router's auth.allowed_origins, so its"
        " pages may not call the router: add it there if they may",
        "permission_error",
        "origin_not_allowed",
    )


def answer_preflight(request: web.BaseRequest, method: str) -> web.Response:
    """The answer to the preflight of a path served with `method` (POST or GET): 204 with
    the CORS headers for a listed origin (`ListedOriginRequest` adds its own), else the
    refusal, which carries none."""
    if not isinstance(request, ListedOriginRequest):
        return refusal_response(origin_not_listed(request.headers.get("Origin", "")))
    headers = preflight_headers(method, request.headers.get("Access-Control-Request-Headers"))
    if isinstance(headers, Refusal):
        return refusal_response(headers)
    return web.Response(status=204, headers=headers)


def is_preflight(request: web.BaseRequest) -> bool:
    """Whether an OPTIONS request is a browser's CORS preflight."""
    h = request.headers
    return "Origin" in h and "Access-Control-Request-Method" in h

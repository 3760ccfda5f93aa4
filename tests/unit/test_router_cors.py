"""CORS for listed origins (llmgw.router.cors): which requests get an origin's headers, what
a preflight answers, and that hostile preflights get bounded answers. In-process servers
on 127.0.0.1; real routers and a real browser are in tests/integration/test_router_cors.py
and tests/e2e/test_router_browser_cors.py."""

from __future__ import annotations

import asyncio
import contextlib
import string
from collections.abc import AsyncIterator
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy

from llmgw import http_server, listeners, logs
from llmgw.router import cors
from llmgw.router.app import Router
from llmgw.router.config import AuthConfig, RouterConfig
from llmgw.router.errors import Refusal
from llmgw.router.front import build_server

APP = "http://127.0.0.1:5173"
OTHER = "https://evil.example"
RULES = http_server.Rules(5.0, logs.get("llmgw.test"))
# What the OpenAI SDK's fetch() asks to send from a page (a streamed chat, its key).
OPENAI_SDK = (
    "authorization,content-type,x-stainless-arch,x-stainless-lang,x-stainless-os,"
    "x-stainless-package-version,x-stainless-retry-count,x-stainless-runtime,"
    "x-stainless-runtime-version,x-stainless-timeout"
)
TCHARS = string.ascii_letters + string.digits + "!#$%&'*+-.^_`|~"


def _head(headers: dict[str, str]) -> SimpleNamespace:
    """A parsed request head, as aiohttp hands it to the request factory."""
    return SimpleNamespace(headers=CIMultiDictProxy(CIMultiDict(headers)))


@given(st.text(max_size=60))
def test_only_a_listed_origin_gets_its_headers(origin: str) -> None:
    c = cors.Cors((APP,))
    made = c.request_type(_head({"Origin": origin}))
    if origin == APP:
        assert made.func is cors.ListedOriginRequest  # type: ignore[attr-defined]
        assert made.keywords["cors_headers"]["Access-Control-Allow-Origin"] == APP  # type: ignore[attr-defined]
    else:
        assert made is cors.VaryingRequest
    assert c.request_type(_head({})) is cors.VaryingRequest


def test_the_answer_headers_name_the_origin_and_expose_what_clients_read() -> None:
    headers = cors.answer_headers(APP)
    assert headers["Access-Control-Allow-Origin"] == APP
    assert headers["Vary"] == "Origin"
    exposed = headers["Access-Control-Expose-Headers"].split(", ")
    for name in ("Retry-After", "X-Request-Id", "request-id", "x-ratelimit-remaining-tokens"):
        assert name in exposed
    assert "Access-Control-Allow-Credentials" not in headers


def test_a_preflight_allows_the_sdks_headers() -> None:
    answer = cors.preflight_headers("POST", OPENAI_SDK)
    assert not isinstance(answer, Refusal)
    assert answer["Access-Control-Allow-Methods"] == "POST"
    assert answer["Access-Control-Allow-Headers"].split(", ") == OPENAI_SDK.split(",")
    assert answer["Access-Control-Max-Age"] == str(cors.MAX_AGE_S)
    answer = cors.preflight_headers("GET", None)
    assert not isinstance(answer, Refusal)
    assert "Access-Control-Allow-Headers" not in answer


@given(st.lists(st.text(TCHARS, min_size=1, max_size=30), min_size=1, max_size=40))
def test_valid_header_names_are_echoed_once_in_lower_case(names: list[str]) -> None:
    answer = cors.preflight_headers("POST", " , ".join(names))
    assert not isinstance(answer, Refusal)
    assert answer["Access-Control-Allow-Headers"].split(", ") == list(
        dict.fromkeys(n.lower() for n in names)
    )


def test_a_preflight_may_ask_for_as_many_headers_as_the_bound_and_no_more() -> None:
    names = [f"x-h{i}" for i in range(cors.MAX_REQUESTED_HEADERS + 1)]
    allowed = cors.preflight_headers("POST", ",".join(names[:-1]))
    assert not isinstance(allowed, Refusal)
    assert allowed["Access-Control-Allow-Headers"].split(", ") == names[:-1]
    refused = cors.preflight_headers("POST", ",".join(names))
    assert isinstance(refused, Refusal)
    assert (refused.status, refused.code) == (400, "bad_preflight")


@given(
    st.one_of(
        st.text(max_size=3000),
        st.text(TCHARS + ", ", max_size=20).map(lambda s: s * 400),
        st.lists(st.text(TCHARS, min_size=1, max_size=8), min_size=65, max_size=300).map(",".join),
    )
)
def test_a_hostile_request_headers_list_gets_a_bounded_answer(requested: str) -> None:
    """Huge, long, many-named, or with names that are none: the answer is a 400 quoting a
    bounded part, or allows only header names, never more than a browser may ask."""
    answer = cors.preflight_headers("POST", requested)
    if isinstance(answer, Refusal):
        assert (answer.status, answer.code) == (400, "bad_preflight")
        assert len(answer.message) < 300
        return
    allowed = answer.get("Access-Control-Allow-Headers", "")
    assert len(allowed) <= cors.MAX_REQUESTED_CHARS
    names = [n for n in allowed.split(", ") if n]
    assert len(names) <= cors.MAX_REQUESTED_HEADERS
    assert all(set(n) <= set(TCHARS) and n == n.lower() for n in names)


@contextlib.asynccontextmanager
async def _raw_serving(server: web.Server) -> AsyncIterator[int]:
    runner = web.ServerRunner(server)
    await runner.setup()
    sock = listeners.bind("127.0.0.1", 0, setting="port")
    try:
        await http_server.start_site(runner, sock, rules=RULES)
        yield sock.getsockname()[1]
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def _serving(
    server: web.Server, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[aiohttp.ClientSession]:
    async with (
        _raw_serving(server) as port,
        aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session,
    ):
        yield session


async def _answers(request: web.BaseRequest) -> web.StreamResponse:
    """A stream (prepared by the handler itself) on /stream, an error elsewhere."""
    if request.path == "/stream":
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: [DONE]\n\n")
        return resp
    return web.json_response({"error": "no"}, status=429, headers={"Retry-After": "1"})


@pytest.mark.parametrize("supported", [True, False])
async def test_every_answer_to_a_listed_origin_has_its_headers_streams_and_errors_too(
    supported: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On llmgw's connection handler and on aiohttp's own (another aiohttp version)."""
    monkeypatch.setattr(http_server, "SUPPORTED", supported)
    server = http_server.server(
        _answers, rules=RULES, client_max_size=1024, request_type=cors.Cors((APP,)).request_type
    )
    async with _serving(server, monkeypatch) as s:
        for path in ("/stream", "/error"):
            async with s.get(path, headers={"Origin": APP}) as r:
                await r.read()
                assert r.headers["Access-Control-Allow-Origin"] == APP, path
                assert r.headers["Vary"] == "Origin"
                assert "Retry-After" in r.headers["Access-Control-Expose-Headers"]
            for headers in ({"Origin": OTHER}, {}):
                async with s.get(path, headers=headers) as r:
                    await r.read()
                    assert not any(h.startswith("Access-Control-") for h in r.headers), path
                    assert r.headers["Vary"] == "Origin", path


def _router(header_timeout_s: float = 10.0, **auth: object) -> Router:
    cfg = RouterConfig(
        auth=AuthConfig(allow_anonymous=True, **auth),  # type: ignore[arg-type]
        models=(),
        header_timeout_s=header_timeout_s,
    )
    return Router(cfg)


def _preflight(origin: str, method: str = "POST", requested: str = OPENAI_SDK) -> dict[str, str]:
    return {
        "Origin": origin,
        "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": requested,
    }


async def test_the_router_answers_a_listed_origins_preflight_without_a_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    router = _router(allowed_origins=(APP,))
    async with _serving(build_server(router), monkeypatch) as s:
        for path, method in [("/v1/chat/completions", "POST"), ("/v1/messages", "POST"),
                             ("/v1/models", "GET"), ("/v1/models/m", "GET")]:  # fmt: skip
            async with s.options(path, headers=_preflight(APP, method)) as r:
                assert r.status == 204, await r.text()
                assert r.headers["Access-Control-Allow-Origin"] == APP
                assert r.headers["Access-Control-Allow-Methods"] == method
                assert "authorization" in r.headers["Access-Control-Allow-Headers"].split(", ")
                assert r.headers["Vary"] == "Origin"
        async with s.options("/v1/chat/completions", headers=_preflight(OTHER)) as r:
            assert r.status == 403
            assert (await r.json())["error"]["code"] == "origin_not_allowed"
            assert "Access-Control-Allow-Origin" not in r.headers
        async with s.options("/v1/chat/completions", headers=_preflight(APP, requested="a b")) as r:
            assert r.status == 400
            assert (await r.json())["error"]["code"] == "bad_preflight"
            assert r.headers["Access-Control-Allow-Origin"] == APP  # the page may read why
        async with s.options("/nowhere", headers=_preflight(APP)) as r:
            assert r.status == 404
        async with s.options("/v1/chat/completions") as r:  # no preflight: a wrong method
            assert (r.status, r.headers["Allow"]) == (405, "POST")
    assert router.metrics.requests.values == {}  # no request counted


async def test_a_router_listing_no_origin_refuses_every_preflight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with (
        _serving(build_server(_router()), monkeypatch) as s,
        s.options("/v1/chat/completions", headers=_preflight(APP)) as r,
    ):
        assert r.status == 403
        assert "auth.allowed_origins" in (await r.json())["error"]["message"]
        assert "Access-Control-Allow-Origin" not in r.headers


HEADER_NAMES = st.sampled_from(["Origin", "origin", "ORIGIN", "X-Origin", "Host"]) | st.text(
    TCHARS, min_size=1, max_size=12
)
HEADER_VALUES = st.text(string.ascii_letters + string.digits + ":/.-_ ", max_size=40).map(str.strip)


@given(
    st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES), max_size=8),
    st.data(),
)
def test_a_late_heads_origin_is_read_whole_or_not_at_all(
    headers: list[tuple[str, str]], data: st.DataObject
) -> None:
    """Whatever part of a head came, the Origin read of it is the head's first Origin line
    whole, or nothing: never a value cut short (a prefix of another listed origin)."""
    head = "POST /v1/chat/completions HTTP/1.1\r\n" + "".join(
        f"{name}: {value}\r\n" for name, value in headers
    )
    first = next((value for name, value in headers if name.lower() == "origin"), None)
    assert http_server.sent_origin(head.encode()) == first
    cut = data.draw(st.integers(0, len(head)))
    assert http_server.sent_origin(head[:cut].encode()) in (None, first)


async def _late_head(port: int, origin: str | None) -> bytes:
    """A request head that stops half way (after its Origin, if any): what the router
    answers until it closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nOri")
        await writer.drain()
        rest = f"gin: {origin}\r\n" if origin is not None else "gin-less: yes\r\n"
        writer.write(rest.encode() + b"Content-Type: appl")
        await writer.drain()
        async with asyncio.timeout(30):
            return await reader.read()
    finally:
        writer.close()


def _headers(answer: bytes) -> dict[str, str]:
    head = answer.partition(b"\r\n\r\n")[0].decode().split("\r\n")
    return dict(line.split(": ", 1) for line in head[1:])


async def test_a_late_heads_408_carries_the_listed_origins_cors_headers() -> None:
    """The 408 of a head that came too late had no CORS header: a page of a listed origin
    saw a network error, not the 408. It has its origin's, as any answer to it; an
    unlisted origin's and one without an Origin say only `Vary: Origin`."""
    async with _raw_serving(build_server(_router(0.2, allowed_origins=(APP,)))) as port:
        listed = await _late_head(port, APP)
        other = await _late_head(port, OTHER)
        none = await _late_head(port, None)
    for answer in (listed, other, none):
        assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
        assert _headers(answer)["Vary"] == "Origin"
        assert b'"code":"request_timeout"' in answer
    assert _headers(listed)["Access-Control-Allow-Origin"] == APP
    assert "Retry-After" in _headers(listed)["Access-Control-Expose-Headers"]
    for answer in (other, none):
        assert not any(name.startswith("Access-Control-") for name in _headers(answer))


async def test_a_router_listing_no_origin_answers_a_late_head_as_before() -> None:
    async with _raw_serving(build_server(_router(0.2))) as port:
        answer = await _late_head(port, APP)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    assert "Vary" not in _headers(answer)
    assert not any(name.startswith("Access-Control-") for name in _headers(answer))


async def test_every_answer_of_a_router_listing_origins_varies_by_origin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An answer to a request without an Origin carried no `Vary: Origin`, so a shared
    cache could hand it (without CORS headers) to a listed origin's page, or another's
    answer to it. Every answer of a router that lists origins now says it varies."""
    async with _serving(build_server(_router(allowed_origins=(APP,))), monkeypatch) as s:
        for headers in ({}, {"Origin": OTHER}, {"Origin": APP}):
            for path in ("/v1/models", "/health", "/nowhere"):
                async with s.get(path, headers=headers) as r:
                    await r.read()
                    assert r.headers.get("Vary") == "Origin", (path, headers)
    async with _serving(build_server(_router()), monkeypatch) as s, s.get("/v1/models") as r:
        await r.read()
        assert "Vary" not in r.headers


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "crafted",
    [
        b"origin:" + b" " * http_server.PARTIAL_HEAD_BYTES,
        b"origin:" + b" \t" * (http_server.PARTIAL_HEAD_BYTES // 2),
        b"origin: \r\t" * (http_server.PARTIAL_HEAD_BYTES // 10),
    ],
)
def test_a_crafted_late_head_is_read_in_one_pass(crafted: bytes) -> None:
    """A late head is read on the event loop: a client's blanks after `origin:` (as much as
    the router keeps of a head) must not make its reading take longer than one pass over
    them (a backtracking match took hours, every other connection stalled meanwhile)."""
    head = (b"POST / HTTP/1.1\r\n" + crafted)[: http_server.PARTIAL_HEAD_BYTES]
    assert http_server.sent_origin(head) is None


@pytest.mark.parametrize(
    "origin",
    [
        "HTTP://127.0.0.1:5173",
        "http://127.0.0.1:5173/",
        "http://127.0.0.1:5173 ",
        "http://127.0.0.1",
    ],
)
def test_an_origin_only_like_a_listed_one_is_not_it(origin: str) -> None:
    """Origins are compared as the exact string a browser sends: another case, a path, a
    space or another port is another origin, which gets no CORS header."""
    assert cors.Cors((APP,)).request_type(_head({"Origin": origin})) is cors.VaryingRequest


def test_empty_elements_of_the_requested_headers_list_are_skipped() -> None:
    """HTTP lists may hold empty elements (RFC 9110 5.6.1): they are no header name."""
    answer = cors.preflight_headers("POST", ",content-type,, \t,Authorization ,")
    assert not isinstance(answer, Refusal)
    assert answer["Access-Control-Allow-Headers"] == "content-type, authorization"


async def test_an_options_request_without_a_requested_method_is_no_preflight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Browsers send Access-Control-Request-Method with every preflight: an OPTIONS of a
    listed origin without it is a wrong method, not a preflight's 204."""
    async with (
        _serving(build_server(_router(allowed_origins=(APP,))), monkeypatch) as s,
        s.options("/v1/chat/completions", headers={"Origin": APP}) as r,
    ):
        assert (r.status, r.headers["Allow"]) == (405, "POST")
        assert "Access-Control-Allow-Methods" not in r.headers

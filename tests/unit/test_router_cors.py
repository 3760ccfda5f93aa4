"""CORS for listed origins (llmgw.router.cors): which requests get an origin's headers, what
a preflight answers, and that hostile preflights get bounded answers. In-process servers
on 127.0.0.1; real routers and a real browser are in tests/integration/test_router_cors.py
and tests/e2e/test_router_browser_cors.py."""

from __future__ import annotations

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
        assert made is web.BaseRequest
    assert c.request_type(_head({})) is web.BaseRequest


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
async def _serving(
    server: web.Server, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[aiohttp.ClientSession]:
    runner = web.ServerRunner(server)
    await runner.setup()
    sock = listeners.bind("127.0.0.1", 0, setting="port")
    try:
        await http_server.start_site(runner, sock, rules=RULES)
        port = sock.getsockname()[1]
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
            yield session
    finally:
        await runner.cleanup()


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


def _router(**auth: object) -> Router:
    cfg = RouterConfig(
        auth=AuthConfig(allow_anonymous=True, **auth),  # type: ignore[arg-type]
        models=(),
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

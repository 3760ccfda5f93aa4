"""The key a router presents to an engine reaches neither the router's clients nor its log,
whatever the engine writes back: an engine (or a proxy in front of it) that echoes the
request's headers in a 5xx or a 4xx has the key taken out of what is relayed, and the rest
of its message still reaches the client.

A canned engine (aiohttp, on its own thread) that checks the key, and a real `llmgw sim`
started with one, behind a router served in this process whose endpoint table holds the
key as an EndpointUp puts it there.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import msgspec
import pytest
import structlog
from aiohttp import web

from llmgw.core.redaction import FRAGMENT, KEY_MARK
from llmgw.router.app import Router
from llmgw.router.config import RouterConfig
from llmgw.router.front import build_server
from llmgw.sim.testing import SimProcess
from tests.kit.threaded_http import ThreadedApp, engine_app

pytestmark = pytest.mark.slow

KEY = "eK3y-Zq4_8xR2pL0vT9mW1nB6cY5dF7gH3jK0sA2uQ"
"""As the agent makes them (`secrets.token_urlsafe(32)`: 43 characters)."""
CHAT = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
CONTEXT_ERROR = (
    "This model's maximum context length is 4096 tokens. However, you requested 9000 tokens."
)


class EchoingEngine(ThreadedApp):
    """An engine that wants `Authorization: Bearer KEY` and answers `status` with a body
    that `render` makes of the request's headers, as it received them."""

    def __init__(self, key: str = KEY) -> None:
        self.key = key
        self.status = 500
        self.render = plain_echo
        self.seen: list[dict[str, str]] = []
        app = engine_app(self._answer)
        app.router.add_post("/v1/messages", self._answer)
        super().__init__(app)

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.seen.append(dict(request.headers))
        if request.headers.get("Authorization") != f"Bearer {self.key}":
            return web.json_response({"error": "not the engine's key"}, status=401)
        body, content_type = self.render(dict(request.headers))
        return web.Response(status=self.status, body=body, headers={"Content-Type": content_type})


def plain_echo(headers: dict[str, str], padding: int = 0) -> tuple[bytes, str]:
    """A crash page that names the request's key after `padding` characters, then lists
    all its headers."""
    said = f"Internal error {'.' * padding} serving Authorization: {headers['Authorization']}"
    return f"{said}; {json.dumps(headers)}".encode(), "text/plain"


def vllm_echo(headers: dict[str, str]) -> tuple[bytes, str]:
    """vLLM's error shape, its message quoting the headers."""
    error = {
        "object": "error",
        "message": f"{CONTEXT_ERROR} (request headers: {headers})",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    return json.dumps(error).encode(), "application/json"


@pytest.fixture(scope="module")
def engine() -> Iterator[EchoingEngine]:
    e = EchoingEngine()
    yield e
    e.stop()


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    with SimProcess.start("--api-key", KEY, "--max-model-len", "64", model="m", timeout=60) as s:
        yield s


async def serve(url: str, *more: tuple[str, str, str]) -> AsyncIterator[str]:
    """A router whose endpoint `e`, `url`, serves model `m` and is presented KEY, and each
    of `more` (url, model, key) another; yields the router's URL."""
    endpoints = [("e", url, "m", KEY)] + [(f"e{i}", *m) for i, m in enumerate(more)]
    cfg = msgspec.convert(
        {
            "auth": {"allow_anonymous": True},
            "models": [{"name": model} for _, _, model, _ in endpoints],
            "endpoints": [{"id": e, "url": u, "models": [model]} for e, u, model, _ in endpoints],
            "probe_interval_s": 60,
        },
        RouterConfig,
    )
    router = Router(cfg)
    for e, u, model, key in endpoints:
        router.table.add(e, u, [model], ready=True, api_key=key)
    await router.start()
    runner = web.ServerRunner(build_server(router))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
        await router.stop()


@pytest.fixture
async def echoing(engine: EchoingEngine) -> AsyncIterator[str]:
    async for url in serve(engine.url):
        yield url


@pytest.fixture
async def keyed_sim(sim: SimProcess) -> AsyncIterator[str]:
    async for url in serve(sim.url):
        yield url


async def post(
    router: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(router + path, json=body, headers=headers) as resp,
    ):
        return resp.status, await resp.text()


def assert_no_key(text: str) -> None:
    """Neither the key nor its start, in any letter case."""
    assert KEY[:FRAGMENT].lower() not in text.lower()


# "Internal error " (15) + 240 + " serving Authorization: Bearer " (31): the key starts at
# the 287th character of the 300 quoted.
@pytest.mark.parametrize("padding", [0, 240], ids=["key-inside-the-quote", "key-across-the-cut"])
async def test_an_engines_500_that_echoes_the_headers_does_not_show_the_key(
    engine: EchoingEngine, echoing: str, padding: int
) -> None:
    """Before: the client's 502 quoted the engine's first 300 characters, and with them
    the router's `Authorization: Bearer <key>`; with the key near the 300th, the cut left
    its first part. The attempt's log line quoted the same."""
    engine.status = 500
    engine.render = lambda headers: plain_echo(headers, padding)
    with structlog.testing.capture_logs() as logged:
        status, text = await post(echoing, "/v1/chat/completions", CHAT)
    assert status == 502
    message = json.loads(text)["error"]["message"]
    assert message.startswith("engine answered 500: Internal error")
    assert_no_key(text)
    if not padding:
        assert f"Bearer {KEY_MARK}" in message
    failed = [e for e in logged if e["event"] == "attempt_failed"]
    assert failed, logged
    assert_no_key(repr(logged))


@pytest.mark.parametrize(
    ("path", "body"), [("/v1/chat/completions", CHAT), ("/v1/messages", MESSAGES)]
)
async def test_an_engines_4xx_reaches_the_client_without_the_key(
    engine: EchoingEngine, echoing: str, path: str, body: dict[str, Any]
) -> None:
    """The engine's own answer to the client (vLLM's context length exceeded), relayed,
    in the API's shape, with the key out of it."""
    engine.status = 400
    engine.render = vllm_echo
    status, text = await post(echoing, path, body)
    assert status == 400
    assert_no_key(text)
    message = json.loads(text)["error"]["message"]
    assert message.startswith(CONTEXT_ERROR)
    assert KEY_MARK in message


async def test_a_keyed_sims_errors_still_reach_the_client(sim: SimProcess, keyed_sim: str) -> None:
    """A real engine that wants the key: its context-length 400 comes through whole."""
    long_prompt = {**CHAT, "messages": [{"role": "user", "content": "word " * 200}]}
    status, text = await post(keyed_sim, "/v1/chat/completions", long_prompt)
    assert status == 400, text
    error = json.loads(text)["error"]
    assert error["message"].startswith("This model's maximum context length is 64 tokens")
    assert error["code"] == "context_length_exceeded"
    status, text = await post(keyed_sim, "/v1/chat/completions", CHAT)
    assert status == 200, text


def header_echo(headers: dict[str, str]) -> tuple[bytes, str]:
    return json.dumps({"headers": headers}).encode(), "application/json"


async def test_a_clients_authorization_never_reaches_the_engine(
    engine: EchoingEngine, echoing: str
) -> None:
    """The engine gets the router's key for it, and nothing of the client's: the key a
    client authenticates with is no business of an engine's."""
    engine.status = 200
    engine.render = header_echo
    client = "sk-client-Yb2nQ8rT4uW6xZ0aC3eG5iK7mO9pR1sV"
    engine.seen.clear()
    status, text = await post(echoing, "/v1/chat/completions", CHAT,
                              {"Authorization": f"Bearer {client}"})  # fmt: skip
    assert status == 200, text
    assert [h["Authorization"] for h in engine.seen] == [f"Bearer {KEY}"]
    assert client not in repr(engine.seen)


async def test_each_engines_key_goes_to_its_own_endpoint_only() -> None:
    """Two engines, each with its own key, each serving its own model: each request goes
    to its model's engine with that engine's key, whichever came first."""
    other_key = "oK3y-Ab4_8xR2pL0vT9mW1nB6cY5dF7gH3jK0sA2uQ"
    first, second = EchoingEngine(), EchoingEngine(other_key)
    try:
        for e in (first, second):
            e.status, e.render = 200, header_echo
        async for router in serve(first.url, (second.url, "n", other_key)):
            for model in ("m", "n", "m"):
                status, text = await post(router, "/v1/chat/completions", {**CHAT, "model": model})
                assert status == 200, text
    finally:
        first.stop()
        second.stop()
    assert [h["Authorization"] for h in first.seen] == [f"Bearer {KEY}"] * 2
    assert [h["Authorization"] for h in second.seen] == [f"Bearer {other_key}"]


async def test_an_engines_text_error_reaches_the_client_as_json(
    engine: EchoingEngine, echoing: str
) -> None:
    """An engine's 4xx in plain text (or a proxy's HTML page) reaches the client in the
    API's JSON shape, and says so in its Content-Type: never the engine's type."""
    engine.status = 400
    engine.render = plain_echo
    async with (
        aiohttp.ClientSession() as http,
        http.post(echoing + "/v1/chat/completions", json=CHAT) as resp,
    ):
        assert resp.status == 400
        assert resp.content_type == "application/json"
        assert "Internal error" in json.loads(await resp.text())["error"]["message"]


async def test_an_engine_refusing_the_routers_key_is_the_routers_fault_not_the_clients() -> None:
    """An engine answers 401 to the key the router presents (its EndpointUp is stale): the
    client, whose own key the router checked, gets a 502 that says so, not a 401."""
    other = EchoingEngine("another-key-than-the-one-the-router-holds")
    try:
        async for router in serve(other.url):
            status, text = await post(router, "/v1/chat/completions", CHAT)
    finally:
        other.stop()
    assert status == 502, text
    assert "engine refused the router's key" in json.loads(text)["error"]["message"]

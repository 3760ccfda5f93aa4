"""What an answer's Content-Type says when the router relays it.

Every API the router relays answers JSON (or a stream of events); an engine that labels a
success `text/html` or `image/svg+xml` (a compromised one, or a proxy in front of it) must
not make the router's origin serve a page or a script. A success keeps the engine's type
only when it is JSON or plain text, and every answer says `nosniff`, so a browser never
guesses a page from the bytes either.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from llmgw.router import apis
from llmgw.router.app import Router
from tests.integration.test_router_stream_charges import bearer, serve
from tests.kit.threaded_http import ThreadedApp, engine_app

pytestmark = pytest.mark.slow

PAGE = b"<html><script>fetch('/steal?k='+document.cookie)</script></html>"


class LabellingEngine(ThreadedApp):
    """Answers every chat request with PAGE as a 200 whose Content-Type is the prompt,
    or streams one chunk when the request asks for a stream; "refuse" gets a 400."""

    def __init__(self) -> None:
        super().__init__(engine_app(self._chat))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        label = body["messages"][0]["content"]
        if label == "refuse":
            return web.json_response({"error": {"message": "no"}}, status=400)
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"w"}}]}\n\n')
            await resp.write(b"data: [DONE]\n\n")
            return resp
        return web.Response(status=200, body=PAGE, headers={"Content-Type": label})


@pytest.fixture(scope="module")
def engine() -> Iterator[LabellingEngine]:
    e = LabellingEngine()
    yield e
    e.stop()


@pytest.fixture
async def served(engine: LabellingEngine) -> AsyncIterator[tuple[Router, str]]:
    async for pair in serve(engine.url, False):
        yield pair


async def ask(url: str, label: str, *, stream: bool = False) -> tuple[int, Any, bytes]:
    doc = {"model": "m", "stream": stream, "messages": [{"role": "user", "content": label}]}
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/chat/completions", json=doc, headers=bearer()) as resp,
    ):
        return resp.status, resp.headers, await resp.read()


@pytest.mark.parametrize(
    ("engine_type", "relayed"),
    [
        ("text/html", "application/json"),
        ("text/html; charset=utf-8", "application/json"),
        ("image/svg+xml", "application/json"),
        ("application/xhtml+xml", "application/json"),
        ("text/javascript", "application/json"),
        ("application/octet-stream", "application/json"),
        ("application/json; charset=utf-8", "application/json"),
        ("application/problem+json", "application/problem+json"),
        ("text/plain", "text/plain"),
    ],
)
async def test_a_success_keeps_its_engines_type_only_when_json_or_plain_text(
    served: tuple[Router, str], engine_type: str, relayed: str
) -> None:
    _, url = served
    status, headers, body = await ask(url, engine_type)
    assert status == 200
    assert body == PAGE  # the body is relayed unread
    assert headers["Content-Type"].split(";")[0] == relayed
    assert headers["X-Content-Type-Options"] == "nosniff"


async def test_streams_and_refusals_say_nosniff(served: tuple[Router, str]) -> None:
    _, url = served
    status, headers, body = await ask(url, "any", stream=True)
    assert status == 200
    assert body.endswith(b"data: [DONE]\n\n")
    assert headers["Content-Type"].startswith("text/event-stream")
    assert headers["X-Content-Type-Options"] == "nosniff"
    status, headers, _ = await ask(url, "refuse")
    assert status == 400
    assert headers["Content-Type"].startswith("application/json")
    assert headers["X-Content-Type-Options"] == "nosniff"
    # The router's own refusal (no key) too.
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/chat/completions", data=b"{") as resp,
    ):
        assert resp.status >= 400
        assert resp.headers["X-Content-Type-Options"] == "nosniff"


@given(st.text(max_size=40))
def test_a_relayed_type_is_json_or_the_engines_json_or_plain_text(media: str) -> None:
    relayed = apis.relayed_type(media)
    lowered = media.lower()
    if relayed != "application/json":
        assert relayed == media
        assert lowered == "text/plain" or (
            lowered.startswith("application/") and lowered.endswith("+json")
        )
    for unsafe in ("html", "xml", "svg", "script"):
        if unsafe in lowered and not lowered.endswith("+json"):
            assert relayed == "application/json"

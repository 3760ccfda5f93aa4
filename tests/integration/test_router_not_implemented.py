"""An engine's 501 is its configuration, not a fault: llama-server started without
`--embeddings` answers every embeddings request so, on every replica of the model. The
client gets the engine's words (the key taken out, in the API's shape) with that status at
once, and no replica is counted as failing; any other 5xx, and a busy replica's 429, is still
tried elsewhere.

Two canned engines (aiohttp, each on its own thread) behind a router served in this
process.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator

import aiohttp
import msgspec
import pytest
from aiohttp import web

from llmgw.router.app import Router
from llmgw.router.config import RouterConfig
from llmgw.router.front import build_server
from tests.kit.threaded_http import ThreadedApp, engine_app

pytestmark = pytest.mark.slow

SAID = "This server does not support embeddings. Start it with `--embeddings`"
"""llama-server's words for it."""
EMBED = {"model": "m", "input": "hi"}


class Engine(ThreadedApp):
    """An engine answering embeddings with `status` and llama-server's error body."""

    def __init__(self) -> None:
        self.status = 501
        self.asked = 0
        app = engine_app(self._answer)
        app.router.add_post("/v1/embeddings", self._answer)
        super().__init__(app)

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.asked += 1
        error = {"code": self.status, "message": SAID, "type": "not_supported_error"}
        return web.json_response({"error": error}, status=self.status)


@pytest.fixture(scope="module")
def engines() -> Iterator[list[Engine]]:
    started = [Engine(), Engine()]
    yield started
    for e in started:
        e.stop()


@pytest.fixture
async def router(engines: list[Engine]) -> AsyncIterator[tuple[str, Router]]:
    cfg = msgspec.convert(
        {
            "auth": {"allow_anonymous": True},
            "models": [{"name": "m"}],
            "endpoints": [
                {"id": f"e{i}", "url": e.url, "models": ["m"]} for i, e in enumerate(engines)
            ],
            "probe_interval_s": 60,
        },
        RouterConfig,
    )
    r = Router(cfg)
    await r.start()
    runner = web.ServerRunner(build_server(r))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", r
    finally:
        await runner.cleanup()
        await r.stop()


async def embed(url: str) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/embeddings", json=EMBED) as resp,
    ):
        return resp.status, await resp.text()


async def test_an_engines_501_reaches_the_client_at_once_and_faults_no_replica(
    engines: list[Engine], router: tuple[str, Router]
) -> None:
    """Before: each replica was tried in turn, each counted as failing, and the client got a
    502 that quoted the first engine."""
    url, r = router
    for e in engines:
        e.status, e.asked = 501, 0
    for _ in range(3):
        status, text = await embed(url)
        assert status == 501, text
        assert json.loads(text)["error"]["message"] == SAID
    assert sum(e.asked for e in engines) == 3, "one attempt a request"
    assert [ep.breaker.failures for ep in r.table.by_id.values()] == [0, 0]


async def test_another_5xx_is_still_tried_on_the_next_replica(
    engines: list[Engine], router: tuple[str, Router]
) -> None:
    url, _ = router
    for e in engines:
        e.status, e.asked = 503, 0
    status, text = await embed(url)
    assert status == 502, text
    assert "engine answered 503" in json.loads(text)["error"]["message"]
    assert sum(e.asked for e in engines) == 2


async def test_an_engines_429_is_tried_on_the_next_replica_and_faults_none(
    engines: list[Engine], router: tuple[str, Router]
) -> None:
    """A replica that is busy says 429: another may not be. Relayed at once, the client was
    refused while the model's other replica was free."""
    url, r = router
    for e in engines:
        e.status, e.asked = 429, 0
    status, text = await embed(url)
    assert status == 429, text
    assert sum(e.asked for e in engines) == 2, "each replica asked once"
    assert [ep.breaker.failures for ep in r.table.by_id.values()] == [0, 0]  # busy, not broken


async def test_an_engines_401_is_the_routers_fault_never_the_clients(
    engines: list[Engine], router: tuple[str, Router]
) -> None:
    """The router checked the client's key itself: an engine's 401 means the key the router
    holds for that endpoint is stale. Relayed, the client was told its own key was bad."""
    url, _ = router
    for e in engines:
        e.status, e.asked = 401, 0
    status, text = await embed(url)
    assert status == 502, text
    assert "EndpointUp" in json.loads(text)["error"]["message"]
    assert sum(e.asked for e in engines) == 2, "the other replica may hold the right key"

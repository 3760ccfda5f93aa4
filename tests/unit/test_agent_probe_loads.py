"""What the agent concludes from its engines' HTTP answers: the startup probe's three
states, the startup deadlines, and the load report's figures, against a real HTTP server
that answers as told."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from aiohttp.test_utils import BaseTestServer, TestServer

from llmgw.agent import probe
from llmgw.agent.engines.common import Launch
from llmgw.agent.loads import EngineLoads
from llmgw.agent.shards import ShardView
from llmgw.core import loadreport
from llmgw.core.profile import LaunchSpec
from llmgw.natsd import free_port

KEY = "engine-key"


@dataclass
class Answers:
    """What the engine answers, and the Authorization headers it was sent."""

    health: int = 200
    models: int = 200
    models_body: bytes = b'{"data": [{"id": "m"}]}'
    metrics: int = 200
    metrics_body: bytes = b"vllm:num_requests_waiting 3\nvllm:num_requests_running 2\n"
    seen_keys: list[str] = field(default_factory=list)


@pytest.fixture
async def engine() -> AsyncIterator[tuple[BaseTestServer, Answers]]:
    said = Answers()

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=said.health)

    async def models(request: web.Request) -> web.Response:
        said.seen_keys.append(request.headers.get("Authorization", ""))
        return web.Response(status=said.models, body=said.models_body)

    async def metrics(request: web.Request) -> web.Response:
        said.seen_keys.append(request.headers.get("Authorization", ""))
        return web.Response(status=said.metrics, body=said.metrics_body)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    async with TestServer(app, host="127.0.0.1") as server:
        yield server, said


async def probed(server: BaseTestServer, name: str = "m", key: str = KEY) -> str:
    assert server.port is not None
    launch = Launch(argv=("x",), env={}, port=server.port, served_name=name, api_key=key)
    prober = probe.Prober()
    try:
        return await prober.probe(launch, timeout_s=30.0)
    finally:
        await prober.close()


async def test_ready_only_when_healthy_and_listing_the_name(
    engine: tuple[BaseTestServer, Answers],
) -> None:
    server, said = engine
    assert await probed(server) == "ready"
    assert said.seen_keys == [f"Bearer {KEY}"]  # the models list is asked with the key
    assert await probed(server, name="other") == "up"
    said.health = 503  # loading: /health says so even if a list already names the model
    assert await probed(server) == "up"
    said.health, said.models = 200, 401
    assert await probed(server) == "up"
    said.models, said.models_body = 200, b"<html>not json</html>"
    assert await probed(server) == "up"


async def test_nothing_listening_is_down() -> None:
    launch = Launch(argv=("x",), env={}, port=free_port(), served_name="m")
    prober = probe.Prober()
    try:
        assert await prober.probe(launch, timeout_s=5.0) == "down"
    finally:
        await prober.close()


SPEC = LaunchSpec(
    engine="sim", model="m", served_name="m", port=20000, gpus=(0,), start_timeout_s=10.0,
    load_timeout_s=100.0,
)  # fmt: skip


def test_a_loading_engine_is_judged_by_its_load_timeout_from_when_it_answered() -> None:
    launch = Launch(argv=("x",), env={}, port=20000, served_name="m")
    startup = probe.Startup(launch, SPEC, began=0.0)
    assert "did not open port" in startup.overdue("starting", 11.0)
    startup.up_since = 9.0  # it answered just in time, then loads for a long while
    assert startup.overdue("loading", 50.0) == ""
    assert startup.overdue("loading", 108.0) == ""
    assert "did not list 'm' within 100 s" in startup.overdue("loading", 110.0)


def view(url: str, **fields: object) -> ShardView:
    base: dict[str, object] = {
        "replica_id": "rep-1",
        "generation": 1,
        "shard": 0,
        "phase": "serving",
        "endpoint": url,
        "model": "m",
        "api_key": KEY,
    }
    return ShardView(**(base | fields))  # type: ignore[arg-type]


def test_only_shard_zero_serving_with_an_endpoint_is_followed() -> None:
    loads = EngineLoads()
    loads.observe(view("http://a", shard=1))
    assert loads.engines == {}
    loads.observe(view("http://a"))
    assert list(loads.engines) == ["rep-1"]
    loads.observe(view("http://a", phase="draining"))
    assert loads.engines == {}


async def test_an_engines_load_is_read_with_its_key_under_its_replica_id(
    engine: tuple[BaseTestServer, Answers],
) -> None:
    server, said = engine
    loads = EngineLoads(every_s=60.0)
    url = str(server.make_url("")).rstrip("/")
    try:
        got = await loads._read(view(url))
        assert got == loadreport.EndpointLoad(endpoint="rep-1", model="m", queue=3.0, running=2.0)
        assert said.seen_keys == [f"Bearer {KEY}"]
        said.metrics = 401
        assert await loads._read(view(url)) is None
        said.metrics, said.metrics_body = 200, b"vllm:num_requests_waiting \xff\xfe 3\n"
        assert await loads._read(view(url)) is None
    finally:
        await loads.close()


class Published:
    def __init__(self) -> None:
        self.reports: list[loadreport.LoadReport] = []

    async def publish(self, report: loadreport.LoadReport) -> None:
        self.reports.append(report)


async def test_no_report_goes_while_no_engine_serves() -> None:
    loads = EngineLoads(every_s=60.0)
    sink = Published()
    loads.publisher = sink  # type: ignore[assignment]
    assert await loads.report_once() is None
    assert sink.reports == []
    assert loads.sent == 0


@pytest.fixture
async def elsewhere() -> AsyncIterator[tuple[BaseTestServer, list[str]]]:
    """Another server, answering as a healthy engine would, counting what it is asked."""
    asked: list[str] = []

    async def anything(request: web.Request) -> web.Response:
        asked.append(request.path)
        if request.path == "/metrics":
            return web.Response(body=b"vllm:num_requests_waiting 7\n")
        return web.Response(body=b'{"data": [{"id": "m"}]}')

    app = web.Application()
    app.router.add_get("/{tail:.*}", anything)
    async with TestServer(app, host="127.0.0.1") as server:
        yield server, asked


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/metrics"])
async def test_an_engines_redirect_is_not_followed(
    path: str, elsewhere: tuple[BaseTestServer, list[str]]
) -> None:
    """The agent asks its engines with their key from the node's network: an engine
    pointing it elsewhere gets no request made there, and nothing it says counts."""
    other, asked = elsewhere

    async def moved(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(str(other.make_url(request.path)))

    async def fine(request: web.Request) -> web.Response:
        return web.Response(body=b"{}")

    app = web.Application()
    for p in ("/health", "/v1/models", "/metrics"):
        app.router.add_get(p, moved if p == path else fine)
    async with TestServer(app, host="127.0.0.1") as server:
        if path == "/metrics":
            loads = EngineLoads(every_s=60.0)
            try:
                assert await loads._read(view(str(server.make_url("")).rstrip("/"))) is None
            finally:
                await loads.close()
        else:
            assert await probed(server) == "up"
    assert asked == []

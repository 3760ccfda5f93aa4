"""What the agent reads from its engines over HTTP (the startup probe, the load scrape) is
bounded: an engine, or whatever took its port, that answers with a huge body costs the
agent a bounded amount of memory, not the body."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from llmgw.agent import probe
from llmgw.agent.engines.common import Launch
from llmgw.agent.loads import EngineLoads
from llmgw.agent.shards import ShardView
from llmgw.router.metrics import Metrics
from llmgw.router.table import EndpointTable
from llmgw.router.table import Prober as RouterProber

HUGE = 16 * 1024 * 1024


def _padded(text: str) -> bytes:
    """`text` followed by HUGE bytes of blank lines: valid JSON and a valid metrics page."""
    return text.encode() + b"\n" * HUGE


async def _models(_: web.Request) -> web.Response:
    return web.Response(body=_padded('{"data": [{"id": "m"}]}'))


PADDED_HEALTH: list[bool] = []
"""Non-empty: /health answers HUGE bytes too."""


async def _health(_: web.Request) -> web.Response:
    return web.Response(body=b"\n" * HUGE if PADDED_HEALTH else b"")


async def _metrics(_: web.Request) -> web.Response:
    return web.Response(body=_padded("vllm:num_requests_waiting 3\nvllm:num_requests_running 2"))


CHUNKED = b"x" * 100_000
"""What /chunked sends, in chunks, without a Content-Length."""


async def _chunked(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse()
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    for start in range(0, len(CHUNKED), 10_000):
        await resp.write(CHUNKED[start : start + 10_000])
    await resp.write_eof()
    return resp


@pytest.fixture
async def engine() -> AsyncIterator[TestServer]:
    app = web.Application()
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/chunked", _chunked)
    async with TestServer(app, host="127.0.0.1") as server:
        yield server


async def test_a_models_list_beyond_the_bound_is_not_read(engine: TestServer) -> None:
    """Before: the whole 16 MiB body was read and parsed ("ready")."""
    assert engine.port is not None
    launch = Launch(argv=("x",), env={}, port=engine.port, served_name="m")
    prober = probe.Prober()
    try:
        assert await prober.probe(launch, timeout_s=60.0) == "up"
    finally:
        await prober.close()


async def test_a_metrics_page_beyond_the_bound_is_left_out(engine: TestServer) -> None:
    """Before: the whole 16 MiB page was read into one string and parsed."""
    view = ShardView(
        replica_id="r",
        generation=1,
        shard=0,
        phase="serving",
        endpoint=str(engine.make_url("")).rstrip("/"),
    )
    loads = EngineLoads(every_s=60.0)
    try:
        assert await loads._read(view) is None
    finally:
        await loads.close()


async def test_bounded_body_reads_what_fits(engine: TestServer) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(engine.make_url("/metrics")) as resp:
            assert await probe.bounded_body(resp, HUGE + 100) is not None
        async with http.get(engine.make_url("/metrics")) as resp:
            assert await probe.bounded_body(resp, HUGE) is None


async def test_bounded_body_takes_a_body_of_exactly_the_bound(engine: TestServer) -> None:
    """The bound is the most read, whether the engine says the length or not."""
    page = await _metrics(None)  # type: ignore[arg-type]
    assert isinstance(page.body, bytes)
    async with aiohttp.ClientSession() as http:
        async with http.get(engine.make_url("/metrics")) as resp:
            assert resp.content_length == len(page.body)
            assert await probe.bounded_body(resp, len(page.body)) == page.body
        async with http.get(engine.make_url("/chunked")) as resp:
            assert resp.content_length is None
            assert await probe.bounded_body(resp, len(CHUNKED)) == CHUNKED
        async with http.get(engine.make_url("/chunked")) as resp:
            assert await probe.bounded_body(resp, len(CHUNKED) - 1) is None


async def test_the_routers_prober_reads_a_bounded_page_too(engine: TestServer) -> None:
    """The router's prober read an engine's /metrics whole (and /health): 16 MiB here, as
    much as an engine sends within the probe's timeout. A page past the bound is left
    unread and the endpoint scored as idle; a /health of megabytes is not a healthy one."""
    table = EndpointTable()
    table.add("e", str(engine.make_url("")).rstrip("/"), ["m"])
    async with aiohttp.ClientSession() as http:
        prober = RouterProber(table, http, Metrics(), interval=60.0)
        await prober.probe_all()
        ep = table.by_id["e"]
        assert ep.ready
        assert (ep.queue_depth, ep.running) == (0.0, 0.0)  # the page was not read
        PADDED_HEALTH.append(True)
        try:
            await prober.probe_all()
        finally:
            PADDED_HEALTH.clear()
        assert not ep.ready


@pytest.mark.parametrize(
    "listed", ['[{"id": ["m"]}]', '[{"id": {"m": 1}}, {"id": "m"}]', "[" * 100_000 + "]" * 100_000]
)
async def test_a_models_list_with_an_id_that_is_no_name_is_not_a_crash(
    listed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: an id that is a list or an object (unhashable) raised TypeError out of the
    probe, and a list nested past Python's recursion limit RecursionError, either of which
    ended the shard's watch task: the shard stayed starting for ever, its start deadline,
    its exit and its log trimming no longer watched. A list nested that deep is not even
    decoded (decoding recursed to the interpreter's limit, where a finalizer the collector
    ran failed in turn)."""
    decoded: list[int] = []
    real_loads = probe.json.loads

    def loads(raw: bytes) -> object:
        decoded.append(len(raw))
        return real_loads(raw)

    monkeypatch.setattr(probe.json, "loads", loads)

    async def models(_: web.Request) -> web.Response:
        return web.Response(text='{"data": ' + listed + "}")

    app = web.Application()
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", models)
    async with TestServer(app, host="127.0.0.1") as server:
        assert server.port is not None
        launch = Launch(argv=("x",), env={}, port=server.port, served_name="m")
        prober = probe.Prober()
        try:
            got = await prober.probe(launch, timeout_s=60.0)
        finally:
            await prober.close()
    assert got == ("ready" if '"id": "m"' in listed else "up")
    assert len(decoded) == (0 if len(listed) > 1000 else 1)

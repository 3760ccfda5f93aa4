"""An engine's Prometheus page decides the numbers it holds, not the shape of what llmgw
publishes from them: a gauge of +Inf, one past the load report's bounds, or +Inf and -Inf
summed over label sets (NaN) is read as a bounded, finite figure, so the load report that
carries it (a router's, about all its endpoints and models; an agent's, about all its
engines) still decodes, and the other endpoints' scores stay numbers."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from llmgw.agent.loads import EngineLoads
from llmgw.agent.shards import ShardView
from llmgw.core import loadreport
from llmgw.core.engine_metrics import MAX_LINES, parse_engine_metrics
from llmgw.core.routing import EndpointState, score_queue
from llmgw.router.metrics import Metrics
from llmgw.router.signals import _engine
from llmgw.router.table import TIMEOUTS_TO_UNREADY, EndpointTable, Prober

PAGES = {
    "inf": "vllm:num_requests_waiting +Inf\nvllm:num_requests_running +Inf\n",
    "huge": "vllm:num_requests_waiting 2e9\nvllm:num_requests_running 1e300\n",
    "nan": 'vllm:num_requests_waiting{m="a"} +Inf\nvllm:num_requests_waiting{m="b"} -Inf\n'
    'vllm:num_requests_running{m="a"} 1e308\nvllm:num_requests_running{m="b"} 1e308\n'
    "vllm:kv_cache_usage_perc +Inf\n",
}
PAGE: list[str] = []


async def _metrics(_: web.Request) -> web.Response:
    return web.Response(text=PAGE[0])


async def _health(_: web.Request) -> web.Response:
    return web.Response(text="")


@pytest.fixture
async def engine() -> AsyncIterator[TestServer]:
    app = web.Application()
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    async with TestServer(app, host="127.0.0.1") as server:
        yield server


def _decodes(*endpoints: loadreport.EndpointLoad) -> loadreport.LoadReport:
    report = loadreport.LoadReport(
        ts=1.0, endpoints=endpoints, models=(loadreport.ModelTraffic(model="other", requests=5),)
    )
    return loadreport.decode(loadreport.encode(report))


@pytest.mark.parametrize("page", sorted(PAGES))
async def test_the_routers_report_survives_an_engines_page(engine: TestServer, page: str) -> None:
    """Before: the router's report carried queue=inf (or 2e9, or NaN) for the engine, and
    the leader refused the whole report: the router's traffic for every model was lost."""
    PAGE[:] = [PAGES[page]]
    table = EndpointTable()
    table.add("e", str(engine.make_url("")).rstrip("/"), ["m"])
    async with aiohttp.ClientSession() as http:
        await Prober(table, http, Metrics(), interval=60.0).probe_all()
    ep = table.by_id["e"]
    assert ep.ready
    got = _decodes(_engine(ep))
    assert got.models[0].requests == 5
    peer = EndpointState(id="peer", url="http://x", models=frozenset({"m"}), queue_depth=3.0)
    assert all(math.isfinite(s) for s in score_queue([ep, peer], None))  # type: ignore[arg-type]


@pytest.mark.parametrize("page", sorted(PAGES))
async def test_the_agents_report_survives_an_engines_page(engine: TestServer, page: str) -> None:
    """Before: one engine's figures made the agent's report, about every engine of the
    node, one the leader refuses."""
    PAGE[:] = [PAGES[page]]
    view = ShardView(replica_id="r", generation=1, shard=0, phase="serving",
                     endpoint=str(engine.make_url("")).rstrip("/"))  # fmt: skip
    loads = EngineLoads(every_s=60.0)
    try:
        load = await loads._read(view)
    finally:
        await loads.close()
    assert load is not None
    sibling = loadreport.EndpointLoad(endpoint="s", model="m", queue=1.0)
    assert _decodes(load, sibling).endpoints[1] == sibling


def test_parsed_figures_are_finite_and_bounded() -> None:
    for text in PAGES.values():
        for value in parse_engine_metrics(text):
            assert value is None or 0.0 <= value <= loadreport.MAX_AMOUNT
    assert parse_engine_metrics("vllm:num_requests_waiting 3\nvllm:kv_cache_usage_perc 0.5\n") == (
        3.0, None, 0.5)  # fmt: skip


def test_only_the_lines_of_the_figures_count_and_no_more_than_the_bound() -> None:
    """The page is searched for the figures' names: a name within a line (a comment, a
    longer metric's) is not its line, and a page naming one past `MAX_LINES` times costs
    no more than that many."""
    page = (
        "# HELP vllm:num_requests_waiting 7\nvllm:num_requests_waiting_total 7\n"
        'xvllm:num_requests_running 7\nvllm:num_requests_waiting{m="a"} 2\r\n'
        "vllm:num_requests_waiting 1\n"
    )
    assert parse_engine_metrics(page) == (3.0, None, None)
    flood = "vllm:num_requests_running 1\n" * (MAX_LINES + 50)
    assert parse_engine_metrics(flood) == (None, float(MAX_LINES), None)


async def test_an_engines_figures_reach_the_endpoint_it_is_scored_by(engine: TestServer) -> None:
    PAGE[:] = [
        "vllm:num_requests_waiting 3\nvllm:num_requests_running 2\nvllm:kv_cache_usage_perc 0.5\n"
    ]
    table = EndpointTable()
    table.add("e", str(engine.make_url("")).rstrip("/"), ["m"])
    async with aiohttp.ClientSession() as http:
        await Prober(table, http, Metrics(), interval=60.0).probe_all()
    ep = table.by_id["e"]
    assert (ep.ready, ep.queue_depth, ep.running, ep.kv_usage) == (True, 3.0, 2.0, 0.5)


async def test_only_a_run_of_health_timeouts_takes_an_endpoint_out_of_rotation() -> None:
    """A busy engine answers late now and then: it stays in rotation until
    TIMEOUTS_TO_UNREADY probes in a row time out; one answer in time starts the count over."""
    answer = asyncio.Event()
    late = [True]

    async def health(_: web.Request) -> web.Response:
        if late[0]:
            await answer.wait()  # past the probe's timeout (1 s at this interval)
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/health", health)
    async with TestServer(app, host="127.0.0.1") as server:
        table = EndpointTable()
        ep = table.add("e", str(server.make_url("")).rstrip("/"), ["m"], ready=True)
        seen = []
        try:
            async with aiohttp.ClientSession() as http:
                prober = Prober(table, http, Metrics(), interval=0.1)
                for slow in (True, True, False, True, True, True):
                    late[0] = slow
                    await prober.probe_all()
                    seen.append(ep.ready)
        finally:
            answer.set()
    assert TIMEOUTS_TO_UNREADY == 3
    assert seen == [True, True, True, True, True, False]

"""The routers' load reports on a real nats-server with mutual TLS (llmgw.bus.signals): a
router speaks only for itself, and the leader believes only what its owner signed.

Tried as an attacker holding one router's (or one node's) certificate would: publishing on
another router's subject, replaying another router's signature on its own subject,
publishing garbage, and publishing as a node at all.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request

import msgspec
import nats.errors
import pytest

from llmgw import bus
from llmgw.agent.loads import EngineLoads
from llmgw.agent.shards import ShardView
from llmgw.core import loadreport, subjects
from llmgw.sim.testing import SimProcess
from tests.harness import TestNatsServer, connect_as, signed_headers, wait_for

pytestmark = pytest.mark.slow


def report(ts: float, waiting: int) -> loadreport.LoadReport:
    return loadreport.LoadReport(ts=ts, models=(
        loadreport.ModelTraffic(model="m", requests=5, waiting=waiting),))  # fmt: skip


async def read(server: TestNatsServer) -> tuple[list[bus.Record], bus.SignalsReader]:
    control = await connect_as(server, "control", "c1")
    try:
        reader = bus.SignalsReader(control, since=0.0, follow=False, name="t")
        out: list[bus.Record] = []
        async with reader:
            async for batch in reader.batches():
                out.extend(batch)
        return out, reader
    finally:
        await control.close()


async def test_a_router_reports_only_for_itself(nats_server: TestNatsServer) -> None:
    control = await connect_as(nats_server, "control", "c1")
    await bus.provision(control.jetstream())
    await control.close()
    honest = await connect_as(nats_server, "router", "router-1")
    attacker = await connect_as(nats_server, "router", "router-2")
    node = await connect_as(nats_server, "node", "node-a")
    try:
        await bus.SignalsPublisher(honest, "router-1").publish(report(1.0, 1))
        forged = loadreport.encode(report(2.0, 999))
        # 1. On the honest router's subject: the server refuses it.
        victim = subjects.router_signals("router-1", 0)
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await attacker.jetstream().publish(
                victim, forged, headers=signed_headers(attacker, victim, forged, "f1"),
                timeout=1.0,
            )  # fmt: skip
        await wait_for(lambda: any("llmgw.signals.router.router-1" in v
                                   for v in attacker.permission_violations), 10,
                       "the server to report the refused publish")  # fmt: skip
        # 2. Its own subject with the honest router's signature (a replayed report): stored,
        # and refused by every reader. (Each case on a subject of its own: the stream keeps
        # each subject's latest report only.)
        replayed = subjects.router_signals("router-2", 1)
        await attacker.publish(replayed, forged,
                               headers=signed_headers(honest, replayed, forged, "f2"))  # fmt: skip
        # 3. Garbage, signed: stored, skipped with a reason.
        own = subjects.router_signals("router-2", 0)
        await bus.SignalsPublisher(attacker, "router-2").publish(report(3.0, 2))
        junk = b"\x81\xa2ts\xa3now"
        garbled = subjects.router_signals("router-2", 2)
        await attacker.publish(garbled, junk, headers=signed_headers(attacker, garbled, junk, "f3"))
        # 4. A node publishes no load report at all.
        await node.publish(subjects.router_signals("node-a", 0), forged)
        await asyncio.gather(honest.flush(), attacker.flush(), node.flush())
        await wait_for(lambda: any("llmgw.signals" in v for v in node.permission_violations),
                       10, "the server to refuse the node's report")  # fmt: skip

        async def settled() -> bool:
            got, _ = await read(nats_server)
            return len(got) >= 2

        await wait_for(settled, 10, "the two genuine reports stored")
        got, reader = await read(nats_server)
        assert [(r.subject, bus.signals.report_of(r).models[0].waiting) for r in got] == [
            (subjects.router_signals("router-1", 0), 1),
            (own, 2),
        ]
        assert reader.refused == 1  # the replayed signature
        assert any("not a load report" in s.error for s in reader.skipped)
    finally:
        for nc in (honest, attacker, node):
            await bus.close(nc)


async def test_a_report_dated_ahead_is_read_as_dated_when_the_server_stored_it(
    nats_server: TestNatsServer,
) -> None:
    # A router dating its reports ahead had the last word on every engine figure routers
    # report: the leader took the report dated latest as the freshest.
    control = await connect_as(nats_server, "control", "c1")
    await bus.provision(control.jetstream())
    await control.close()
    router = await connect_as(nats_server, "router", "router-1")
    try:
        await bus.SignalsPublisher(router, "router-1").publish(report(10.0**10, 1))
        await bus.SignalsPublisher(router, "router-1", 1).publish(report(2.0, 2))
        await router.flush()

        async def stored() -> bool:
            got, _ = await read(nats_server)
            return len(got) == 2

        await wait_for(stored, 10, "both reports stored")
        got, _ = await read(nats_server)
        ahead, behind = (bus.signals.report_of(r) for r in got)
        assert ahead.ts == got[0].time < 10.0**10
        assert behind.ts == 2.0  # a report is as old as it says, when that is older
    finally:
        await bus.close(router)


async def test_an_agent_reports_its_serving_engines_load_on_its_own_subject(
    nats_server: TestNatsServer,
) -> None:
    control = await connect_as(nats_server, "control", "c1")
    await bus.provision(control.jetstream())
    await control.close()
    sim = await asyncio.to_thread(SimProcess.start, "--decode-base-ms", "50", model="m")
    node = await connect_as(nats_server, "node", "node-a")
    loads = EngineLoads()
    try:
        loads.bind(node, "node-a")
        view = ShardView(replica_id="r1", generation=1, shard=0, phase="serving",
                         endpoint=sim.url, model="m")  # fmt: skip
        loads.observe(view)
        loads.observe(ShardView(replica_id="r2", generation=1, shard=0, phase="starting"))
        # Two streams running in the engine while the agent reads it.
        streams = [asyncio.to_thread(_stream, sim.url) for _ in range(2)]
        running = asyncio.gather(*streams)
        await wait_for(lambda: _running_at_least(loads, 2), 20, "the engine's running requests")
        await running
        got, _ = await read(nats_server)
        mine = [r for r in got if r.subject == subjects.node_signals("node-a")]
        assert mine, got
        assert {e.endpoint for r in mine for e in bus.signals.report_of(r).endpoints} == {"r1"}
        # A shard that stops serving is no longer read.
        loads.observe(msgspec.structs.replace(view, phase="draining"))
        assert loads.engines == {}
        # And a node cannot publish another node's load.
        await node.publish(subjects.node_signals("node-b"), b"x")
        await wait_for(lambda: any("llmgw.signals.node.node-b" in v
                                   for v in node.permission_violations), 10,
                       "the server to refuse it")  # fmt: skip
    finally:
        await loads.close()
        await node.close()
        sim.stop()


async def _running_at_least(loads: EngineLoads, n: float) -> bool:
    report = await loads.report_once()
    return report is not None and sum(e.running for e in report.endpoints) >= n


def _stream(url: str) -> None:
    body = json.dumps({"model": "m", "max_tokens": 60, "stream": True,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()  # fmt: skip
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=30) as resp:
        resp.read()

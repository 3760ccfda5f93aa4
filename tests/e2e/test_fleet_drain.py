"""Rolling drain under load, with every process real (issue 8, must show).

nats-server, `llmgw control`, two `llmgw agent`s whose replicas are `llmgw sim` engines,
and `llmgw router` fed by the log; four streaming clients loop through the router while
`llmgw ctl drain` (the real command line) moves node-a's replica to node-b. Every
response must be whole, and afterwards the router sends nothing to node-a. The same
holds when the drained node holds every replica of the model, or its only one: its
endpoints keep taking requests until a replacement serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from llmgw.core import events
from tests.e2e.fleet_kit import Fleet, Load, on_node, serving, sim_model, wait_for
from tests.harness import TestNatsServer
from tests.integration.ctl_kit import Ctl

pytestmark = pytest.mark.slow


async def test_rolling_drain_under_load_loses_no_request(
    nats_server: TestNatsServer, fleet: Fleet
) -> None:
    await fleet.start()
    rows = await fleet.replicas()
    # Spread: one replica on each node, so the drain moves one while the other serves.
    assert {s["node"] for r in rows for s in r["shards"]} == {"node-a", "node-b"}, rows
    (moving,) = [r["id"] for r in rows if on_node(r, "node-a")]
    (staying,) = [r["id"] for r in rows if on_node(r, "node-b")]

    ctl = Ctl(nats_server)
    async with Load(fleet.router_url, clients=4) as load:
        await load.wait_ok(20)
        sent_before = await fleet.router_sent()
        assert sent_before.get(moving, 0) > 0, "node-a took no traffic before the drain"
        started = time.monotonic()
        drained = await ctl.subprocess(
            "drain", "node-a", "--grace", "30", "--wait", "--timeout", "60", "--json"
        )
        assert drained.code == 0, f"{drained}\n{fleet.logs()}"
        doc = drained.json()
        drain_s = time.monotonic() - started
        assert doc["progress"]["done"], doc
        assert doc["progress"]["replaced"] == 1, doc

        rows = await fleet.replicas()
        live = [r for r in rows if not r["retired"]]
        assert all(on_node(r, "node-b") and not on_node(r, "node-a") for r in live), rows
        assert len([r for r in live if serving(r)]) == 2, rows
        (replacement,) = [r["id"] for r in live if r["id"] != staying]

        # Traffic ends on node-b: node-a's endpoint gets nothing more, both of node-b's get
        # some. (Each request picks an endpoint afresh, so 40 requests reach both.)
        await fleet.wait_routable(2)
        sent_after = await fleet.router_sent()
        during = load.ok
        await load.wait_ok(40)
        sent_later = await fleet.router_sent()
    assert sent_later.get(moving, 0) == sent_after.get(moving, 0), (sent_after, sent_later)
    assert sent_later[replacement] > sent_after.get(replacement, 0), (sent_after, sent_later)
    assert sent_later[staying] > sent_after[staying], (sent_after, sent_later)
    assert not load.failures, f"{load.summary()}\n{fleet.logs()}"
    assert during >= 20
    print(f"drain took {drain_s:.1f} s under load; {load.ok} streams, none failed")

    # The drained node holds nothing; the router's endpoint list follows the log.
    await wait_for(lambda: _node_empty(fleet, "node-a"), 10, "node-a holds no replica", every_s=0.2)


async def _node_empty(fleet: Fleet, node: str) -> bool:
    nodes = await fleet.nodes_view()
    return nodes[node]["draining"] and all(g["replica"] is None for g in nodes[node]["gpus"])


async def _drain_under_load(fleet: Fleet, node: str) -> None:
    """Drain `node` (the real command line) under four streaming clients: not one request
    may fail, each of its replicas gets exactly one replacement (none placed as surplus),
    and afterwards no request reaches the drained replicas."""
    rows = await fleet.replicas()
    originals = sorted(r["id"] for r in rows if on_node(r, node) and not r["retired"])
    assert originals, rows
    ctl = Ctl(fleet.server)  # type: ignore[arg-type]
    not_ready: list[str] = []
    watching = asyncio.Event()
    async with Load(fleet.router_url, clients=4) as load:
        await load.wait_ok(20)
        watcher = asyncio.create_task(_watch_ready(fleet.router_url, watching, not_ready))
        started = time.monotonic()
        drained = await ctl.subprocess(
            "drain", node, "--grace", "60", "--wait", "--timeout", "90", "--json"
        )
        watching.set()
        await watcher
        assert drained.code == 0, f"{drained}\n{fleet.logs()}"
        # A load balancer polling the router's /ready would have kept it in rotation.
        assert not_ready == [], not_ready[:5]
        drain_s = time.monotonic() - started
        doc = drained.json()
        assert doc["progress"]["done"], doc
        assert doc["progress"]["replaced"] == len(originals), doc

        live = [r for r in await fleet.replicas() if not r["retired"]]
        assert not [r for r in live if on_node(r, node)], live
        await fleet.wait_routable(len(rows))
        sent_after = await fleet.router_sent()
        await load.wait_ok(40)
        sent_later = await fleet.router_sent()
    assert not load.failures, f"{load.summary()}\n{fleet.logs()}"
    for rid in originals:
        assert sent_later.get(rid, 0) == sent_after.get(rid, 0), (rid, sent_after, sent_later)

    # Exactly one replacement per drained replica: nothing placed and retired as surplus.
    records = await fleet.read_log()
    (asked,) = [
        r.seq
        for r in records
        if isinstance(r.event, events.NodeDrainRequested) and r.event.node == node
    ]
    placed = [
        r.event for r in records if r.seq > asked and isinstance(r.event, events.ReplicaPlaced)
    ]
    assert sorted(p.replaces for p in placed) == originals, placed
    surplus = [
        r.event
        for r in records
        if isinstance(r.event, events.ReplicaRetired) and "surplus" in r.event.reason
    ]
    assert surplus == [], surplus
    print(f"drain of {node} took {drain_s:.1f} s under load; {load.ok} streams, none failed")


async def _watch_ready(router_url: str, stop: asyncio.Event, seen: list[str]) -> None:
    """Poll the router's /ready until `stop`; note every answer that is not ready for m1."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        while not stop.is_set():
            try:
                async with session.get(router_url.rstrip("/") + "/ready") as r:
                    body = await r.json()
                    if r.status != 200 or not body["ready_endpoints"].get("m1"):
                        seen.append(f"{r.status} {body}")
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                seen.append(f"{type(exc).__name__}: {exc}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.05)  # the polling cadence


async def test_draining_the_node_holding_every_replica_loses_no_request(
    nats_server: TestNatsServer, fleet: Fleet
) -> None:
    # node-a alone at first: both replicas of m1 land on it; node-b joins empty.
    await fleet.start(first=("node-a",))
    rows = await fleet.replicas()
    assert len(rows) == 2, rows
    assert all(on_node(r, "node-a") for r in rows), rows
    await fleet.join("node-b")
    await _drain_under_load(fleet, "node-a")


@pytest.fixture
async def one_replica(nats_server: TestNatsServer, tmp_path: Path) -> AsyncIterator[Fleet]:
    """Two nodes, one replica of m1 (so the drained node holds the only one)."""
    f = Fleet(nats_server, tmp_path, models=(sim_model(replicas=1),))
    try:
        yield f
    finally:
        await f.stop()


async def test_draining_the_only_replica_loses_no_request(one_replica: Fleet) -> None:
    await one_replica.start()
    (row,) = await one_replica.replicas()
    (holder,) = {s["node"] for s in row["shards"]}
    await _drain_under_load(one_replica, holder)

"""Rolling drain under load, with every process real (issue 8, must show).

nats-server, `llmgw control`, two `llmgw agent`s whose replicas are `llmgw sim` engines,
and `llmgw router` fed by the log; four streaming clients loop through the router while
`llmgw ctl drain` (the real command line) moves node-a's replica to node-b. Every
response must be whole, and afterwards the router sends nothing to node-a.
"""

from __future__ import annotations

import time

import pytest

from tests.e2e.fleet_kit import Fleet, Load, on_node, serving, wait_for
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

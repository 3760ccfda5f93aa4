"""A node cut off long enough to be declared lost, which then comes back (every process real).

node-a's agent is frozen (SIGSTOP): no heartbeats, while its engine keeps running, as
in a network partition. The control plane declares the node lost and replaces its
replica on node-b. Then the agent resumes (SIGCONT) with no reconnect and so no
registration report, only heartbeats: the node recovers, the engine of the retired
replica, still holding its GPU, is stopped by the control plane, and a new model is
placed on node-a's GPUs and served. Throughout, clients are served.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from llmgw import pidfiles, processes
from llmgw.core import events
from tests.e2e.fleet_kit import Fleet, Load, on_node, openai_stream, serving, sim_model, wait_for
from tests.harness import TestNatsServer

pytestmark = pytest.mark.slow


@pytest.fixture
async def fleet(nats_server: TestNatsServer, tmp_path: Path) -> AsyncIterator[Fleet]:
    f = Fleet(nats_server, tmp_path)
    try:
        yield f
    finally:
        agent = f.agents.get("node-a")
        if agent is not None and agent.running:
            os.kill(agent.pid, signal.SIGCONT)  # a stopped process ignores SIGTERM
        await f.stop()


async def test_a_lost_node_that_comes_back_has_its_stale_engine_stopped_and_hosts_again(
    fleet: Fleet,
) -> None:
    await fleet.start()
    rows = await fleet.replicas()
    (cut_off,) = [r["id"] for r in rows if on_node(r, "node-a")]
    (engine,) = [
        rec.process
        for _, rec in pidfiles.load_all(fleet.state_dir("node-a"))
        if rec is not None and rec.replica_id == cut_off
    ]

    async with Load(fleet.router_url, clients=2) as load:
        await load.wait_ok(10)
        agent = fleet.agents["node-a"]
        os.kill(agent.pid, signal.SIGSTOP)
        frozen = time.monotonic()

        async def liveness(state: str) -> bool:
            return bool((await fleet.nodes_view())["node-a"]["liveness"] == state)

        await wait_for(lambda: liveness("lost"), 20, "node-a lost")
        rows = await fleet.wait_routable(2, 30)
        assert all(on_node(r, "node-b") for r in rows), rows
        assert not processes.mismatch(engine), "the cut-off node's engine should still run"

        os.kill(agent.pid, signal.SIGCONT)
        resumed = time.monotonic()
        await wait_for(lambda: liveness("ready"), 20, "node-a recovered")

        def engine_gone() -> bool:
            return bool(processes.mismatch(engine))

        stopped_s = await wait_for(engine_gone, 30, "the retired replica's engine stopped")

        async def node_a_clear() -> bool:
            node = (await fleet.nodes_view())["node-a"]
            return not node["orphans"] and all(g["replica"] is None for g in node["gpus"])

        await wait_for(node_a_clear, 15, "node-a with no orphan and every GPU free")

        # The GPUs it frees host again: a model wanting two replicas, where only node-a
        # has room, lands there and serves.
        await fleet.publish(
            events.ModelDeclared(
                id="declare-m2", ts=time.time(), operator="admin", profile=sim_model("m2", 2)
            )
        )

        async def m2_served() -> bool:
            m2 = [r for r in await fleet.replicas() if r["model"] == "m2" and serving(r)]
            return len(m2) == 2

        await wait_for(m2_served, 40, "two replicas of m2 serving on node-a", every_s=0.2)
        rows = [r for r in await fleet.replicas() if r["model"] == "m2" and not r["retired"]]
        assert all(on_node(r, "node-a") for r in rows), rows
        assert all(r["failures"] == 0 for r in rows), rows
        text = await asyncio.to_thread(openai_stream, fleet.router_url, "m2")
        await load.wait_ok(10)

    assert text
    assert not load.failures, f"{load.summary()}\n{fleet.logs()}"
    records = await fleet.read_log()
    refused = [
        r.event
        for r in records
        if isinstance(r.event, events.ShardStatus) and "already used" in r.event.error
    ]
    assert not refused, refused
    stops = [
        r.event
        for r in records
        if isinstance(r.event, events.StopShard) and r.event.replica_id == cut_off
    ]
    assert [s.node for s in stops] == ["node-a"], stops
    print(
        f"node-a frozen {resumed - frozen:.1f} s (lost, replica moved); after it resumed its "
        f"stale engine was stopped in {stopped_s:.1f} s and m2 placed there; "
        f"{load.ok} streams ok"
    )

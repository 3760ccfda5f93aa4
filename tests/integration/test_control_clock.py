"""A leader whose host clock is an hour off judges nodes by the NATS server's time.

A heartbeat's age is the server's time of storing it against the leader's "now". With
"now" read from the leader host's own clock, an hour ahead made every node lost at once
(every replica of the fleet replaced), and an hour behind made a dead node look alive for
an hour. The control plane measures its clock against the server's on every write of the
lease (llmgw.bus.servertime); these tests run a real nats-server, a control plane in
process whose clock is an hour off, and simulated agents on the wire.
"""

from __future__ import annotations

import asyncio
import time
import types

import pytest

from llmgw import bus
from llmgw.bus import keys
from llmgw.bus import lease as lease_
from llmgw.bus.provisioning import LEASE_BUCKET
from llmgw.control.service import ControlService
from llmgw.core import events
from tests.harness import TestNatsServer, connect_as, wait_for
from tests.integration.control_kit import FAST, SimAgent, control_config, model, read_log, running

HOUR_S = 3600.0


async def _judged(server: TestNatsServer) -> list[events.Event]:
    nc = await connect_as(server, "operator", "alice")
    try:
        records = await read_log(nc)
    finally:
        await bus.close(nc)
    verdicts = events.NodeLost | events.NodeUnreachable | events.ReplicaRetired
    return [r.event for r in records if isinstance(r.event, verdicts)]


@pytest.mark.parametrize("skew_s", [HOUR_S, -HOUR_S], ids=["ahead", "behind"])
async def test_a_leader_an_hour_off_judges_nodes_by_the_servers_time(
    nats_server: TestNatsServer, skew_s: float
) -> None:
    cfg = control_config(nats_server, "control-a", models=(model("m1", replicas=2),))
    agents: list[SimAgent] = []
    try:
        svc = ControlService(cfg, clock=lambda: time.time() + skew_s)
        async with running(svc):
            assert svc.clock.offset == pytest.approx(-skew_s, abs=1.0)  # measured at start
            for node in ("node-a", "node-b"):
                agents.append(await SimAgent(nats_server, node, gpus=1).start())
            await wait_for(lambda: len(svc.state.endpoints) == 2, 20, "m1 serving on both")
            replicas = {r.id for r in svc.state.active_replicas("m1")}
            # Longer than lost_after_s of the nodes' life under this leader.
            await asyncio.sleep(FAST.lost_after_s + 1.0)
            assert {n.liveness for n in svc.state.nodes.values()} == {"ready"}
            assert {r.id for r in svc.state.active_replicas("m1")} == replicas
            assert await _judged(nats_server) == []
            assert svc.metrics.clock_offset._value.get() == pytest.approx(-skew_s, abs=1.0)

            # A node that dies is found lost after lost_after_s of silence by the
            # server's time: within seconds, not an hour and some.
            dying, living = agents
            await dying.close()
            await wait_for(
                lambda: svc.state.nodes[dying.node].liveness == "lost",
                30,
                f"{dying.node} lost",
                detail=lambda: str(svc.state.nodes[dying.node].liveness),
            )
            assert svc.state.nodes[living.node].liveness == "ready"
    finally:
        for agent in agents:
            await agent.close()


async def test_a_standby_honours_the_lease_of_a_leader_an_hour_behind(
    nats_server: TestNatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The lease's value says until when it holds (llmgw.bus.lease): written by the
    # leader's clock and judged by a contender's, both must be the server's time, or a
    # standby with a good clock reads a live leader's lease as run out and takes it over.
    real = time.time
    behind = types.SimpleNamespace(time=lambda: real() - HOUR_S, monotonic=time.monotonic)
    monkeypatch.setattr(lease_, "time", behind)  # the leader's host, its lease included
    cfg = control_config(nats_server, "control-a")
    nc = await connect_as(nats_server, "operator", "alice")
    try:
        async with running(ControlService(cfg, clock=behind.time)) as svc:
            await wait_for(lambda: svc.leading, 20, "control-a leading")
            kv = await nc.jetstream().key_value(LEASE_BUCKET)
            stored = await kv.get(lease_.KEY)
            assert stored.value is not None
            verifier = keys.verifier_of(nc)
            assert verifier is not None
            # What a standby with a good clock reads of it.
            value = lease_.verified_value(verifier, stored.value, real(), cfg.lease_ttl_s)
            assert not isinstance(value, str), value
            assert value.holder == "control-a"
    finally:
        await bus.close(nc)

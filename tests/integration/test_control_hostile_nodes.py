"""What one node's identity could do to the leader, against a real nats-server.

- an orphan (a live replica reported at an older generation) gets one StopShard, and
  later ones only after a growing wait, never one per pass;
- ids published in advance under the leader's old predictable scheme suppress none of
  its decisions (JetStream de-duplicates ids across the whole stream);
- `ctl status` says when nobody leads;
- empty messages on its own subjects (each has every reader start a new consumer) do not
  stop the leader from judging the other nodes' heartbeats.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import msgspec
import pytest

from llmgw import bus
from llmgw.bus.lease import KEY
from llmgw.bus.provisioning import LEASE_BUCKET
from llmgw.control.service import ControlService
from llmgw.core import events, subjects
from tests.harness import Connector, TestNatsServer, connect_as, wait_for
from tests.integration.control_kit import (
    FAST,
    SimAgent,
    control_config,
    model,
    read_log,
    running,
)
from tests.integration.ctl_kit import Ctl

pytestmark = pytest.mark.slow


def serving(svc: ControlService, name: str) -> int:
    return sum(1 for r in svc.state.active_replicas(name) if r.id in svc.state.endpoints)


class StuckAgent(SimAgent):
    """An agent whose old-generation processes ignore StopShard (a wedged engine)."""

    async def _on_command(self, cmd: events.Event) -> None:
        old = self.running.get((getattr(cmd, "replica_id", ""), getattr(cmd, "shard", 0)))
        if isinstance(cmd, events.StopShard) and old != cmd.generation:
            return
        await super()._on_command(cmd)


async def test_an_orphan_generation_is_stopped_once_then_with_backoff(
    nats_server: TestNatsServer,
) -> None:
    cfg = control_config(
        nats_server,
        "control-a",
        models=(model("m1"),),
        reconcile=msgspec.structs.replace(FAST, orphan_stop_retry_s=1.0, orphan_stop_retry_max_s=8),
    )
    async with running(ControlService(cfg)) as svc:
        agent = await StuckAgent(nats_server, "node-a", gpus=1).start()
        try:
            await wait_for(lambda: serving(svc, "m1") == 1, 15, "m1 serving")
            (rid,) = svc.state.replicas
            start = next(c for c in agent.commands if isinstance(c, events.StartShard))
            await agent.status(start, "failed", error="engine exited")
            await wait_for(
                lambda: svc.state.replicas[rid].generation == 2 and serving(svc, "m1") == 1,
                15,
                "generation 2 serving",
            )
            gpus = svc.state.replicas[rid].shards[0].gpus
            endpoint = svc.state.replicas[rid].shards[0].endpoint
            # The agent re-registers still running generation 1 beside generation 2.
            await agent.publish(
                events.NodeRegistered(
                    id=agent._id("reg"),
                    ts=time.time(),
                    node="node-a",
                    address="127.0.0.1",
                    gpus=agent.gpus,
                    shards=(
                        events.RunningShard(
                            replica_id=rid, generation=1, shard=0, gpus=gpus, phase="serving"
                        ),
                        events.RunningShard(
                            replica_id=rid,
                            generation=2,
                            shard=0,
                            gpus=gpus,
                            phase="serving",
                            endpoint=endpoint,
                        ),
                    ),
                )
            )
            await wait_for(lambda: bool(svc.state.nodes["node-a"].orphans), 10, "the orphan")
            began = time.monotonic()
            await asyncio.sleep(6.0)
            watched = time.monotonic() - began
            nc = await connect_as(nats_server, "router", "probe")
            try:
                log = await read_log(nc)
            finally:
                await bus.close(nc)
            stops = [
                r
                for r in log
                if isinstance(r.event, events.StopShard)
                and r.event.replica_id == rid
                and r.event.generation == 1
            ]
            # Sent at once, then after 1, 2, 4 s: at most 4 in the ~6 s watched (the old
            # leader sent one on every pass, several a second, forever).
            assert 2 <= len(stops) <= 4, [s.time for s in stops]
            gaps = [b.time - a.time for a, b in itertools.pairwise(stops)]
            assert all(g >= 0.9 for g in gaps), gaps
            assert gaps == sorted(gaps)
            assert watched >= 6.0
            assert svc.folded.own_rejected == 0  # the fold accepted each of them
            orphan = svc.state.nodes["node-a"].orphans[0]
            assert orphan.stops == len(stops)
            # Generation 2 serves on, untouched.
            assert svc.state.replicas[rid].shards[0].phase == "serving"
            assert rid in svc.state.endpoints
        finally:
            await agent.close()


async def test_ids_published_in_advance_suppress_no_decision(
    nats_server: TestNatsServer, connect: Connector
) -> None:
    admin = await connect.admin()
    await bus.provision(admin.jetstream())
    evil = await connect_as(nats_server, "node", "node-evil")
    js = evil.jetstream()
    # Every id the old scheme would give the first leader's first decisions: these 2,001
    # messages put its first decisions at basis 2,001 and after.
    bases = range(2000, 2400)
    predicted = ["leader-control-a-1"]
    predicted += [f"config-control-a-{b}-{i}" for b in bases for i in range(2)]
    predicted += [f"1-{b}-{i}" for b in bases for i in range(3)]
    subject = subjects.node_event("node-evil", "heartbeat")
    sent = 0
    for chunk in range(0, len(predicted), 200):
        acks = [
            js.publish(subject, b"{}", headers={"Nats-Msg-Id": msg_id})
            for msg_id in predicted[chunk : chunk + 200]
        ]
        sent += len(await asyncio.gather(*acks))
    assert sent == len(predicted)
    cfg = control_config(nats_server, "control-a", models=(model("m1", replicas=2),))
    async with running(ControlService(cfg)) as svc:
        agent = await SimAgent(nats_server, "node-a", gpus=2).start()
        try:
            await wait_for(lambda: svc.state.leader == "control-a", 15, "control-a elected")
            await wait_for(lambda: serving(svc, "m1") == 2, 20, "m1's two replicas serving")
            log = await read_log(admin)
            mine = [
                r.event
                for r in log
                if isinstance(r.event, events.ControlEvent | events.ModelDeclared)
            ]
            assert mine
            assert all(len(e.id.rsplit("-", 1)[-1]) == 32 for e in mine)
            assert not {e.id for e in mine} & set(predicted)
            # ... and the old scheme's ids of these very decisions were taken in advance.
            old_ids = {e.id.rsplit("-", 1)[0] for e in mine}
            assert "leader-control-a-1" in old_ids
            assert len(old_ids & set(predicted)) >= 4, sorted(old_ids)[:10]
            assert svc.metrics.fence_refused._value.get() == 0
        finally:
            await agent.close()
    await evil.close()


async def test_ctl_status_reports_a_lost_leader(
    nats_server: TestNatsServer, connect: Connector
) -> None:
    ctl = Ctl(nats_server)
    cfg = control_config(nats_server, "control-a")
    async with running(ControlService(cfg)) as svc:
        await wait_for(lambda: svc.state.leader == "control-a", 15, "control-a elected")
        text = (await ctl("status")).stdout
        assert "leader control-a (epoch 1) since 20" in text
        assert (await ctl("status", "--json")).json()["leader_state"] == "leading"
    # A clean stop releases the lease.
    released = await ctl("status")
    assert "NO LEADER: the lease was released at 20" in released.stdout
    assert "the log's last elected leader is control-a (epoch 1" in released.stdout
    assert (await ctl("status", "--json")).json()["leader_state"] == "none"
    # Someone else holds the lease but never announced itself in the log.
    admin = await connect.admin()
    kv = await admin.jetstream().key_value(LEASE_BUCKET)
    await kv.create(KEY, msgspec.json.encode({"holder": "control-z", "epoch": 0}), msg_ttl=2)
    other = await ctl("status", "--json")
    doc = other.json()
    assert doc["leader_state"] == "unannounced"
    assert doc["lease"]["holder"] == "control-z"
    assert "NO LEADER in the log: control-z holds the lease" in (await ctl("status")).stdout

    # Its TTL runs out: free again.
    async def expired() -> bool:
        return bool((await ctl("status", "--json")).json()["leader_state"] == "none")

    await wait_for(expired, 10, "the lease expired", every_s=0.5)
    await admin.close()


async def test_empty_messages_on_a_nodes_subjects_do_not_hide_another_nodes_silence(
    nats_server: TestNatsServer,
) -> None:
    """A reader starts a new consumer after a message with neither payload nor headers (the
    server streams nothing more of that request), and the leader judged heartbeat silence
    only from its reader's last reset, as after an outage. One empty message every
    second, from any node (120 in `window_s`, far under its budget), kept every other
    node from ever being declared unreachable, however long it had been silent."""
    cfg = control_config(nats_server, "control-a", models=(model("m1"),))
    attacker = await connect_as(nats_server, "node", "node-x")
    agents: list[SimAgent] = []
    stop = asyncio.Event()

    async def empties() -> None:
        while not stop.is_set():
            await attacker.jetstream().publish(subjects.node_event("node-x", "shard"), b"")
            await asyncio.sleep(0.5)  # a quarter of unreachable_after_s

    try:
        async with running(ControlService(cfg)) as svc:
            agents = [await SimAgent(nats_server, n, gpus=1).start() for n in ("node-a", "node-b")]
            await wait_for(lambda: len(svc.state.nodes) == 2, 20, "both nodes registered")
            await wait_for(lambda: svc.leading and svc.caught_up.is_set(), 20, "leading")
            writer = asyncio.create_task(empties())
            try:
                agents[1].beating = False
                await wait_for(
                    lambda: svc.state.nodes["node-b"].liveness != "ready",
                    30,
                    "node-b, silent, declared unreachable",
                    every_s=0.2,
                )
                assert svc.state.nodes["node-a"].liveness == "ready"
                assert svc.folded.undecodable >= 3
            finally:
                stop.set()
                await writer
    finally:
        for agent in agents:
            await agent.close()
        await bus.close(attacker)

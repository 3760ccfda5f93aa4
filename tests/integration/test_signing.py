"""Signed events against a real nats-server: what the server stores wrongly is never acted on.

The test admin is a superuser (it may store anything anywhere), which is what a server
that stored a message on the wrong subject, or an attacker who found a way around the
authorization, amounts to. Whatever it stores, unsigned or signed by the wrong identity,
a real `llmgw agent` process never obeys and a real control plane never folds; a forged
lease does not keep the control plane from leading, and a forged snapshot is passed over
for the log.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client

from llmgw import bus
from llmgw.bus import lease as lease_module
from llmgw.bus import snapshots
from llmgw.control.service import ControlService
from llmgw.core import events, state, subjects
from llmgw.natsd import free_port
from llmgw.pki import signing
from tests.harness import Connector, TestNatsServer, connect_as, wait_for
from tests.integration import agent_kit as kit
from tests.integration.agent_kit import AgentProcess, Control, status
from tests.integration.control_kit import SimAgent, control_config, model, read_log, running

pytestmark = pytest.mark.slow

NODE = "node-s"


async def store(
    admin: Client,
    subject: str,
    event: events.Event,
    signer: signing.Signer | None = None,
    *,
    signed_subject: str | None = None,
) -> int:
    """Store `event` on `subject` as the admin, unsigned or signed by `signer` (for
    `signed_subject`, when given: a genuine signature moved to another subject)."""
    payload = events.encode(event)
    headers = {"Nats-Msg-Id": event.id}
    if signer is not None:
        headers |= signer.event_headers(signed_subject or subject, event.id, payload)
    ack = await admin.jetstream().publish(subject, payload, headers=headers)
    return int(ack.seq)


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "agent-state"
    yield path
    kit.kill_engines(path)


@pytest.fixture
def agents() -> Iterator[list[AgentProcess]]:
    started: list[AgentProcess] = []
    yield started
    for agent in started:
        agent.terminate()


async def test_an_agent_obeys_only_commands_a_control_plane_signed(
    nats_server: TestNatsServer,
    connect: Connector,
    tmp_path: Path,
    state_dir: Path,
    agents: list[AgentProcess],
) -> None:
    pki = nats_server.pki
    control = Control(await connect("control", "control-1"))
    await control.provision()
    admin = await connect.admin()
    agent = await kit.start_agent(nats_server, NODE, tmp_path, state_dir, agents)
    await kit.wait_for(admin, NODE, lambda e: isinstance(e, events.NodeRegistered))

    def start(replica: str, port: int) -> events.StartShard:
        return events.StartShard(
            id=f"start-{replica}",
            ts=time.time(),
            epoch=1,
            node=NODE,
            replica_id=replica,
            generation=1,
            launch=kit.sim_spec(port, name=replica),
        )

    ports = [free_port() for _ in range(4)]
    cmd = subjects.command(NODE)
    await store(admin, cmd, start("forged-unsigned", ports[0]))
    await store(admin, cmd, start("forged-by-node", ports[1]), pki.signer("node", NODE))
    await store(admin, cmd, start("forged-by-operator", ports[2]), pki.signer("operator", "eve"))
    await store(
        admin,
        cmd,
        start("forged-moved", ports[3]),
        pki.signer("control", "control-1"),
        signed_subject=subjects.command("node-other"),
    )
    # Then a genuine command: once it is served, everything before it was dealt with.
    port = free_port()
    await control.start(NODE, "genuine", kit.sim_spec(port, name="genuine"))
    await kit.wait_for(admin, NODE, status("genuine", "serving"), what="genuine serving")

    records = await kit.node_records(admin, NODE)
    touched = {e.replica_id for e in kit.without_heartbeats(records) if hasattr(e, "replica_id")}
    assert touched == {"genuine"}
    refused = agent.log_tail(400).count("bus.signature_refused")
    assert refused == 4, agent.log_tail(60)


async def test_a_control_plane_never_folds_what_its_owner_did_not_sign(
    nats_server: TestNatsServer, connect: Connector
) -> None:
    pki = nats_server.pki
    cfg = control_config(nats_server, "control-a", models=(model("m1", replicas=1),))
    agents: list[SimAgent] = []
    async with running(ControlService(cfg)) as svc:
        agents.append(await SimAgent(nats_server, "node-a", gpus=1).start())
        await wait_for(
            lambda: any(r.id in svc.state.endpoints for r in svc.state.active_replicas("m1")),
            15,
            "m1 serving",
        )
        replica = svc.state.active_replicas("m1")[0].id
        digest = state.digest(svc.state)
        admin = await connect.admin()
        forged = [
            # Unsigned, on the control plane's own subject (the fence counts it).
            await store(
                admin,
                subjects.control_event("replica_retired"),
                events.ReplicaRetired(id="f1", ts=time.time(), replica_id=replica),
            ),
            # Signed by a node, on an operator subject.
            await store(
                admin,
                subjects.operator_event("eve", "node_cordoned"),
                events.NodeCordoned(id="f2", ts=time.time(), operator="eve", node="node-a"),
                pki.signer("node", "node-a"),
            ),
            # Signed by an operator, on another node's subject.
            await store(
                admin,
                subjects.node_event("node-a", "heartbeat"),
                events.Heartbeat(id="f3", ts=time.time(), node="node-a", seq=10**6),
                pki.signer("operator", "eve"),
            ),
        ]
        await wait_for(
            lambda: svc._reader is not None and svc._reader.refused == 3,
            10,
            "three refusals",
            detail=lambda: repr(svc._reader.skipped if svc._reader else None),
        )
        assert [s.seq for s in svc._reader.skipped][-3:] == forged  # type: ignore[union-attr]
        assert state.digest(svc.state) == digest
        assert svc.state.nodes["node-a"].cordoned is False
        # The leader goes on deciding past the forged message on its fenced subjects.
        alice = await connect_as(nats_server, "operator", "alice")
        await bus.Publisher(alice.jetstream()).publish(
            events.ModelChanged(
                id="grow", ts=time.time(), operator="alice", profile=model("m1", replicas=2)
            )
        )
        agents.append(await SimAgent(nats_server, "node-b", gpus=1).start())
        await wait_for(
            lambda: (
                sum(1 for r in svc.state.active_replicas("m1") if r.id in svc.state.endpoints) == 2
            ),
            15,
            "the second replica serving",
        )
        assert svc.leading
        await alice.close()
    for agent in agents:
        await agent.close()


async def test_a_forged_lease_neither_makes_a_leader_nor_keeps_one_from_leading(
    nats_server: TestNatsServer, connect: Connector
) -> None:
    pki = nats_server.pki
    control = await connect("control", "control-a")
    await bus.provision(control.jetstream())
    admin = await connect.admin()
    kv = await admin.jetstream().key_value(bus.LEASE_BUCKET)
    # A value naming a holder, unsigned, stored with no TTL: before signing, nobody could
    # have led again until someone deleted it.
    await kv.put("leader", msgspec.json.encode({"holder": "control-z", "epoch": 0}))
    contender = await bus.Lease.open(control.jetstream(), "control-a", ttl_s=2)
    assert await contender.holder() is None
    # Signed, but by a node, claiming control-b.
    node = pki.signer("node", "node-a")
    until = time.time() + 60
    forged = {
        "holder": "control-b",
        "epoch": 0,
        "until": until,
        "sig": node.sign(signing.lease_message("control-b", 0, until)),
        "cert": node.cert_b64,
    }
    await kv.put("leader", msgspec.json.encode(forged))
    assert await contender.holder() is None

    cfg = control_config(nats_server, "control-a", models=())
    async with running(ControlService(cfg)) as svc:
        await wait_for(lambda: svc.leading, 10, "control-a leading despite the forged lease")
        holder = await contender.holder()
        assert holder is not None
        assert holder.holder == "control-a"


async def test_a_genuine_lease_value_stored_again_after_it_ran_out_counts_as_free(
    nats_server: TestNatsServer, connect: Connector
) -> None:
    """Anyone able to write the bucket could store an old signed value again: once its
    `until` and one TTL more have passed it holds nothing, and a contender takes over."""
    control = await connect("control", "control-b")
    await bus.provision(control.jetstream())
    admin = await connect.admin()
    kv = await admin.jetstream().key_value(bus.LEASE_BUCKET)
    ttl = 2.0
    old = lease_module.signed_value(
        nats_server.pki.signer("control", "control-a"), "control-a", 7, time.time() - 3 * ttl
    )
    await kv.put("leader", old)
    contender = await bus.Lease.open(control.jetstream(), "control-b", ttl_s=ttl)
    assert await contender.holder() is None
    assert await contender.acquire()


async def test_two_contenders_taking_over_a_forged_lease_at_once_make_one_leader(
    nats_server: TestNatsServer, connect: Connector
) -> None:
    """Both read the same unsigned value and replace it: each write expects that value's
    revision, so the server stores one of them and the other contender does not lead."""
    a = await connect("control", "control-a")
    b = await connect("control", "control-b")
    await bus.provision(a.jetstream())
    admin = await connect.admin()
    kv = await admin.jetstream().key_value(bus.LEASE_BUCKET)
    await kv.put("leader", msgspec.json.encode({"holder": "control-z", "epoch": 0}))
    first = await bus.Lease.open(a.jetstream(), "control-a", ttl_s=30)
    second = await bus.Lease.open(b.jetstream(), "control-b", ttl_s=30)
    won = await asyncio.gather(first.acquire(), second.acquire())
    assert sorted(won) == [False, True]
    holder = await first.holder()
    assert holder is not None
    assert holder.holder == ("control-a" if won[0] else "control-b")


async def test_a_forged_snapshot_is_passed_over_for_the_log(
    nats_server: TestNatsServer, connect: Connector
) -> None:
    pki = nats_server.pki
    cfg = control_config(nats_server, "control-a", models=(model("m1", replicas=1),))
    agents: list[SimAgent] = []
    async with running(ControlService(cfg)) as first:
        agents.append(await SimAgent(nats_server, "node-a", gpus=1).start())
        await wait_for(lambda: first.leading and first.state.last_seq > 3, 10, "some history")
        saved = await first.snapshot_now()
        for agent in agents:
            agent.beating = False
    admin = await connect.admin()
    store_ = await admin.jetstream().object_store(bus.SNAPSHOT_BUCKET)
    genuine = await store_.get(snapshots.object_name(saved))
    empty = state.encode_snapshot(state.ClusterState())
    # Newer than the genuine one: unsigned, sealed by a node, and the genuine seal moved.
    await store_.put(snapshots.object_name(saved + 1), empty)
    await store_.put(
        snapshots.object_name(saved + 2),
        snapshots.seal(pki.signer("node", "node-a"), saved + 2, empty),
    )
    await store_.put(snapshots.object_name(saved + 3), bytes(genuine.data or b""))

    cfg_b = control_config(nats_server, "control-b", models=(model("m1", replicas=1),))
    async with running(ControlService(cfg_b)) as second:
        await wait_for(lambda: second.caught_up.is_set(), 10, "caught up")
        assert second.snapshot_seq == saved
    # Stopped, so that its state is the fold of a known prefix of the log (leading, it went
    # on deciding while a reading of the log was under way).
    folded = second.state.last_seq
    nc = await connect_as(nats_server, "router", "r1")
    log = await read_log(nc)
    assert log[-1].seq >= folded
    scratch, _ = state.fold_records([(r.seq, r.event) for r in log if r.seq <= folded])
    assert state.digest(second.state) == state.digest(scratch)
    await bus.close(nc)
    for agent in agents:
        await agent.close()


async def test_an_agent_takes_the_lease_epoch_only_from_a_signed_lease(
    nats_server: TestNatsServer,
    connect: Connector,
    tmp_path: Path,
    state_dir: Path,
    agents: list[AgentProcess],
) -> None:
    control = Control(await connect("control", "control-1"))
    await control.provision()  # a signed lease at Control.LEASE_EPOCH
    lease = Control.LEASE_EPOCH
    admin = await connect.admin()
    agent = await kit.start_agent(nats_server, NODE, tmp_path, state_dir, agents)
    await kit.wait_for(admin, NODE, lambda e: isinstance(e, events.NodeRegistered))
    await control.stop(NODE, "marker-1", epoch=lease)
    await kit.wait_for(admin, NODE, status("marker-1", "stopped"), what="marker-1")

    # An unsigned lease showing a higher epoch: the agent does not take it as a leader's.
    kv = await admin.jetstream().key_value(bus.LEASE_BUCKET)
    await kv.put("leader", msgspec.json.encode({"holder": "control-1", "epoch": lease + 500}))
    await control.stop(NODE, "marker-2", epoch=lease + 500)
    await control.stop(NODE, "marker-3", epoch=lease)
    await kit.wait_for(admin, NODE, status("marker-3", "stopped"), what="marker-3")
    evs = kit.without_heartbeats(await kit.node_records(admin, NODE))
    assert not [e for e in evs if getattr(e, "replica_id", "") == "marker-2"]
    log = agent.log_tail(400)
    assert "lease_refused" in log, log
    assert f"from leader epoch {lease + 500}, beyond the leader lease" in log


async def test_a_freshly_acquired_lease_shows_its_own_sequence_as_its_epoch(
    nats_server: TestNatsServer,
    connect: Connector,
    tmp_path: Path,
    state_dir: Path,
    agents: list[AgentProcess],
) -> None:
    """The acquiring write carries epoch 0: its epoch is its sequence in the lease stream.
    Read as 0, every command would be "beyond the lease" and the node would obey no leader
    until the first renewal."""
    control = Control(await connect("control", "control-1"))
    await bus.provision(control.js)
    await control.hold_lease(0)  # just acquired: no renewal yet
    admin = await connect.admin()
    await kit.start_agent(nats_server, NODE, tmp_path, state_dir, agents)
    await kit.wait_for(admin, NODE, lambda e: isinstance(e, events.NodeRegistered))
    await control.stop(NODE, "fresh", epoch=1)  # the acquisition's sequence is at least 1
    await kit.wait_for(admin, NODE, status("fresh", "stopped"), what="fresh")

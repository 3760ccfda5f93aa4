"""The control plane against a real nats-server: fold, lead, place, replay, verify.

Simulated agents (tests/integration/control_kit.py) publish as node identities
and answer commands; the control plane runs in-process (ControlService), with
short timings. Determinism (docs/design.md, invariant 3) is checked on the real log:
folding from scratch and from a snapshot give the leader's digest, and every
recorded decision batch is reproduced by re-running the reconciler.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from structlog.testing import capture_logs

from llmgw import bus
from llmgw.control import verify
from llmgw.control.config import AdminListener, SnapshotConfig
from llmgw.control.service import ControlService
from llmgw.core import events, state
from tests.harness import Connector, TestNatsServer, connect_as, wait_for
from tests.integration.control_kit import FAST, SimAgent, control_config, model, read_log, running


def serving(svc: ControlService, name: str) -> int:
    return sum(1 for r in svc.state.active_replicas(name) if r.id in svc.state.endpoints)


async def settle(svc: ControlService, nc: bus.BusClient) -> list[bus.Record]:
    """Wait until the service has folded the whole log; the log."""
    log: list[bus.Record] = []

    async def folded_all() -> bool:
        nonlocal log
        log = await read_log(nc)
        return bool(log) and svc.state.last_seq == log[-1].seq

    await wait_for(folded_all, 10, "the service folding the whole log", every_s=0.3)
    return log


async def test_a_scenario_replays_to_the_same_digest_and_the_same_decisions(
    nats_server: TestNatsServer,
) -> None:
    cfg = control_config(nats_server, "control-a", models=(model("m1", replicas=2),))
    agents: list[SimAgent] = []
    try:
        async with running(ControlService(cfg)) as svc:
            agents += [await SimAgent(nats_server, n, gpus=2).start() for n in ("node-a", "node-b")]
            await wait_for(lambda: svc.leading, 10, "control-a leading")
            await wait_for(lambda: serving(svc, "m1") == 2, 15, "two replicas of m1 serving")
            snap_seq = await svc.snapshot_now()
            # More history after the snapshot: a third replica, placed and serving.
            operator = await connect_as(nats_server, "operator", "alice")
            await bus.Publisher(operator.jetstream()).publish(
                events.ModelChanged(
                    id="op-1", ts=time.time(), operator="alice", profile=model("m1", replicas=3)
                )
            )
            await wait_for(lambda: serving(svc, "m1") == 3, 15, "three replicas of m1 serving")
            for agent in agents:
                agent.beating = False
            log = await settle(svc, operator)
            leader_digest = state.digest(svc.state)
            await operator.close()
        records = [(r.seq, r.event) for r in log]
        scratch, rejected = state.fold_records(records)
        assert state.digest(scratch) == leader_digest
        assert rejected == []
        store = await bus.SnapshotStore.open(
            (await connect_as(nats_server, "router", "r1")).jetstream()
        )
        snap = await store.load()
        assert snap is not None
        assert snap.seq == snap_seq
        assert verify.digests_agree(records, (snap.seq, snap.data)) == []
        # Every recorded decision batch comes back identical from the log alone.
        assert verify.verify(records, config=FAST) == []
        placed = [e for _, e in records if isinstance(e, events.ReplicaPlaced)]
        assert len(placed) == 3
        assert any(isinstance(e, events.LeaderElected) for _, e in records)
        declared = [e for _, e in records if isinstance(e, events.ModelDeclared)]
        assert [(d.operator, d.profile.name) for d in declared] == [("control-a", "m1")]
    finally:
        for agent in agents:
            await agent.close()


def holder(svc: ControlService, name: str) -> str:
    (replica,) = svc.state.active_replicas(name)
    return replica.shards[0].node


async def test_heartbeats_stop_unreachable_lost_replaced_then_recovered(
    nats_server: TestNatsServer,
) -> None:
    cfg = control_config(nats_server, "control-a", models=(model("m1", replicas=1),))
    agents: dict[str, SimAgent] = {}
    try:
        async with running(ControlService(cfg)) as svc:
            for n in ("node-a", "node-b"):
                agents[n] = await SimAgent(nats_server, n, gpus=1).start()
            await wait_for(lambda: serving(svc, "m1") == 1, 15, "m1 serving")
            first = holder(svc, "m1")
            other = "node-b" if first == "node-a" else "node-a"
            agents[first].beating = False
            node = svc.state.nodes[first]
            t_unreachable = await wait_for(
                lambda: node.liveness == "unreachable", 6, f"{first} unreachable"
            )
            t_lost = await wait_for(lambda: node.liveness == "lost", 8, f"{first} lost")
            assert t_lost >= 1.0  # lost_after (4 s) counts from the last heartbeat, not from now
            await wait_for(
                lambda: serving(svc, "m1") == 1 and holder(svc, "m1") == other,
                10,
                f"m1 replaced on {other}",
            )
            (replacement,) = svc.state.active_replicas("m1")
            assert replacement.replaces  # names the replica of the lost node
            agents[first].beating = True
            await wait_for(lambda: node.liveness == "ready", 5, f"{first} recovered")
            nc = await connect_as(nats_server, "router", "r1")
            log = await settle(svc, nc)
            await bus.close(nc)
        kinds = [
            type(r.event).__name__ for r in log if r.subject.startswith("llmgw.events.control")
        ]
        order = [k for k in kinds if k in ("NodeUnreachable", "NodeLost", "NodeRecovered")]
        assert order == ["NodeUnreachable", "NodeLost", "NodeRecovered"]
        assert t_unreachable < 6
    finally:
        for agent in agents.values():
            await agent.close()


async def test_rolling_drain_stops_the_original_only_after_its_replacement_serves(
    nats_server: TestNatsServer,
) -> None:
    cfg = control_config(nats_server, "control-a", models=(model("m1", replicas=1),))
    agents: dict[str, SimAgent] = {}
    try:
        async with running(ControlService(cfg)) as svc:
            agents["node-a"] = await SimAgent(nats_server, "node-a", gpus=1).start()
            await wait_for(lambda: serving(svc, "m1") == 1, 15, "m1 serving on node-a")
            (original,) = svc.state.active_replicas("m1")
            # A slow replacement: serving only 1.5 s after loading.
            agents["node-b"] = await SimAgent(
                nats_server, "node-b", gpus=1, serve_after_s=1.5
            ).start()
            await wait_for(lambda: "node-b" in svc.state.nodes, 5, "node-b registered")
            operator = await connect_as(nats_server, "operator", "alice")
            await bus.Publisher(operator.jetstream()).publish(
                events.NodeDrainRequested(
                    id="drain-1", ts=time.time(), operator="alice", node="node-a", grace_s=60
                )
            )
            await wait_for(
                lambda: original.id not in svc.state.replicas, 15, "the original stopped and freed"
            )
            assert serving(svc, "m1") == 1
            assert holder(svc, "m1") == "node-b"
            log = await settle(svc, operator)
            await operator.close()
        replacement = next(
            r.event
            for r in log
            if isinstance(r.event, events.ReplicaPlaced) and r.event.replaces == original.id
        )
        serves = next(
            r.seq
            for r in log
            if isinstance(r.event, events.ShardStatus)
            and r.event.replica_id == replacement.replica_id
            and r.event.phase == "serving"
        )
        for r in log:
            moves = events.DrainShard | events.StopShard | events.ReplicaRetired
            if isinstance(r.event, moves) and r.event.replica_id == original.id:
                assert r.seq > serves, f"{type(r.event).__name__} of the original came first"
        assert any(
            isinstance(r.event, events.DrainShard) and r.event.replica_id == original.id
            for r in log
        )
    finally:
        for agent in agents.values():
            await agent.close()


async def test_draining_the_only_capable_node_ends_with_the_grace_period(
    nats_server: TestNatsServer,
) -> None:
    cfg = control_config(nats_server, "control-a", models=(model("m1", replicas=1),))
    agents: list[SimAgent] = []
    try:
        async with running(ControlService(cfg)) as svc:
            agents.append(await SimAgent(nats_server, "node-a", gpus=1).start())
            await wait_for(lambda: serving(svc, "m1") == 1, 15, "m1 serving on node-a")
            (original,) = svc.state.active_replicas("m1")
            operator = await connect_as(nats_server, "operator", "alice")
            requested = time.monotonic()
            await bus.Publisher(operator.jetstream()).publish(
                events.NodeDrainRequested(
                    id="drain-1", ts=time.time(), operator="alice", node="node-a", grace_s=2
                )
            )
            await wait_for(lambda: original.id not in svc.state.replicas, 10, "original freed")
            assert time.monotonic() - requested >= 1.5, "stopped before the grace period ended"
            await operator.close()
            assert svc.unplaceable.get("m1"), "nowhere else to go: m1 is unplaceable"
    finally:
        for agent in agents:
            await agent.close()


async def test_restarting_with_the_same_models_writes_nothing_and_a_changed_file_the_diff(
    nats_server: TestNatsServer,
) -> None:
    m1, m2 = model("m1", replicas=0), model("m2", replicas=0)
    operator = None
    try:
        async with running(
            ControlService(control_config(nats_server, "control-a", models=(m1, m2)))
        ) as svc:
            await wait_for(lambda: set(svc.state.models) == {"m1", "m2"}, 10, "models declared")
            operator = await connect_as(nats_server, "operator", "alice")
            # An operator's own model: a config file never removes it.
            await bus.Publisher(operator.jetstream()).publish(
                events.ModelDeclared(
                    id="op-m3", ts=time.time(), operator="alice", profile=model("m3", replicas=0)
                )
            )
            await wait_for(lambda: "m3" in svc.state.models, 5, "m3 declared")
        assert operator is not None
        before = len(await read_log(operator))
        async with running(
            ControlService(control_config(nats_server, "control-a", models=(m1, m2)))
        ) as svc:
            await wait_for(
                lambda: (
                    svc.leading and svc.state.leader == "control-a" and svc.state.epoch == svc.epoch
                ),
                10,
                "leading again",
            )
            await wait_for(lambda: svc._models_synced_epoch == svc.epoch, 5, "models compared")
        after = await read_log(operator)
        written = [type(r.event).__name__ for r in after[before:]]
        assert written == ["LeaderElected"], written
        changed = model("m1", replicas=0, aliases=("one",))
        async with running(
            ControlService(control_config(nats_server, "control-b", models=(changed,)))
        ) as svc:
            await wait_for(
                lambda: (
                    "m2" not in svc.state.models
                    and "m1" in svc.state.models
                    and svc.state.models["m1"].profile == changed
                ),
                10,
                "the diff applied",
            )
            assert "m3" in svc.state.models
        tail = [r.event for r in (await read_log(operator))[len(after) :]]
        assert [type(e).__name__ for e in tail if isinstance(e, events.OperatorEvent)] == [
            "ModelRemoved",
            "ModelChanged",
        ]
    finally:
        if operator is not None:
            await operator.close()


async def test_hostile_events_are_rejected_counted_and_do_not_stop_the_fold(
    nats_server: TestNatsServer, connect: Connector
) -> None:
    cfg = control_config(nats_server, "control-a", models=(model("m1", replicas=2),))
    agents: list[SimAgent] = []
    async with running(ControlService(cfg)) as svc:
        agents.append(await SimAgent(nats_server, "node-a", gpus=1).start())
        await wait_for(lambda: serving(svc, "m1") == 1, 15, "m1 serving once (one GPU)")
        digest = state.digest(svc.state)
        admin = await connect.admin()
        rogue = await connect_as(nats_server, "node", "node-z")
        pub = bus.Publisher(rogue.jetstream())
        # Garbage bytes (also on a control subject, which the fence counts), a shard status
        # for a replica never placed, a heartbeat of a node that never registered.
        await admin.jetstream().publish("llmgw.events.node.node-z.registered", b"\xff not json")
        await admin.jetstream().publish("llmgw.events.control.replica_placed", b"{}")
        await pub.publish(
            events.ShardStatus(
                id="h1",
                ts=time.time(),
                node="node-z",
                replica_id="nope",
                generation=1,
                phase="serving",
            )
        )
        await pub.publish(events.Heartbeat(id="h2", ts=time.time(), node="node-z", seq=1))
        await wait_for(
            lambda: svc.rejected == 2 and svc._reader is not None and svc._reader.undecodable == 2,
            5,
            "rejections counted",
        )
        assert state.digest(svc.state) == digest
        # The fold and the leader go on: a new node gets the second replica.
        agents.append(await SimAgent(nats_server, "node-b", gpus=1).start())
        await wait_for(lambda: serving(svc, "m1") == 2, 10, "the second replica serving")
        assert svc.leading
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{svc.admin_url}/metrics") as resp,
        ):
            text = await resp.text()
        assert "llmgw_control_events_rejected_total 2.0" in text
        assert "llmgw_control_events_undecodable_total 2.0" in text
        assert "llmgw_control_fence_refused_total 0.0" in text
        await rogue.close()
    for agent in agents:
        await agent.close()


async def test_the_admin_api_shows_nodes_replicas_models_explain_state_and_metrics(
    nats_server: TestNatsServer,
) -> None:
    cfg = control_config(
        nats_server,
        "control-a",
        models=(model("m1", replicas=1), model("big", replicas=1, tensor_parallel=4)),
    )
    agents: list[SimAgent] = []
    async with running(ControlService(cfg)) as svc:
        agents.append(await SimAgent(nats_server, "node-a", gpus=2).start())
        await wait_for(lambda: serving(svc, "m1") == 1, 15, "m1 serving")
        async with aiohttp.ClientSession() as http:

            async def get(path: str) -> Any:
                async with http.get(svc.admin_url + path) as resp:
                    return resp.status, await resp.json(
                        content_type=None
                    ) if path != "/metrics" else await resp.text()

            status, nodes = await get("/v1/nodes")
            assert status == 200
            assert nodes[0]["name"] == "node-a"
            assert nodes[0]["liveness"] == "ready"
            assert [g["replica"] is not None for g in nodes[0]["gpus"]].count(True) == 1
            _, replicas = await get("/v1/replicas")
            assert replicas[0]["shards"][0]["phase"] == "serving"
            assert replicas[0]["endpoint"].startswith("http://127.0.0.1:")
            _, models = await get("/v1/models")
            by_name = {m["name"]: m for m in models}
            assert by_name["m1"]["replicas_serving"] == 1
            assert "4" in by_name["big"]["unplaceable"]
            status, explained = await get("/v1/explain/big")
            assert status == 200
            # A 4-GPU shard on a 2-GPU node: impossible, and said so (not "1 of 4 free").
            assert "never fits this fleet" in explained["text"]
            assert "too small: has 2" in explained["text"]
            status, _ = await get("/v1/explain/nope")
            assert status == 404
            _, st = await get("/v1/state")
            assert st["leading"] is True
            assert st["digest"] == state.digest(svc.state)
            assert st["epoch"] == svc.epoch
            status, _ = await get("/health")
            assert status == 200
            _, metrics = await get("/metrics")
            assert "llmgw_control_leader 1.0" in metrics
            assert 'llmgw_control_decisions_total{kind="control.replica_placed"} 1.0' in metrics
            assert (
                'llmgw_control_placement_failures_total{model="big",reason="never fits"}' in metrics
            )
            # The fleet's state, read from the same fold at the scrape.
            for line in (
                'llmgw_fleet_nodes{liveness="ready"} 1.0',
                'llmgw_fleet_node_liveness{liveness="ready",node="node-a"} 1.0',
                'llmgw_fleet_model_replicas_desired{model="m1"} 1.0',
                'llmgw_fleet_model_replicas_serving{model="m1"} 1.0',
                'llmgw_fleet_model_replicas_serving{model="big"} 0.0',
                'llmgw_fleet_replicas{model="m1",phase="serving"} 1.0',
                'llmgw_fleet_model_unplaceable{model="big",reason="never fits"} 1.0',
            ):
                assert line in metrics, line
            assert 'llmgw_fleet_gpus{gpu_class="' in metrics
            # Latencies as histograms: every reconcile pass, and m1's one placement (placed,
            # then serving within the test's 15 s).
            passes = _sample(metrics, "llmgw_control_reconcile_duration_seconds_count")
            assert passes >= 1
            assert (
                _sample(metrics, 'llmgw_control_reconcile_duration_seconds_bucket{le="+Inf"}')
                == passes
            )
            assert _sample(metrics, "llmgw_control_placement_seconds_count") == 1
            assert 0 < _sample(metrics, "llmgw_control_placement_seconds_sum") < 15
            status, groups = await get("/v1/sd/prometheus")
            assert status == 200
            engines = [g for g in groups if g["labels"]["job"] == "llmgw-engine"]
            assert [g["labels"]["model"] for g in engines] == ["m1"]
            assert engines[0]["targets"] == [replicas[0]["endpoint"].partition("://")[2]]
            assert groups[-1]["targets"] == [svc.admin_url.partition("://")[2]]
    for agent in agents:
        await agent.close()


@pytest.mark.parametrize(
    "cadence",
    [SnapshotConfig(every_events=10, every_s=0), SnapshotConfig(every_events=0, every_s=0.5)],
    ids=["by-count", "by-time"],
)
async def test_a_cold_start_loads_the_newest_snapshot_and_replays_only_the_tail(
    nats_server: TestNatsServer, cadence: SnapshotConfig
) -> None:
    cfg = control_config(
        nats_server, "control-a", models=(model("m1", replicas=2),), snapshot=cadence
    )
    agents: list[SimAgent] = []
    async with running(ControlService(cfg)) as first:
        agents += [await SimAgent(nats_server, n, gpus=1).start() for n in ("node-a", "node-b")]
        await wait_for(lambda: serving(first, "m1") == 2, 15, "m1 serving")
        await wait_for(lambda: first.snapshot_seq > 0, 5, "a snapshot saved")
        for agent in agents:
            agent.beating = False
        nc = await connect_as(nats_server, "router", "r1")
        await settle(first, nc)
        await wait_for(lambda: first.snapshot_seq > 0, 5, "a snapshot saved")
    saved = first.snapshot_seq
    async with running(
        ControlService(control_config(nats_server, "control-b", models=(model("m1", replicas=2),)))
    ) as second:
        await wait_for(lambda: second.caught_up.is_set(), 10, "caught up")
        assert second.snapshot_seq == saved  # loaded, not folded from 0
        # The placements it replayed are history: not timed again at each restart.
        assert (
            _sample(second.metrics.render().decode(), "llmgw_control_placement_seconds_count") == 0
        )
        log = await settle(second, nc)
        scratch, _ = state.fold_records([(r.seq, r.event) for r in log])
        assert state.digest(second.state) == state.digest(scratch)
    await bus.close(nc)
    for agent in agents:
        await agent.close()


async def test_the_admin_api_over_https_admits_operator_certificates_only(
    nats_server: TestNatsServer,
) -> None:
    pki = nats_server.pki
    listener = AdminListener(
        host="127.0.0.1",
        port=0,
        cert_file=str(pki.certs.server_cert),
        key_file=str(pki.certs.server_key),
        ca_file=str(pki.certs.ca_cert),
    )
    cfg = control_config(nats_server, "control-a", admin=listener)
    operator_tls = pki.client_tls("operator", "alice")
    router_tls = pki.client_tls("router", "r1")
    async with running(ControlService(cfg)) as svc, aiohttp.ClientSession() as http:
        assert svc.admin_url.startswith("https://")
        async with http.get(f"{svc.admin_url}/v1/state", ssl=operator_tls) as resp:
            assert resp.status == 200
            assert (await resp.json())["instance"] == "control-a"
        async with http.get(f"{svc.admin_url}/v1/state", ssl=router_tls) as resp:
            assert resp.status == 403
            assert "operator" in (await resp.json())["error"]
        with pytest.raises(aiohttp.ClientError):
            async with http.get(f"{svc.admin_url}/v1/state", ssl=pki.anonymous_tls()) as resp:
                await resp.read()


async def test_a_refused_decision_of_its_own_epoch_paces_the_leader(
    nats_server: TestNatsServer,
) -> None:
    cfg = control_config(nats_server, "control-a", models=(model("m1", replicas=1),))
    agents: list[SimAgent] = []
    with capture_logs() as logged:
        async with running(ControlService(cfg)) as svc:
            await wait_for(lambda: svc.state.epoch == svc.epoch > 0, 10, "leading")
            # A decision with the leader's epoch that the fold refuses (no such replica),
            # as a buggy reconciler would make it.
            rival = await connect_as(nats_server, "control", "control-x")
            await bus.Publisher(rival.jetstream()).publish(
                events.ReplicaRetired(id="bad", ts=time.time(), replica_id="nope", epoch=svc.epoch)
            )
            await rival.close()
            await wait_for(lambda: svc.rejected == 1, 5, "the decision refused")
            # It goes on deciding, paced: a node arrives and gets the replica.
            agents.append(await SimAgent(nats_server, "node-a", gpus=1).start())
            await wait_for(lambda: serving(svc, "m1") == 1, 15, "m1 serving")
    for agent in agents:
        await agent.close()
    assert any(e["event"] == "own_decisions_rejected" for e in logged)


async def test_the_control_plane_survives_a_nats_server_restart(
    nats_server: TestNatsServer,
) -> None:
    cfg = control_config(nats_server, "control-a", models=(model("m1", replicas=1),))
    agents: list[SimAgent] = []
    async with running(ControlService(cfg)) as svc:
        await wait_for(lambda: svc.state.epoch == svc.epoch > 0, 10, "leading")
        nats_server.stop()
        await asyncio.sleep(1.0)
        nats_server.start()
        # Same port and store: it reconnects, re-reads from where it was, leads, places.
        agents.append(await SimAgent(nats_server, "node-a", gpus=1).start())
        await wait_for(lambda: serving(svc, "m1") == 1, 20, "m1 serving after the restart")
        assert svc.leading
    for agent in agents:
        await agent.close()


def _sample(text: str, name: str) -> float:
    """The value of the sample `name` (with its labels, if any) in a /metrics page."""
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == name:
            return float(value)
    raise AssertionError(f"no sample {name} in /metrics")

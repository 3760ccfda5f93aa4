"""The fold: every event type, hostile and inconsistent events, digest and snapshots."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core import events, state
from llmgw.core.state import ClusterState
from llmgw.core.tenancy import KeySettings

from .scenarios import Sim, fabric, profile, registered
from .strategies import any_event


def placed_sim() -> Sim:
    """Two ready nodes, one model, one serving replica on node a (GPUs 0-3)."""
    sim = Sim()
    sim.register("a", fabrics=[fabric("ib-a")])
    sim.register("b", fabrics=[fabric("ib-a")])
    sim.declare(profile("llama", tensor_parallel=4))
    sim.settle()
    assert sim.rejected == []
    return sim


def the_replica(sim: Sim) -> state.ReplicaState:
    (replica,) = sim.state.replicas.values()
    return replica


def _placed(model: str, *shards: events.ShardAssignment, fabric: str = "") -> events.ReplicaPlaced:
    """A new replica `r-new` of `model` on `shards`, as a hostile or buggy writer sends it."""
    return events.ReplicaPlaced(
        id="x", ts=5.0, epoch=1, replica_id="r-new", model=model, shards=shards, fabric=fabric
    )


def test_registration_builds_a_ready_node_with_its_inventory() -> None:
    sim = Sim()
    assert sim.register("a", fabrics=[fabric("ib-a")], unhealthy=[5]) is None
    node = sim.state.nodes["a"]
    assert node.liveness == "ready"
    assert sorted(node.gpus) == list(range(8))
    assert node.gpus[5].health_problems == ("uncorrected ECC errors (2)",)
    assert node.fabrics[0].hcas == ("mlx5_0", "mlx5_1")


def test_a_replica_goes_through_its_phases_and_holds_its_gpus() -> None:
    sim = placed_sim()
    replica = the_replica(sim)
    assert [s.phase for s in replica.shards] == ["serving"]
    node = sim.state.nodes[replica.shards[0].node]
    assert {g: node.holders[g] for g in replica.shards[0].gpus} == dict.fromkeys(
        replica.shards[0].gpus, replica.id
    )
    assert replica.id in sim.state.endpoints


# --------------------------------------------------------------------------- hostile events

Hostile = Callable[[Sim], events.Event]


def _status(node: str, rid: str, gen: int, shard: int, phase: str) -> events.ShardStatus:
    return events.ShardStatus(
        id="x",
        ts=5.0,
        node=node,
        replica_id=rid,
        generation=gen,
        shard=shard,
        phase=phase,  # type: ignore[arg-type]
    )


def _other_node(sim: Sim) -> str:
    return "b" if the_replica(sim).shards[0].node == "a" else "a"


HOSTILE: list[tuple[str, Hostile, str]] = [
    (
        "shard status for a replica never placed",
        lambda sim: _status("a", "ghost", 1, 0, "serving"),
        "status for shard 0 of replica 'ghost' (generation 1), which was never placed",
    ),
    (
        "phases out of order",
        lambda sim: _status(the_replica(sim).shards[0].node, the_replica(sim).id, 1, 0, "loading"),
        "phase loading after serving is out of order",
    ),
    (
        "a node reporting a shard assigned to another node",
        lambda sim: _status(_other_node(sim), the_replica(sim).id, 1, 0, "failed"),
        "which is assigned to node",
    ),
    (
        "a stale generation",
        lambda sim: _status(the_replica(sim).shards[0].node, the_replica(sim).id, 0, 0, "failed"),
        "stale status",
    ),
    (
        "a generation never placed",
        lambda sim: _status(the_replica(sim).shards[0].node, the_replica(sim).id, 7, 0, "failed"),
        "generation 7 was never placed",
    ),
    (
        "a shard the replica does not have",
        lambda sim: _status(the_replica(sim).shards[0].node, the_replica(sim).id, 1, 3, "failed"),
        "has no shard 3",
    ),
    (
        "a heartbeat from an unknown node",
        lambda sim: events.Heartbeat(id="x", ts=5.0, node="intruder", seq=1),
        "heartbeat from node 'intruder', which never registered",
    ),
    (
        "a shard status from an unknown node",
        lambda sim: _status("intruder", the_replica(sim).id, 1, 0, "failed"),
        "never registered",
    ),
    (
        "a node claiming GPUs assigned to another node's replica",
        lambda sim: registered(
            _other_node(sim),
            fabrics=[fabric("ib-a")],
            shards=[
                events.RunningShard(
                    replica_id=the_replica(sim).id,
                    generation=1,
                    shard=0,
                    gpus=the_replica(sim).shards[0].gpus,
                    phase="serving",
                )
            ],
        ),
        "which is assigned to node",
    ),
    (
        "a node claiming, for an unknown process, GPUs held by a replica",
        lambda sim: registered(
            the_replica(sim).shards[0].node,
            fabrics=[fabric("ib-a")],
            shards=[
                events.RunningShard(
                    replica_id="mystery", generation=1, shard=0, gpus=(0,), phase="serving"
                )
            ],
        ),
        "GPU 0 is held by replica",
    ),
    (
        "a node claiming different GPUs for its own shard",
        lambda sim: registered(
            the_replica(sim).shards[0].node,
            fabrics=[fabric("ib-a")],
            shards=[
                events.RunningShard(
                    replica_id=the_replica(sim).id,
                    generation=1,
                    shard=0,
                    gpus=(6, 7),
                    phase="serving",
                )
            ],
        ),
        "claims GPUs [6, 7]",
    ),
    (
        "a registration listing one GPU twice",
        lambda sim: registered(
            "c", gpu_list=registered("c", count=2).gpus + registered("c", count=1).gpus
        ),
        "lists GPU 0 twice",
    ),
    (
        "cordon of an unknown node",
        lambda sim: events.NodeCordoned(id="x", ts=5.0, operator="o", node="zz"),
        "node 'zz' never registered",
    ),
    (
        "drain of an unknown node",
        lambda sim: events.NodeDrainRequested(id="x", ts=5.0, operator="o", node="zz"),
        "node 'zz' never registered",
    ),
    (
        "lost: an unknown node",
        lambda sim: events.NodeLost(id="x", ts=5.0, node="zz", last_heartbeat=1.0),
        "node 'zz' never registered",
    ),
    (
        "a replica placed on GPUs another replica holds",
        lambda sim: _placed(
            "llama",
            events.ShardAssignment(
                shard=0, node=the_replica(sim).shards[0].node, gpus=(0, 1, 2, 3), port=8200
            ),
        ),
        "which is held by replica",
    ),
    (
        "a replica for an undeclared model",
        lambda sim: _placed(
            "nope", events.ShardAssignment(shard=0, node="b", gpus=(4,), port=8200)
        ),
        "which is not declared",
    ),
    (
        "a replica mixing GPU classes",
        lambda sim: _placed(
            "llama",
            events.ShardAssignment(shard=0, node="mixed", gpus=(0,), port=8200),
            events.ShardAssignment(shard=1, node="b", gpus=(7,), port=8200),
            fabric="ib-a",
        ),
        "mixes GPU classes",
    ),
    (
        "a multi-node replica spanning fabrics",
        lambda sim: _placed(
            "llama",
            events.ShardAssignment(shard=0, node="b", gpus=(6,), port=8200),
            events.ShardAssignment(shard=1, node="far", gpus=(0,), port=8200),
            fabric="ib-a",
        ),
        "is not on fabric 'ib-a'",
    ),
    (
        "a GPU that does not exist",
        lambda sim: _placed(
            "llama", events.ShardAssignment(shard=0, node="b", gpus=(42,), port=8200)
        ),
        "has no GPU 42",
    ),
    (
        "a deposed leader's decision",
        lambda sim: events.ReplicaRetired(id="x", ts=5.0, epoch=0, replica_id=the_replica(sim).id),
        "a deposed leader's decision",
    ),
    (
        "a leader epoch that is not newer",
        lambda sim: events.LeaderElected(id="x", ts=5.0, epoch=1, leader="old"),
        "not newer than the current 1",
    ),
    (
        "a change of an undeclared model",
        lambda sim: events.ModelChanged(id="x", ts=5.0, operator="o", profile=profile("nope")),
        "was never declared: declare it first",
    ),
    (
        "an invalid model",
        lambda sim: events.ModelDeclared(
            id="x", ts=5.0, operator="o", profile=profile("q", dtype="fp8", gpu_class="a100-80g")
        ),
        "dtype fp8 needs compute capability 8.9",
    ),
    (
        "an alias shadowing another model",
        lambda sim: events.ModelDeclared(
            id="x", ts=5.0, operator="o", profile=profile("q", aliases=("llama",))
        ),
        "already a name or alias of model 'llama'",
    ),
    (
        "removal of an undeclared model",
        lambda sim: events.ModelRemoved(id="x", ts=5.0, operator="o", name="nope"),
        "is not declared",
    ),
    (
        "a start for a replica that does not exist",
        lambda sim: events.StartShard(
            id="x",
            ts=5.0,
            node="a",
            replica_id="ghost",
            epoch=1,
            generation=1,
            launch=events.LaunchSpec(engine="sim", model="m", served_name="m", port=1, gpus=(0,)),
        ),
        "which does not exist",
    ),
]


@pytest.mark.parametrize(("case", "hostile", "reason"), HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_events_are_refused_with_a_reason_and_change_nothing(
    case: str, hostile: Hostile, reason: str
) -> None:
    sim = placed_sim()
    sim.register("mixed", gpu_class="l40s-45g", fabrics=[fabric("ib-a")])
    sim.register("far", fabrics=[fabric("ib-z")])
    sim.append(events.LeaderElected(id="lead", ts=1.0, epoch=1, leader="c1"))
    sim.settle()
    event = hostile(sim)
    before = state.digest(sim.state)
    snapshot = state.encode_snapshot(sim.state)
    got = sim.append(event)
    assert got is not None, f"{case}: accepted"
    assert reason in got, got
    assert state.digest(sim.state) == before
    after = state.decode_snapshot(state.encode_snapshot(sim.state))
    # Nothing else changed either (volatile part included), apart from the sequence.
    after.last_seq = state.decode_snapshot(snapshot).last_seq
    assert state.encode_snapshot(after) == snapshot


def test_a_placed_shard_holds_both_its_ports_and_no_other_replica_gets_either() -> None:
    sim = placed_sim()
    r = the_replica(sim)
    shard = r.shards[0]
    node = sim.state.nodes[shard.node]
    assert shard.port
    assert {p: node.ports[p] for p in (shard.port, shard.port + 1)} == dict.fromkeys(
        (shard.port, shard.port + 1), r.id
    )
    free = sorted(set(node.gpus) - set(node.holders))[:1]
    clash = events.ShardAssignment(shard=0, node=shard.node, gpus=tuple(free), port=shard.port + 1)
    reason = sim.append(_placed("llama", clash))
    assert reason is not None
    assert f"port {shard.port + 1} of {shard.node!r} is already in use" in reason


def test_two_shards_on_one_node_may_not_share_a_port() -> None:
    sim = placed_sim()
    node = _other_node(sim)
    shards = (
        events.ShardAssignment(shard=0, node=node, gpus=(0,), port=9000),
        events.ShardAssignment(shard=1, node=node, gpus=(1,), port=9000),
    )
    reason = sim.append(_placed("llama", *shards))
    assert reason is not None
    assert f"port 9000 of {node!r} is already in use" in reason
    assert "r-new" not in sim.state.replicas


def test_two_shards_of_one_replica_may_not_share_a_gpu() -> None:
    sim = placed_sim()
    node = _other_node(sim)
    shards = (
        events.ShardAssignment(shard=0, node=node, gpus=(0, 1), port=9000),
        events.ShardAssignment(shard=1, node=node, gpus=(1, 2), port=9010),
    )
    reason = sim.append(_placed("llama", *shards))
    assert reason is not None
    assert f"uses GPU 1 of {node!r} twice" in reason
    assert sim.state.nodes[node].holders == {}


def test_no_replica_is_placed_on_a_gpu_an_unknown_process_still_uses() -> None:
    sim = placed_sim()
    node = _other_node(sim)
    ghost = events.RunningShard(
        replica_id="ghost", generation=1, shard=0, gpus=(5,), phase="serving"
    )
    assert sim.register(node, fabrics=[fabric("ib-a")], shards=[ghost]) is None
    clash = events.ShardAssignment(shard=0, node=node, gpus=(4, 5), port=9000)
    reason = sim.append(_placed("llama", clash))
    assert reason is not None
    assert "which an unknown process ('ghost') still uses" in reason


def test_redelivered_status_is_a_no_op() -> None:
    sim = placed_sim()
    r = the_replica(sim)
    before = state.digest(sim.state)
    assert sim.status(r.shards[0].node, r.id, 1, 0, "serving") is None
    assert state.digest(sim.state) == before
    # A terminal status delivered twice is not refused (nor counted as a second failure).
    sim.status(r.shards[0].node, r.id, 1, 0, "failed", error="engine exited")
    assert r.failures == 1
    assert sim.status(r.shards[0].node, r.id, 1, 0, "failed", error="engine exited") is None
    assert r.failures == 1


def test_a_shard_that_fails_once_asked_to_stop_is_no_failure_of_its_replica() -> None:
    """SIGKILL after the stop's grace reads as failed: the restart it was stopped for must
    not back off longer for it."""
    sim = placed_sim()
    r = the_replica(sim)
    shard = r.shards[0]
    stop = events.StopShard(
        id="stop", ts=sim.now, epoch=sim.epoch, node=shard.node, replica_id=r.id,
        generation=1, shard=0, grace_s=30.0, reason="restarting the replica",
    )  # fmt: skip
    assert sim.append(stop) is None
    assert sim.status(shard.node, r.id, 1, 0, "failed", error="killed") is None
    assert (r.failures, r.failed_ts) == (0, 0.0)


def test_a_redelivered_placement_is_a_no_op() -> None:
    sim = placed_sim()
    placed = next(e for _s, e in sim.records if isinstance(e, events.ReplicaPlaced))
    before = state.digest(sim.state)
    assert sim.append(placed) is None
    assert state.digest(sim.state) == before


def test_an_already_folded_sequence_is_refused() -> None:
    st = ClusterState()
    ev = registered("a")
    assert state.apply(st, ev, 5) is None
    before = state.digest(st)
    assert state.apply(st, registered("a", count=2), 5) == (
        "sequence 5 was already folded (state is at 5)"
    )
    assert state.digest(st) == before


def test_registration_reports_what_still_runs_and_orphans() -> None:
    sim = placed_sim()
    r = the_replica(sim)
    node = r.shards[0].node
    # The agent restarts; its engine died with it, and it finds a process nobody placed.
    sim.register(
        node,
        fabrics=[fabric("ib-a")],
        shards=[
            events.RunningShard(
                replica_id="old-r", generation=3, shard=0, gpus=(7,), phase="serving"
            )
        ],
    )
    assert r.shards[0].phase == "failed"
    assert r.shards[0].error == "not running when its agent registered again"
    # A failure like any other: the restart backs off from it.
    assert (r.failures, r.failed_ts) == (1, sim.now)
    assert [o.replica_id for o in sim.state.nodes[node].orphans] == ["old-r"]


def test_a_registration_claiming_a_generation_never_placed_serves_nothing() -> None:
    """A node (buggy or hostile) that reports the next generation of its replica running
    does not make the log's generation serve: the log placed no such generation, so the
    process is an orphan to stop and the generation the log knows is not running."""
    sim = placed_sim()
    r = the_replica(sim)
    shard = r.shards[0]
    sim.status(shard.node, r.id, 1, 0, "failed", error="engine exited")
    ahead = events.RunningShard(
        replica_id=r.id, generation=2, shard=0, gpus=shard.gpus, phase="serving"
    )
    assert sim.register(shard.node, fabrics=[fabric("ib-a")], shards=[ahead]) is None
    assert r.generation == 1
    assert shard.phase == "failed"
    (orphan,) = sim.state.nodes[shard.node].orphans
    assert (orphan.replica_id, orphan.generation) == (r.id, 2)


def test_a_registration_never_brings_an_ended_generation_back() -> None:
    """The shard failed; its agent then registers saying it serves (a stale report, or a
    lie). The generation stays ended: the reconciler restarts it as the next one."""
    sim = placed_sim()
    r = the_replica(sim)
    shard = r.shards[0]
    sim.status(shard.node, r.id, 1, 0, "failed", error="engine exited")
    again = events.RunningShard(
        replica_id=r.id, generation=1, shard=0, gpus=shard.gpus, phase="serving"
    )
    assert sim.register(shard.node, fabrics=[fabric("ib-a")], shards=[again]) is None
    assert shard.phase == "failed"
    assert shard.error == "engine exited"


@pytest.mark.parametrize("end", ["stopped", "failed"])
def test_a_retired_replicas_shard_that_ends_either_way_frees_its_gpus(end: str) -> None:
    """A stop that ended in SIGKILL reads as failed: the GPUs must come free all the same,
    or no replica is ever placed on them again."""
    sim = placed_sim()
    r = the_replica(sim)
    shard = r.shards[0]
    retire = events.ReplicaRetired(
        id="ret", ts=sim.now, epoch=sim.epoch, replica_id=r.id, reason="surplus"
    )
    assert sim.append(retire) is None
    assert sim.status(shard.node, r.id, 1, 0, end, error="killed") is None
    assert r.id not in sim.state.replicas
    assert sim.state.nodes[shard.node].holders == {}
    assert sim.state.nodes[shard.node].ports == {}
    # Its endpoint (no EndpointDown came) goes with it: none is left without a replica.
    assert r.id not in sim.state.endpoints


def test_a_lost_node_that_registers_again_is_ready_at_once() -> None:
    """Its registration is the agent's word on what runs: the node is ready from that
    record on, with no heartbeat needed after it."""
    sim = placed_sim()
    sim.liveness("b", events.NodeUnreachable)
    sim.liveness("b", events.NodeLost)
    assert sim.state.nodes["b"].liveness == "lost"
    assert sim.register("b", fabrics=[fabric("ib-a")]) is None
    assert sim.state.nodes["b"].liveness == "ready"
    assert sim.state.nodes["b"].liveness_seq == sim.seq


def test_an_ended_generation_takes_no_other_ending() -> None:
    sim = placed_sim()
    r = the_replica(sim)
    node = r.shards[0].node
    assert sim.status(node, r.id, 1, 0, "stopped") is None
    reason = sim.status(node, r.id, 1, 0, "failed", error="late")
    assert reason is not None
    assert "a generation does not restart" in reason
    assert (r.shards[0].phase, r.failures) == ("stopped", 0)


def test_a_shard_may_not_go_back_from_loading_to_starting() -> None:
    sim = placed_sim()
    node = _other_node(sim)
    shard = events.ShardAssignment(shard=0, node=node, gpus=(0, 1), port=9000)
    assert sim.append(_placed("llama", shard)) is None
    assert sim.status(node, "r-new", 1, 0, "loading") is None
    reason = sim.status(node, "r-new", 1, 0, "starting")
    assert reason is not None
    assert "phase starting after loading is out of order" in reason


def test_a_draining_shard_may_not_report_serving_again() -> None:
    sim = placed_sim()
    r = the_replica(sim)
    node = r.shards[0].node
    assert sim.status(node, r.id, 1, 0, "draining") is None
    reason = sim.status(node, r.id, 1, 0, "serving")
    assert reason is not None
    assert "phase serving after draining is out of order" in reason


def _restart_event(sim: Sim, **change: object) -> events.ReplicaPlaced:
    r = the_replica(sim)
    first = next(e for _s, e in sim.records if isinstance(e, events.ReplicaPlaced))
    return msgspec.structs.replace(
        first, id="again", generation=r.generation + 1, reason="restart", **change
    )


def test_a_retired_replica_is_never_restarted() -> None:
    sim = placed_sim()
    r = the_replica(sim)
    retire = events.ReplicaRetired(id="ret", ts=sim.now, epoch=1, replica_id=r.id, reason="x")
    assert sim.append(retire) is None
    reason = sim.append(_restart_event(sim))
    assert reason is not None
    assert "is retired and cannot restart" in reason
    assert r.generation == 1


def test_a_retired_replica_gets_no_endpoint_up() -> None:
    sim = placed_sim()
    r = the_replica(sim)
    down = events.EndpointDown(
        id="down", ts=sim.now, epoch=1, replica_id=r.id, model="llama", url="http://a:1"
    )
    retire = events.ReplicaRetired(id="ret", ts=sim.now, epoch=1, replica_id=r.id, reason="x")
    assert sim.append(down) is None
    assert sim.append(retire) is None
    up = events.EndpointUp(
        id="up", ts=sim.now, epoch=1, replica_id=r.id, model="llama", url="http://a:1"
    )
    reason = sim.append(up)
    assert reason is not None
    assert "which is not active" in reason
    assert r.id not in sim.state.endpoints


def test_a_stop_of_a_started_shard_frees_nothing_until_it_stopped() -> None:
    """Its StartShard was sent, so an engine may be loading there although no status came
    yet: the GPUs stay held until the shard reports it ended."""
    sim = placed_sim()
    node = _other_node(sim)
    shard = events.ShardAssignment(shard=0, node=node, gpus=(0, 1), port=9000)
    assert sim.append(_placed("llama", shard)) is None
    start = events.StartShard(
        id="start", ts=sim.now, epoch=1, node=node, replica_id="r-new", generation=1,
        shard=0, launch=events.LaunchSpec(engine="sim", model="m", served_name="llama",
                                           port=9000, gpus=(0, 1)),
    )  # fmt: skip
    retire = events.ReplicaRetired(id="ret", ts=sim.now, epoch=1, replica_id="r-new", reason="x")
    stop = events.StopShard(
        id="stop", ts=sim.now, epoch=1, node=node, replica_id="r-new", generation=1, shard=0,
        grace_s=30.0, reason="retired",
    )  # fmt: skip
    for ev in (start, retire, stop):
        assert sim.append(ev) is None
    assert sim.state.nodes[node].holders == {0: "r-new", 1: "r-new"}
    assert sim.status(node, "r-new", 1, 0, "stopped") is None
    assert sim.state.nodes[node].holders == {}


def test_a_health_change_naming_an_unknown_gpu_changes_no_gpu() -> None:
    sim = placed_sim()
    before = sim.state.nodes["a"].gpus[0]
    change = events.GpuHealthChanged(
        id="g", ts=9.0, epoch=1, node="a",
        gpus=(events.GpuHealth(index=0, ecc_uncorrected=5), events.GpuHealth(index=99)),
    )  # fmt: skip
    reason = sim.append(change)
    assert reason == "node 'a' has no GPU 99"
    assert sim.state.nodes["a"].gpus[0] == before


def test_a_deposed_leaders_recovery_of_a_node_is_refused() -> None:
    sim = placed_sim()
    sim.append(events.LeaderElected(id="l", ts=sim.now, leader="control-2", epoch=5))
    sim.append(events.NodeUnreachable(id="u", ts=9.0, epoch=5, node="b", last_heartbeat=1.0))
    reason = sim.append(events.NodeRecovered(id="r", ts=9.0, epoch=4, node="b"))
    assert reason is not None
    assert "a deposed leader's decision" in reason
    assert sim.state.nodes["b"].liveness == "unreachable"
    assert sim.append(events.NodeRecovered(id="r2", ts=9.0, epoch=5, node="b")) is None
    assert sim.state.nodes["b"].liveness_seq == sim.seq


def test_a_restart_may_not_move_its_shards() -> None:
    sim = placed_sim()
    r = the_replica(sim)
    moved = events.ShardAssignment(
        shard=0, node=_other_node(sim), gpus=r.shards[0].gpus, port=r.shards[0].port
    )
    reason = sim.append(_restart_event(sim, shards=(moved,)))
    assert reason is not None
    assert "a move is a new replica" in reason
    assert (r.generation, r.shards[0].node) == (1, the_replica(sim).shards[0].node)


def test_a_never_started_shard_on_a_lost_node_leaves_no_orphan_when_retired() -> None:
    """Nothing ran there for it: no StartShard was ever sent. An orphan would keep its
    GPUs from placement until the node registers again."""
    sim = placed_sim()
    node = _other_node(sim)
    shard = events.ShardAssignment(shard=0, node=node, gpus=(0, 1), port=9000)
    assert sim.append(_placed("llama", shard)) is None  # its StartShard never written
    sim.liveness(node, events.NodeUnreachable)
    sim.liveness(node, events.NodeLost)
    retire = events.ReplicaRetired(
        id="ret", ts=sim.now, epoch=sim.epoch, replica_id="r-new", reason="node lost"
    )
    assert sim.append(retire) is None
    assert sim.state.nodes[node].orphans == []
    assert "r-new" not in sim.state.replicas


def test_a_registration_claiming_one_gpu_for_two_replicas_is_refused() -> None:
    sim = placed_sim()
    node = _other_node(sim)
    one = events.RunningShard(replica_id="x", generation=1, shard=0, gpus=(3,), phase="serving")
    two = events.RunningShard(replica_id="y", generation=1, shard=0, gpus=(3,), phase="serving")
    reason = sim.register(node, fabrics=[fabric("ib-a")], shards=[one, two])
    assert reason is not None
    assert "reports GPU 3 in use by both 'x' and 'y'" in reason
    assert sim.state.nodes[node].orphans == []


def test_liveness_comes_from_recorded_control_events() -> None:
    sim = placed_sim()
    sim.append(events.NodeUnreachable(id="u", ts=9.0, node="a", last_heartbeat=1.0))
    assert sim.state.nodes["a"].liveness == "unreachable"
    sim.append(events.NodeLost(id="l", ts=9.0, node="a", last_heartbeat=1.0))
    assert sim.state.nodes["a"].liveness == "lost"
    # What ran on it is taken for dead, with why.
    shard = the_replica(sim).shards[0]
    assert (shard.node, shard.phase, shard.error) == ("a", "failed", "node a lost")
    sim.append(events.NodeRecovered(id="r", ts=9.0, node="a"))
    assert sim.state.nodes["a"].liveness == "ready"
    # A heartbeat alone changes nothing durable.
    before = state.digest(sim.state)
    sim.heartbeat("a", [events.GpuHealth(index=1, ecc_uncorrected=4)])
    assert state.digest(sim.state) == before
    sim.append(
        events.GpuHealthChanged(
            id="g", ts=9.0, node="a", gpus=(events.GpuHealth(index=1, ecc_uncorrected=4),)
        )
    )
    assert not sim.state.nodes["a"].gpus[1].healthy


def test_snapshot_round_trip_and_digest() -> None:
    sim = placed_sim()
    data = state.encode_snapshot(sim.state)
    back = state.decode_snapshot(data)
    assert state.digest(back) == state.digest(sim.state)
    assert back.last_seq == sim.state.last_seq
    assert back.seen == sim.state.seen
    with pytest.raises(ValueError, match="not an llmgw state snapshot"):
        state.decode_snapshot(b"\x00garbage")


def test_digest_ignores_heartbeats_and_insertion_order() -> None:
    sim = placed_sim()
    sim.heartbeats()
    replay, _ = state.fold_records(sim.durable_records())
    assert state.digest(replay) == state.digest(sim.state)
    st = ClusterState()
    st.nodes = dict(reversed(list(replay.nodes.items())))
    st.models, st.replicas, st.endpoints = replay.models, replay.replicas, replay.endpoints
    st.epoch, st.leader = replay.epoch, replay.leader
    assert state.digest(st) == state.digest(replay)


def _rich_state() -> ClusterState:
    """A serving replica, a leader, a quarantined node and a tenant's key: every durable part."""
    sim = placed_sim()
    sim.append(events.LeaderElected(id="l", ts=sim.now, leader="control-1", epoch=sim.epoch + 1))
    st = state.decode_snapshot(state.encode_snapshot(sim.state))
    st.quarantined["c"] = state.Quarantine(node="c", reason="flood", seq=3, ts=1.0)
    st.keys["team-a"] = state.KeyState(settings=KeySettings(name="team-a"), sha256="ab" * 32)
    return st


def _bump_epoch(st: ClusterState) -> None:
    st.epoch += 1


def _other_leader(st: ClusterState) -> None:
    st.leader = "control-2"


def _no_endpoint(st: ClusterState) -> None:
    st.endpoints.clear()


def _no_key(st: ClusterState) -> None:
    st.keys.clear()


def _no_quarantine(st: ClusterState) -> None:
    st.quarantined.clear()


def _next_generation(st: ClusterState) -> None:
    next(iter(st.replicas.values())).generation += 1


def _model_revised(st: ClusterState) -> None:
    next(iter(st.models.values())).revision += 1


def _node_draining(st: ClusterState) -> None:
    st.nodes["a"].draining = True


def _gpu_released(st: ClusterState) -> None:
    node = next(n for n in st.nodes.values() if n.holders)
    node.holders.pop(min(node.holders))


@pytest.mark.parametrize(
    "change",
    [
        _bump_epoch,
        _other_leader,
        _no_endpoint,
        _no_key,
        _no_quarantine,
        _next_generation,
        _model_revised,
        _node_draining,
        _gpu_released,
    ],
)
def test_the_digest_tells_apart_states_that_differ_in_any_durable_part(
    change: Callable[[ClusterState], None],
) -> None:
    """Two folds whose durable states differ must not agree: `replay --verify` and the
    followers' attestations compare digests to find a log folded differently."""
    st = _rich_state()
    other = state.decode_snapshot(state.encode_snapshot(st))
    assert state.digest(other) == state.digest(st)
    change(other)
    assert state.digest(other) != state.digest(st)


def test_the_digest_ignores_the_order_a_nodes_mappings_were_filled_in() -> None:
    """Two readers may fill a node's GPUs, holders and ports in different orders (a snapshot
    loaded, then a tail folded, against a fold from the start): the same state, one digest."""
    st = _rich_state()
    other = state.decode_snapshot(state.encode_snapshot(st))
    for node in other.nodes.values():
        node.gpus = dict(reversed(list(node.gpus.items())))
        node.holders = dict(reversed(list(node.holders.items())))
        node.ports = dict(reversed(list(node.ports.items())))
    assert any(len(n.holders) > 1 for n in other.nodes.values())
    assert state.digest(other) == state.digest(st)


def test_a_snapshot_of_another_format_is_refused_with_what_to_do() -> None:
    st = _rich_state()
    later = msgspec.msgpack.encode({"format": state.SNAPSHOT_FORMAT + 1, "state": st})
    with pytest.raises(ValueError, match="fold the log from the start instead"):
        state.decode_snapshot(later)


# --------------------------------------------------------------------------- properties


@settings(max_examples=150, deadline=None)
@given(st.lists(any_event, max_size=30))
def test_the_fold_never_raises_and_is_deterministic(evs: list[events.Event]) -> None:
    first, second = ClusterState(), ClusterState()
    for seq, ev in enumerate(evs, 1):
        a = state.apply(first, ev, seq)
        b = state.apply(second, ev, seq)
        assert a == b
        assert a is None or (isinstance(a, str) and "internal error" not in a), a
    assert state.digest(first) == state.digest(second)
    assert state.digest(state.decode_snapshot(state.encode_snapshot(first))) == state.digest(first)


@settings(max_examples=60, deadline=None)
@given(st.lists(any_event, max_size=15), st.data())
def test_hostile_events_on_a_real_cluster_never_raise(
    evs: list[events.Event], data: st.DataObject
) -> None:
    sim = placed_sim()
    for ev in evs:
        reason = sim.append(ev)
        assert reason is None or "internal error" not in reason, reason
    # Whatever was accepted, no GPU is held by two replicas.
    for node in sim.state.nodes.values():
        for g, rid in node.holders.items():
            replica = sim.state.replicas[rid]
            assert any(g in s.gpus and s.node == node.name for s in replica.shards)


@settings(max_examples=60, deadline=None)
@given(st.lists(any_event, max_size=15), st.data())
def test_a_fold_resumed_from_a_snapshot_is_the_fold_of_the_whole_log(
    evs: list[events.Event], data: st.DataObject
) -> None:
    """What a cold start does (snapshot, then the tail) ends in exactly the state of folding
    every record from the start, volatile part and sequence included; and folding is
    deterministic: the same records fold to equal states."""
    sim = placed_sim()
    sim.heartbeats()
    sim.extend(evs)
    records = sim.records
    cut = data.draw(st.integers(0, len(records)), label="snapshot after record")
    head, _ = state.fold_records(records[:cut])
    resumed = state.decode_snapshot(state.encode_snapshot(head))
    assert resumed == head
    resumed, _ = state.fold_records(records[cut:], resumed)
    whole, _ = state.fold_records(records)
    assert resumed == whole == sim.state
    assert state.digest(resumed) == state.digest(sim.state)


def test_apply_survives_an_unknown_event_type() -> None:
    class Odd(events.Event, tag="odd", kw_only=True, frozen=True):
        pass

    st = ClusterState()
    assert state.apply(st, Odd(id="x", ts=0.0), 1) == "Odd is not an event the fold knows"
    assert msgspec.structs.asdict(st)["last_seq"] == 1


def test_a_heartbeat_naming_an_unknown_gpu_still_proves_liveness() -> None:
    sim = placed_sim()
    seen_before = sim.state.seen["a"].last_seen
    sim.now += 5
    reason = sim.heartbeat(
        "a",
        [
            events.GpuHealth(index=99, ecc_uncorrected=1),
            events.GpuHealth(index=1, ecc_uncorrected=2),
        ],
    )
    assert reason is None
    assert sim.state.seen["a"].last_seen == seen_before + 5
    assert sim.state.seen["a"].health == (events.GpuHealth(index=1, ecc_uncorrected=2),)

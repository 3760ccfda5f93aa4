"""The reconciler's rules, each as a small scenario driven through the log."""

from __future__ import annotations

import msgspec
import pytest

from llmgw.core import events, reconcile, state
from llmgw.core.autoscale import Autoscale
from llmgw.core.profile import ModelProfile
from llmgw.core.reconcile import ReconcileConfig

from .scenarios import Sim, fabric, profile


def kinds(decisions: list[events.Event]) -> list[str]:
    return [type(d).__name__ for d in decisions]


def of(decisions: list[events.Event], cls: type[events.Event]) -> list[events.Event]:
    return [d for d in decisions if isinstance(d, cls)]


def two_nodes(**kw: object) -> Sim:
    sim = Sim(**kw)  # type: ignore[arg-type]
    sim.register("a", fabrics=[fabric("ib-a", ["mlx5_0", "mlx5_1"])])
    sim.register("b", fabrics=[fabric("ib-a", ["mlx5_2", "mlx5_3"])])
    return sim


def test_missing_replicas_are_placed_with_a_complete_launch_spec() -> None:
    sim = two_nodes()
    sim.declare(
        profile(
            "llama",
            model="meta-llama/Llama-3.1-8B-Instruct",
            aliases=("llama-8b",),
            tensor_parallel=2,
            replicas=2,
            dtype="bfloat16",
            max_model_len=8192,
            engine_args=("--enable-prefix-caching",),
            env={"VLLM_LOGGING_LEVEL": "INFO"},
        )
    )
    decisions = sim.leader()
    assert kinds(decisions) == ["ReplicaPlaced", "StartShard", "ReplicaPlaced", "StartShard"]
    placed = of(decisions, events.ReplicaPlaced)
    assert [p.replica_id for p in placed] == ["r1-3-0", "r1-3-2"]  # type: ignore[attr-defined]
    assert [d.id for d in decisions] == ["1-3-0", "1-3-1", "1-3-2", "1-3-3"]
    start = of(decisions, events.StartShard)[0]
    assert isinstance(start, events.StartShard)
    assert start.node == "a"
    assert start.generation == 1
    assert start.launch == events.LaunchSpec(
        engine="vllm",
        model="meta-llama/Llama-3.1-8B-Instruct",
        served_name="llama",
        aliases=("llama-8b",),
        port=8100,
        gpus=(0, 1),
        gpu_class="h100-80g",
        tensor_parallel=2,
        dtype="bfloat16",
        max_model_len=8192,
        engine_args=("--enable-prefix-caching",),
        env={"VLLM_LOGGING_LEVEL": "INFO"},
    )
    # Spread: the second replica goes to the other node.
    assert of(decisions, events.StartShard)[1].node == "b"  # type: ignore[attr-defined]


def test_a_multi_node_replica_gets_nccl_hcas_of_its_fabric_and_the_head_address() -> None:
    sim = two_nodes()
    sim.declare(profile("big", tensor_parallel=8, pipeline_parallel=2, nodes=2))
    starts = of(sim.leader(), events.StartShard)
    assert [s.launch.node_rank for s in starts] == [0, 1]  # type: ignore[attr-defined]
    head, worker = (s.launch for s in starts)  # type: ignore[attr-defined]
    assert head.env["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1"
    assert worker.env["NCCL_IB_HCA"] == "=mlx5_2,mlx5_3"
    for spec in (head, worker):
        assert spec.nnodes == 2
        assert spec.head_address == "a.internal"
        assert spec.head_port == head.port + 1
        assert spec.fabric == "ib-a"
        assert spec.gpus == tuple(range(8))
        assert (spec.tensor_parallel, spec.pipeline_parallel) == (8, 2)


def test_endpoint_up_when_all_shards_serve_and_down_when_one_fails() -> None:
    sim = two_nodes()
    sim.declare(profile("big", tensor_parallel=8, nodes=2))
    decisions = sim.settle()
    (up,) = of(decisions, events.EndpointUp)
    assert isinstance(up, events.EndpointUp)
    assert up.url.startswith("http://a.internal:81")
    rid = up.replica_id
    sim.status("b", rid, 1, 1, "failed", error="NCCL timeout")
    down = sim.leader()
    assert kinds(down)[0] == "EndpointDown"
    assert "shard 1 failed: NCCL timeout" in down[0].reason  # type: ignore[attr-defined]


def test_failed_replicas_restart_in_place_with_exponential_backoff() -> None:
    cfg = ReconcileConfig(restart_backoff_s=5, restart_backoff_max_s=60)
    sim = two_nodes(config=cfg)
    sim.declare(profile("m", tensor_parallel=2))
    sim.settle()
    (r,) = sim.state.replicas.values()
    node = r.shards[0].node
    sim.failing.add((r.id, 0))
    sim.status(node, r.id, 1, 0, "failed", error="CUDA error")
    assert kinds(sim.step()) == ["EndpointDown"]
    assert sim.step(sim.now + 4.9) == []  # backoff 5 s
    restart = sim.step(sim.now + 0.2)
    assert kinds(restart) == ["ReplicaPlaced", "StartShard"]
    assert restart[0].generation == 2  # type: ignore[attr-defined]
    assert restart[0].shards[0].gpus == r.shards[0].gpus  # type: ignore[attr-defined]
    assert restart[0].reason == "restart after 1 failure(s): CUDA error"  # type: ignore[attr-defined]
    # It failed again (the agent sim fails it): the wait doubles to 10 s.
    assert r.failures == 2
    assert sim.step(sim.now + 9.9) == []
    assert kinds(sim.step(sim.now + 0.2)) == ["ReplicaPlaced", "StartShard"]
    assert reconcile.backoff(10, cfg) == 60
    # Once it serves, the failure count resets.
    sim.failing.clear()
    sim.step(sim.now + 20.1)
    sim.settle()
    assert r.failures == 0
    assert r.generation == 4
    assert r.id in sim.state.endpoints


def test_an_engine_that_exits_on_its_own_is_restarted_in_place() -> None:
    """A shard reported stopped that nobody asked to stop is broken like a failed one: the
    replica restarts as its next generation; left alone, the model would be a replica short
    for ever (no rule places another while this one counts)."""
    sim = two_nodes(config=ReconcileConfig(restart_backoff_s=5))
    sim.declare(profile("m", tensor_parallel=2))
    sim.settle()
    (r,) = sim.state.replicas.values()
    sim.status(r.shards[0].node, r.id, 1, 0, "stopped")
    assert kinds(sim.step()) == ["EndpointDown"]
    assert sim.step(sim.now + 4.9) == []
    restart = sim.step(sim.now + 0.2)
    assert kinds(restart) == ["ReplicaPlaced", "StartShard"]
    assert restart[0].replica_id == r.id  # type: ignore[attr-defined]
    assert restart[0].generation == 2  # type: ignore[attr-defined]
    sim.settle()
    assert [x.id for x in sim.serving("m")] == [r.id]


def test_a_failed_replica_on_an_unreachable_node_waits_for_lost_or_recovered() -> None:
    """Its agent cannot hear a restart: none is sent while the node is unreachable, however
    long the backoff has run; once the node is back, the replica restarts in place."""
    cfg = ReconcileConfig(restart_backoff_s=5, unreachable_after_s=10, lost_after_s=600)
    sim = two_nodes(config=cfg)
    sim.declare(profile("m", tensor_parallel=8))
    sim.settle()
    (r,) = sim.state.replicas.values()
    node = r.shards[0].node
    sim.status(node, r.id, 1, 0, "failed", error="CUDA error")
    assert kinds(sim.step()) == ["EndpointDown"]
    sim.silent.add(node)
    sim.advance(11)
    assert kinds(sim.step()) == ["NodeUnreachable"]
    sim.advance(100)
    assert sim.step() == []
    sim.silent.discard(node)
    sim.advance(1)
    assert kinds(sim.step()) == ["NodeRecovered"]
    restart = sim.step()
    assert kinds(restart) == ["ReplicaPlaced", "StartShard"]
    assert restart[0].generation == 2  # type: ignore[attr-defined]


def test_a_failed_replica_of_a_changed_model_is_placed_anew_not_restarted() -> None:
    """Restarting it in place would start the old revision's placement again, only to move
    it at the next pass: it is retired and replaced at once."""
    sim = two_nodes(config=ReconcileConfig(restart_backoff_s=5))
    sim.declare(profile("m", tensor_parallel=2))
    sim.settle()
    (r,) = sim.state.replicas.values()
    sim.change(profile("m", tensor_parallel=4))
    sim.status(r.shards[0].node, r.id, 1, 0, "failed", error="CUDA error")
    decisions = sim.step()
    assert kinds(decisions)[:3] == ["EndpointDown", "ReplicaRetired", "ReplicaPlaced"]
    assert "model m changed" in decisions[1].reason  # type: ignore[attr-defined]
    placed = of(decisions, events.ReplicaPlaced)[0]
    assert placed.replaces == r.id  # type: ignore[attr-defined]
    assert len(placed.shards[0].gpus) == 4  # type: ignore[attr-defined]


def test_a_replica_that_fails_on_a_draining_node_is_placed_elsewhere_not_restarted() -> None:
    sim = two_nodes(config=ReconcileConfig(restart_backoff_s=5))
    sim.declare(profile("m", tensor_parallel=8))
    sim.settle()
    (r,) = sim.state.replicas.values()
    node = r.shards[0].node
    other = "b" if node == "a" else "a"
    sim.cordon(other)  # no room for a replacement: the drain waits for its grace period
    sim.drain(node)
    assert sim.step() == []
    sim.status(node, r.id, 1, 0, "failed", error="CUDA error")
    sim.append(events.NodeUncordoned(id=sim.eid("op"), ts=sim.now, operator="alice", node=other))
    decisions = sim.step(sim.now + 60)
    assert kinds(decisions)[:3] == ["EndpointDown", "ReplicaRetired", "ReplicaPlaced"]
    assert f"node {node} draining" in decisions[1].reason  # type: ignore[attr-defined]
    placed = of(decisions, events.ReplicaPlaced)[0]
    assert placed.shards[0].node == other  # type: ignore[attr-defined]


def test_a_failure_dated_far_ahead_by_its_node_does_not_hold_the_restart_back() -> None:
    """A node whose clock jumped ahead (or that lies) dates its failure years from now; the
    backoff then counts from the generation's placement, by the leader's time."""
    sim = two_nodes(config=ReconcileConfig(restart_backoff_s=5))
    sim.declare(profile("m", tensor_parallel=8))
    sim.settle()
    (r,) = sim.state.replicas.values()
    ahead = events.ShardStatus(
        id=sim.eid("st"),
        ts=sim.now + 10 * 365 * 86400,
        node=r.shards[0].node,
        replica_id=r.id,
        generation=1,
        shard=0,
        phase="failed",
        error="CUDA error",
    )
    assert sim.append(ahead) is None
    assert kinds(sim.step()) == ["EndpointDown"]
    restart = sim.step(r.placed_ts + 5.1)
    assert kinds(restart) == ["ReplicaPlaced", "StartShard"]


def test_a_restart_stops_the_shards_still_running_before_the_next_generation() -> None:
    sim = two_nodes(config=ReconcileConfig(restart_backoff_s=5))
    sim.declare(profile("big", tensor_parallel=8, nodes=2))
    sim.settle()
    (r,) = sim.state.replicas.values()
    sim.status(r.shards[1].node, r.id, 1, 1, "failed", error="NCCL timeout")
    assert kinds(sim.step()) == ["EndpointDown"]
    restart = sim.step(sim.now + 5.1)
    assert kinds(restart) == ["StopShard", "ReplicaPlaced", "StartShard", "StartShard"]
    # The next generation starts with no stop asked of it: its own failures count.
    assert [(s.started, s.stop_sent) for s in r.shards] == [(True, False), (True, False)]
    stop = restart[0]
    assert isinstance(stop, events.StopShard)
    assert (stop.node, stop.shard, stop.generation) == (r.shards[0].node, 0, 1)


def test_a_replica_on_two_draining_nodes_leaves_by_the_earlier_deadline() -> None:
    sim = two_nodes()
    sim.declare(profile("big", tensor_parallel=8, nodes=2))
    sim.settle()
    (r,) = sim.state.replicas.values()
    sim.drain("a", grace_s=100)
    sim.drain("b", grace_s=1000)
    assert sim.step(sim.now + 99) == []  # nowhere to place a replacement meanwhile
    ended = sim.step(sim.now + 2)
    assert kinds(ended)[:2] == ["EndpointDown", "ReplicaRetired"]
    assert ended[1].reason.endswith("the drain grace period ended")  # type: ignore[attr-defined]
    assert ended[1].replica_id == r.id  # type: ignore[attr-defined]


def test_a_surplus_replica_on_a_draining_node_is_retired_not_replaced() -> None:
    sim = two_nodes()
    sim.declare(profile("m", tensor_parallel=2, replicas=2))
    sim.settle()
    on_a = [r.id for r in sim.state.replicas.values() if r.shards[0].node == "a"]
    sim.drain("a")
    sim.change(profile("m", tensor_parallel=2, replicas=2 - len(on_a)))
    decisions = sim.step()
    assert of(decisions, events.ReplicaPlaced) == []
    retired = of(decisions, events.ReplicaRetired)
    assert sorted(d.replica_id for d in retired) == sorted(on_a)  # type: ignore[attr-defined]
    assert all("surplus" in d.reason for d in retired)  # type: ignore[attr-defined]


def test_a_drain_past_its_grace_retires_at_once_even_if_room_appears_then() -> None:
    """Past the deadline the original goes, whatever a replacement would need: a drain
    bounded by its grace period ends then (the count places the replacement)."""
    sim = two_nodes()
    sim.declare(profile("m", tensor_parallel=8))
    sim.settle()
    (r,) = sim.state.replicas.values()
    node = r.shards[0].node
    other = "b" if node == "a" else "a"
    sim.cordon(other)
    sim.drain(node, grace_s=10)
    assert sim.step(sim.now + 5) == []
    sim.append(events.NodeUncordoned(id=sim.eid("op"), ts=sim.now, operator="alice", node=other))
    ended = sim.step(sim.now + 6)
    assert kinds(ended)[:3] == ["EndpointDown", "ReplicaRetired", "DrainShard"]
    assert ended[1].reason.endswith("the drain grace period ended")  # type: ignore[attr-defined]
    (placed,) = of(ended, events.ReplicaPlaced)
    assert placed.shards[0].node == other  # type: ignore[attr-defined]


def test_a_surplus_replica_still_loading_is_stopped_not_drained() -> None:
    """Only a replica that serves has requests to finish: one still loading is stopped at
    once rather than left a drain window."""
    sim = two_nodes()
    sim.declare(profile("m", tensor_parallel=2, replicas=2))
    placed = sim.leader()  # agents do not answer yet
    loading = of(placed, events.StartShard)[1]
    sim.agents(of(placed, events.StartShard)[:1])
    sim.status(loading.node, loading.replica_id, 1, 0, "loading")  # type: ignore[attr-defined]
    sim.change(profile("m", tensor_parallel=2, replicas=1))
    decisions = sim.step()
    assert kinds(decisions) == ["EndpointUp", "ReplicaRetired", "StopShard"]
    assert decisions[1].replica_id == loading.replica_id  # type: ignore[attr-defined]
    assert decisions[2].replica_id == loading.replica_id  # type: ignore[attr-defined]


def test_a_replica_whose_start_was_never_sent_is_retired_without_a_stop() -> None:
    """The leader died between a placement and its StartShard: retiring that replica frees
    its GPUs in the fold at once; a StopShard for it would be refused (its replica is gone)."""
    sim = two_nodes()
    sim.declare(profile("m", tensor_parallel=2))
    decisions = reconcile.reconcile(sim.state, sim.now, epoch=sim.epoch, config=sim.config)
    assert kinds(decisions) == ["ReplicaPlaced", "StartShard"]
    assert sim.append(decisions[0]) is None
    sim.append(events.ModelRemoved(id=sim.eid("op"), ts=sim.now, operator="alice", name="m"))
    retired = sim.leader()  # asserts the fold accepts each of its decisions
    assert kinds(retired) == ["ReplicaRetired"]
    assert sim.state.replicas == {}
    assert all(node.holders == {} for node in sim.state.nodes.values())


def test_a_node_silent_for_just_over_unreachable_after_s_is_unreachable() -> None:
    sim = two_nodes(config=ReconcileConfig(unreachable_after_s=10))
    sim.silent.add("a")
    sim.advance(10)
    assert sim.step() == []
    sim.advance(0.5)
    (unreachable,) = sim.step()
    assert isinstance(unreachable, events.NodeUnreachable)
    assert unreachable.node == "a"


def test_uncordoning_a_draining_node_ends_its_drain() -> None:
    sim = two_nodes()
    sim.declare(profile("m", tensor_parallel=8))
    sim.settle()
    (r,) = sim.state.replicas.values()
    node = r.shards[0].node
    other = "b" if node == "a" else "a"
    sim.cordon(other)  # nowhere to move to: the drain only waits
    sim.drain(node, grace_s=100)
    assert sim.step() == []
    sim.append(events.NodeUncordoned(id=sim.eid("op"), ts=sim.now, operator="alice", node=node))
    assert not sim.state.nodes[node].draining
    assert sim.settle(sim.now + 1000) == []
    assert [x.id for x in sim.serving("m")] == [r.id]


def test_a_drain_requested_again_keeps_its_first_deadline() -> None:
    """Asking again (an operator's retry, a script run twice) does not push the end of the
    drain further: it ends by the first request's grace."""
    sim = two_nodes()
    sim.declare(profile("m", tensor_parallel=8))
    sim.settle()
    (r,) = sim.state.replicas.values()
    node = r.shards[0].node
    sim.cordon("b" if node == "a" else "a")
    sim.drain(node, grace_s=100)
    sim.advance(60)
    sim.drain(node, grace_s=100)
    assert sim.step() == []
    ended = sim.step(sim.now + 41)
    assert kinds(ended)[:2] == ["EndpointDown", "ReplicaRetired"]
    assert ended[1].reason.endswith("the drain grace period ended")  # type: ignore[attr-defined]


def test_a_restart_whose_starts_were_never_sent_is_started_by_the_next_leader() -> None:
    """The leader died after writing the next generation but before its StartShard: that
    generation's shards were never started, and the next pass starts them."""
    sim = two_nodes(config=ReconcileConfig(restart_backoff_s=5))
    sim.declare(profile("m", tensor_parallel=2))
    sim.settle()
    (r,) = sim.state.replicas.values()
    sim.status(r.shards[0].node, r.id, 1, 0, "failed", error="CUDA error")
    sim.step()
    sim.advance(6)
    decisions = reconcile.reconcile(sim.state, sim.now, epoch=sim.epoch, config=sim.config)
    assert kinds(decisions) == ["ReplicaPlaced", "StartShard"]
    assert sim.append(decisions[0]) is None  # the StartShard never reached the log
    (start,) = sim.leader()
    assert isinstance(start, events.StartShard)
    assert (start.replica_id, start.generation) == (r.id, 2)


def test_heartbeats_stop_unreachable_then_lost_then_replaced_then_recovered() -> None:
    cfg = ReconcileConfig(unreachable_after_s=10, lost_after_s=60)
    sim = two_nodes(config=cfg)
    sim.declare(profile("m", tensor_parallel=8))
    sim.settle()
    (r,) = sim.state.replicas.values()
    dead = r.shards[0].node
    other = "b" if dead == "a" else "a"
    sim.silent.add(dead)
    sim.advance(5)
    assert sim.step() == []
    sim.advance(6)
    (unreachable,) = sim.step()
    assert isinstance(unreachable, events.NodeUnreachable)
    assert unreachable.node == dead
    assert unreachable.last_heartbeat == pytest.approx(sim.now - 11)
    # Unreachable: no replacement yet, and no new placements there.
    assert sim.step() == []
    sim.advance(60)
    (lost,) = sim.step()
    assert isinstance(lost, events.NodeLost)
    replaced = sim.settle()
    assert kinds(replaced)[:3] == ["EndpointDown", "ReplicaRetired", "ReplicaPlaced"]
    placed = of(replaced, events.ReplicaPlaced)[0]
    assert placed.replaces == r.id  # type: ignore[attr-defined]
    assert placed.shards[0].node == other  # type: ignore[attr-defined]
    assert r.id not in sim.state.replicas  # the lost node's shard is released
    assert len(sim.serving("m")) == 1
    # The node comes back: recovered, and the retired replica it still runs is stopped.
    sim.silent.discard(dead)
    sim.heartbeat(dead)
    (recovered,) = sim.step()
    assert isinstance(recovered, events.NodeRecovered)
    assert sim.state.nodes[dead].liveness == "ready"
    sim.register(
        dead,
        fabrics=[fabric("ib-a")],
        shards=[
            events.RunningShard(
                replica_id=r.id, generation=1, shard=0, gpus=r.shards[0].gpus, phase="serving"
            )
        ],
    )
    stop = sim.step()
    assert kinds(stop) == ["StopShard"]
    assert stop[0].reason == "not a replica the control plane placed"  # type: ignore[attr-defined]
    assert sim.settle() == []


def test_rolling_drain_stops_the_original_only_after_its_replacement_serves() -> None:
    cfg = ReconcileConfig(shard_drain_s=30)
    sim = two_nodes(config=cfg)
    sim.declare(profile("m", tensor_parallel=8))
    sim.settle()
    (original,) = sim.state.replicas.values()
    src = original.shards[0].node
    sim.drain(src, grace_s=600)
    placed = sim.leader()  # agents do not answer yet
    assert kinds(placed) == ["ReplicaPlaced", "StartShard"]
    assert placed[0].replaces == original.id  # type: ignore[attr-defined]
    new_id = placed[0].replica_id  # type: ignore[attr-defined]
    # While the replacement loads, the original keeps serving and nothing else happens.
    sim.status(placed[1].node, new_id, 1, 0, "loading")  # type: ignore[attr-defined]
    assert sim.leader() == []
    assert original.id in sim.state.endpoints
    sim.status(placed[1].node, new_id, 1, 0, "serving")  # type: ignore[attr-defined]
    # The replacement's EndpointUp is in the log before the original's EndpointDown: a
    # router folding the log between the two still has an endpoint of the model.
    assert kinds(sim.step()) == ["EndpointUp"]
    assert original.id in sim.state.endpoints
    drained = sim.step()
    assert kinds(drained) == ["EndpointDown", "ReplicaRetired", "DrainShard"]
    assert drained[1].reason.endswith("its replacement serves")  # type: ignore[attr-defined]
    assert sim.step(sim.now + 29) == []
    (stop,) = sim.step(sim.now + 1.5)
    assert isinstance(stop, events.StopShard)
    assert stop.replica_id == original.id
    assert original.id not in sim.state.replicas
    assert sim.settle() == []
    assert [r.id for r in sim.serving("m")] == [new_id]


def replacements(decisions: list[events.Event]) -> list[events.ReplicaPlaced]:
    return [d for d in decisions if isinstance(d, events.ReplicaPlaced)]


def surplus_retired(decisions: list[events.Event]) -> list[events.Event]:
    return [d for d in of(decisions, events.ReplicaRetired) if "surplus" in d.reason]  # type: ignore[attr-defined]


@pytest.mark.parametrize("on_both", [False, True], ids=["every-replica-on-it", "one-of-two"])
def test_a_drain_places_exactly_one_replacement_per_drained_replica(on_both: bool) -> None:
    """Room for more on the other node: still one new replica per drained one, and none
    retired as surplus (each would be a model load thrown away)."""
    sim = Sim(config=ReconcileConfig(shard_drain_s=5))
    sim.register("a")
    if on_both:
        sim.register("b")
    sim.declare(profile("m", tensor_parallel=1, replicas=2))
    sim.settle()
    if not on_both:
        sim.register("b")
    originals = sorted(sim.state.replicas)
    on_a = sorted(r.id for r in sim.state.replicas.values() if r.shards[0].node == "a")
    assert len(on_a) == (1 if on_both else 2)
    sim.drain("a")
    moved = sim.settle()
    moved += sim.settle(sim.now + 6)
    placed = replacements(moved)
    assert sorted(p.replaces for p in placed) == on_a, placed
    assert all(p.shards[0].node == "b" for p in placed)
    assert surplus_retired(moved) == []
    assert not of(moved, events.StopShard) or {
        d.replica_id  # type: ignore[attr-defined]
        for d in of(moved, events.StopShard)
    } == set(on_a)
    serving = sorted(r.id for r in sim.serving("m"))
    assert serving == sorted([*(set(originals) - set(on_a)), *(p.replica_id for p in placed)])


def test_draining_the_only_capable_node_ends_with_the_grace_period() -> None:
    sim = Sim(config=ReconcileConfig(shard_drain_s=10))
    sim.register("solo")
    sim.declare(profile("m", tensor_parallel=8))
    sim.settle()
    (original,) = sim.state.replicas.values()
    sim.drain("solo", grace_s=120)
    assert sim.step() == []
    assert (
        reconcile.reconcile_detail(sim.state, sim.now, epoch=1)
        .unplaceable["m"]
        .startswith("no node offers 8 free h100-80g (draining: 1)")
    )
    assert sim.step(sim.now + 119) == []
    ended = sim.step(sim.now + 1)
    assert kinds(ended) == ["EndpointDown", "ReplicaRetired", "DrainShard"]
    assert ended[1].reason.endswith("the drain grace period ended")  # type: ignore[attr-defined]
    assert kinds(sim.step(sim.now + 10)) == ["StopShard"]
    assert original.id not in sim.state.replicas
    assert sim.settle() == []


def test_surplus_replicas_retire_least_serving_and_newest_first() -> None:
    sim = two_nodes()
    sim.declare(profile("m", tensor_parallel=2, replicas=3))
    sim.settle()
    newest = max(sim.state.replicas.values(), key=lambda r: r.placed_seq)
    sim.change(profile("m", tensor_parallel=2, replicas=2))
    retired = sim.settle()
    assert kinds(retired)[:3] == ["EndpointDown", "ReplicaRetired", "DrainShard"]
    assert retired[1].replica_id == newest.id  # type: ignore[attr-defined]
    # One surplus, one retired: no second one retired and then placed again.
    assert len(of(retired, events.ReplicaRetired)) == 1
    assert of(retired, events.ReplicaPlaced) == []
    sim.settle(sim.now + 31)
    assert len(sim.state.replicas) == 2


def test_a_surplus_replica_that_does_not_serve_yet_retires_before_a_newer_serving_one() -> None:
    """Least serving first, newest first only among equals: the older replica, still
    loading, goes; the newer one, serving, stays."""
    sim = two_nodes()
    sim.declare(profile("m", tensor_parallel=2, replicas=2))
    placed = sim.leader()  # agents do not answer yet
    older, newer = of(placed, events.StartShard)
    sim.agents([newer])
    sim.status(older.node, older.replica_id, 1, 0, "loading")  # type: ignore[attr-defined]
    assert kinds(sim.leader()) == ["EndpointUp"]  # for the newer: nothing else to do
    sim.change(profile("m", tensor_parallel=2, replicas=1))
    (retired,) = of(sim.step(), events.ReplicaRetired)
    assert retired.replica_id == older.replica_id  # type: ignore[attr-defined]


def test_a_surplus_replica_never_started_is_retired_and_the_serving_one_kept() -> None:
    """A leader died between a placement and its StartShard, and the model then shrank:
    the replica never started goes, at no cost; the serving one stays and serves. (The
    next leader started the one and drained the other: a model load thrown away, and the
    model a replica short until the new one loaded.)"""
    sim = two_nodes()
    sim.declare(profile("m", tensor_parallel=2, replicas=1))
    sim.settle()
    (serving,) = sim.state.replicas
    sim.change(profile("m", tensor_parallel=2, replicas=2))
    decisions = reconcile.reconcile(sim.state, sim.now, epoch=sim.epoch, config=sim.config)
    assert kinds(decisions) == ["ReplicaPlaced", "StartShard"]
    assert sim.append(decisions[0]) is None
    unstarted = decisions[0].replica_id  # type: ignore[attr-defined]
    sim.change(profile("m", tensor_parallel=2, replicas=1))
    decisions = sim.leader()
    assert kinds(decisions) == ["ReplicaRetired"]
    assert decisions[0].replica_id == unstarted  # type: ignore[attr-defined]
    assert sim.settle() == []
    assert [r.id for r in sim.serving("m")] == [serving]
    assert list(sim.state.replicas) == [serving]


def test_short_of_gpus_the_model_of_higher_priority_is_placed_first() -> None:
    """Whatever the names' order: room for one replica goes to the higher priority."""
    sim = Sim()
    sim.register("a")

    def scaled(name: str, priority: int) -> ModelProfile:
        rules = Autoscale(min=1, max=1, waiting_per_replica=1.0, priority=priority)
        return profile(name, tensor_parallel=8, autoscale=rules)

    sim.declare(scaled("a-low", -5))
    sim.declare(scaled("z-high", 5))
    (placed,) = of(sim.leader(), events.ReplicaPlaced)
    assert placed.model == "z-high"  # type: ignore[attr-defined]


def test_a_removed_model_is_retired_and_a_changed_model_rolls() -> None:
    sim = two_nodes()
    sim.declare(profile("m", tensor_parallel=2))
    sim.settle()
    (old,) = sim.state.replicas.values()
    sim.advance(3600)  # the change comes long after the declaration
    sim.change(profile("m", tensor_parallel=2, engine_args=("--enforce-eager",)))
    assert sim.state.models["m"].revision == 2
    # The old replica serves on until its replacement does (the change's grace counts
    # from the change, not from the model's declaration).
    assert kinds(sim.step()) == ["ReplicaPlaced", "StartShard"]
    assert sim.state.models["m"].changed_ts == sim.now
    assert not old.retired
    rolled = sim.settle()
    assert of(rolled, events.ReplicaRetired)[0].replica_id == old.id  # type: ignore[attr-defined]
    sim.settle(sim.now + 31)
    (new,) = sim.state.replicas.values()
    assert new.revision == 2
    sim.append(events.ModelRemoved(id="rm", ts=sim.now, operator="o", name="m"))
    gone = sim.settle()
    assert kinds(gone)[:3] == ["EndpointDown", "ReplicaRetired", "DrainShard"]
    sim.settle(sim.now + 31)
    assert sim.state.replicas == {}
    assert sim.state.endpoints == {}


def test_gpu_health_from_heartbeats_is_recorded_and_steers_placement() -> None:
    sim = Sim()
    sim.register("a", count=2, per_domain=2)
    sim.heartbeat("a", [events.GpuHealth(index=1, ecc_uncorrected=3)])
    (changed,) = sim.step()
    assert isinstance(changed, events.GpuHealthChanged)
    assert changed.gpus == (events.GpuHealth(index=1, ecc_uncorrected=3),)
    assert not sim.state.nodes["a"].gpus[1].healthy
    assert sim.step() == []
    sim.declare(profile("m", tensor_parallel=1, replicas=2))
    decisions = sim.settle()
    assert [s.gpus for d in of(decisions, events.ReplicaPlaced) for s in d.shards] == [(0,)]  # type: ignore[attr-defined]


def test_a_pending_row_remap_in_a_heartbeat_is_recorded_and_cleared() -> None:
    """Before: the flag was not in the heartbeat, so the GPU stayed placeable."""
    sim = Sim()
    sim.register("a", count=2, per_domain=2)
    sim.heartbeat("a", [events.GpuHealth(index=0, remap_pending=True)])
    (changed,) = sim.step()
    assert isinstance(changed, events.GpuHealthChanged)
    assert changed.gpus == (events.GpuHealth(index=0, remap_pending=True),)
    assert sim.state.nodes["a"].gpus[0].health_problems == (
        "row remap pending (reset the GPU to apply it)",
    )
    sim.declare(profile("m", tensor_parallel=1, replicas=2))
    decisions = sim.settle()
    assert [s.gpus for d in of(decisions, events.ReplicaPlaced) for s in d.shards] == [(1,)]  # type: ignore[attr-defined]
    sim.heartbeat("a", [events.GpuHealth(index=0, remap_failed=True)])
    sim.settle()
    assert sim.state.nodes["a"].gpus[0].remap_failed
    assert not sim.state.nodes["a"].gpus[0].remap_pending


def test_a_replica_on_a_gpu_turned_unhealthy_is_moved_when_it_fails() -> None:
    sim = two_nodes()
    sim.declare(profile("m", tensor_parallel=8))
    sim.settle()
    (r,) = sim.state.replicas.values()
    node = r.shards[0].node
    sim.heartbeat(node, [events.GpuHealth(index=3, ecc_uncorrected=1)])
    sim.settle()
    sim.status(node, r.id, 1, 0, "failed", error="Xid 48")
    moved = sim.settle()
    assert kinds(moved)[:3] == ["EndpointDown", "ReplicaRetired", "ReplicaPlaced"]
    assert f"GPU 3 of {node} unhealthy" in moved[1].reason  # type: ignore[attr-defined]


def test_observations_come_alone_and_planning_follows_on_the_next_pass() -> None:
    sim = two_nodes(config=ReconcileConfig(unreachable_after_s=10))
    sim.declare(profile("m", tensor_parallel=8, replicas=2))
    sim.now += 11  # both nodes silent for 11 s
    assert kinds(sim.leader()) == ["NodeUnreachable", "NodeUnreachable"]
    assert sim.leader() == []  # nowhere to place


def test_a_fresh_leader_gives_nodes_time_after_a_replay_without_heartbeats() -> None:
    sim = two_nodes(config=ReconcileConfig(unreachable_after_s=10))
    sim.now += 3600
    replay, _ = state.fold_records(sim.durable_records())
    assert reconcile.reconcile(replay, sim.now, epoch=2, observing_since=sim.now - 1) == []
    assert kinds(reconcile.reconcile(replay, sim.now, epoch=2)) == ["NodeUnreachable"] * 2


def test_reconcile_is_pure_and_deterministic() -> None:
    sim = two_nodes()
    sim.declare(profile("m", tensor_parallel=2, replicas=4))
    before = state.encode_snapshot(sim.state)
    first = reconcile.reconcile(sim.state, sim.now, epoch=3)
    second = reconcile.reconcile(sim.state, sim.now, epoch=3)
    assert state.encode_snapshot(sim.state) == before
    assert [msgspec.json.encode(d) for d in first] == [msgspec.json.encode(d) for d in second]


def test_replay_reaches_the_leaders_digest_and_verify_reproduces_every_batch() -> None:
    cfg = ReconcileConfig(unreachable_after_s=10, lost_after_s=30, shard_drain_s=5)
    sim = two_nodes(config=cfg)
    sim.register("c", fabrics=[fabric("ib-a")])
    sim.declare(profile("m", tensor_parallel=4, replicas=3))
    sim.declare(profile("big", tensor_parallel=8, nodes=2))
    sim.settle()
    sim.drain("a", grace_s=60)
    sim.settle()
    sim.advance(6)
    sim.settle()
    sim.silent.add("b")
    for _ in range(5):
        sim.advance(10)
        sim.settle()
    sim.change(profile("m", tensor_parallel=4, replicas=1))
    sim.settle()
    sim.advance(10)
    sim.settle()
    assert sim.rejected == []
    assert len(sim.decision_batches) >= 8
    replay, rejected = state.fold_records(sim.durable_records())
    assert rejected == []
    assert state.digest(replay) == state.digest(sim.state)
    # From a snapshot halfway, too.
    half = len(sim.records) // 2
    mid, _ = state.fold_records(sim.records[:half])
    resumed = state.decode_snapshot(state.encode_snapshot(mid))
    state.fold_records([r for r in sim.durable_records() if r[0] > half], resumed)
    assert state.digest(resumed) == state.digest(sim.state)
    report = reconcile.verify(sim.durable_records(), config=cfg)
    assert report.mismatches == []
    plans = [b for b in sim.decision_batches if not isinstance(b[0], reconcile.OBSERVATIONS)]
    assert report.batches == report.matched == len(plans)
    assert report.observations == sum(
        len(b) for b in sim.decision_batches if isinstance(b[0], reconcile.OBSERVATIONS)
    )


def test_verify_from_a_snapshot_inside_a_batch_skips_that_batch_and_checks_the_next() -> None:
    """A snapshot taken while a batch was being folded holds part of it: that batch was
    decided on an earlier state than the snapshot's, so it cannot be recomputed; every
    batch decided on or after the snapshot still is."""
    sim = two_nodes()
    sim.declare(profile("m", tensor_parallel=2, replicas=2))
    sim.settle()
    sim.change(profile("m", tensor_parallel=2, replicas=1))
    sim.settle()
    records = sim.durable_records()
    first = next(i for i, (_s, e) in enumerate(records) if isinstance(e, events.ReplicaPlaced))
    inside = first + 1  # the placement is folded, its StartShard not yet
    assert isinstance(records[inside][1], events.StartShard)
    snap, _ = state.fold_records(records[:inside])
    report = reconcile.verify(records[inside:], config=sim.config, state=snap)
    assert report.mismatches == []
    plans = [b for b in sim.decision_batches if not isinstance(b[0], reconcile.OBSERVATIONS)]
    assert report.batches == report.matched == len(plans) - 1


def test_verify_spots_a_forged_decision() -> None:
    sim = two_nodes()
    sim.declare(profile("m", tensor_parallel=2))
    sim.settle()
    records = sim.durable_records()
    forged = []
    for seq, ev in records:
        if isinstance(ev, events.StartShard):
            ev = msgspec.structs.replace(
                ev, launch=msgspec.structs.replace(ev.launch, env={"NCCL_IB_HCA": "mlx5"})
            )
        forged.append((seq, ev))
    report = reconcile.verify(forged)
    assert not report.ok
    assert "decision 1: recorded" in report.mismatches[0]


def test_verify_spots_a_decision_added_to_a_batch() -> None:
    """Every recorded decision matches its recomputed one, but the batch has one more: a
    writer slipped a decision in under the leader's epoch and basis."""
    sim = two_nodes()
    sim.declare(profile("m", tensor_parallel=2))
    sim.settle()
    records = sim.durable_records()
    i, start = next((i, e) for i, (_s, e) in enumerate(records) if isinstance(e, events.StartShard))
    assert isinstance(start, events.StartShard)
    extra = events.StopShard(
        id="slipped", ts=start.ts, epoch=start.epoch, basis_seq=start.basis_seq,
        node=start.node, replica_id=start.replica_id, generation=1, shard=0,
        grace_s=30.0, reason="slipped in",
    )  # fmt: skip
    seq = records[i][0]
    forged = [*records[: i + 1], (seq + 0.5, extra), *records[i + 1 :]]
    report = reconcile.verify(forged)  # type: ignore[arg-type]
    assert not report.ok
    assert "recorded 3 decisions, the log reproduces 2" in report.mismatches[0]


def test_a_gpu_that_vanishes_fails_its_shard_and_the_replica_moves() -> None:
    sim = two_nodes()
    sim.declare(profile("m", tensor_parallel=4))
    sim.settle()
    (r,) = sim.state.replicas.values()
    node = r.shards[0].node
    # The agent restarts and finds only two GPUs (Xid 79: fallen off the bus).
    sim.register(node, count=2, fabrics=[fabric("ib-a")])
    assert r.shards[0].phase == "failed"
    assert r.shards[0].error == f"GPU 2, 3 of {node} is no longer in its inventory"
    moved = sim.settle()
    assert kinds(moved)[:3] == ["EndpointDown", "ReplicaRetired", "ReplicaPlaced"]
    assert "is no longer in its inventory: placing it elsewhere" in moved[1].reason  # type: ignore[attr-defined]
    assert of(moved, events.ReplicaPlaced)[0].shards[0].node != node  # type: ignore[attr-defined]


def test_a_gpu_of_another_class_under_a_shard_fails_it_at_registration() -> None:
    """The agent comes back reporting other GPUs in the same slots (a board swapped): the
    replica was placed for its class and cannot run there as placed."""
    sim = two_nodes()
    sim.declare(profile("m", tensor_parallel=4))
    sim.settle()
    (r,) = sim.state.replicas.values()
    node = r.shards[0].node
    sim.register(node, gpu_class="a100-80g", fabrics=[fabric("ib-a")])
    assert r.shards[0].phase == "failed"
    assert r.shards[0].error.endswith("is now a100-80g, not h100-80g")


def test_a_node_that_lost_its_fabric_links_fails_the_multi_node_shard_on_it() -> None:
    """Still named on the fabric but with no HCA up: NCCL cannot run across it."""
    sim = two_nodes()
    sim.declare(profile("big", tensor_parallel=8, nodes=2))
    sim.settle()
    (r,) = sim.state.replicas.values()
    assert r.fabric == "ib-a"
    sim.register("b", fabrics=[fabric("ib-a", [])])
    (on_b,) = [s for s in r.shards if s.node == "b"]
    assert on_b.phase == "failed"
    assert on_b.error == "b is no longer on fabric ib-a"


def test_a_failed_replica_that_is_surplus_is_retired_not_restarted() -> None:
    sim = two_nodes()
    sim.declare(profile("big", tensor_parallel=8, nodes=2))
    sim.settle()
    (r,) = sim.state.replicas.values()
    sim.status(r.shards[0].node, r.id, 1, 0, "failed", error="NCCL error")
    sim.change(profile("big", tensor_parallel=8, nodes=2, replicas=0))
    decisions = sim.settle(sim.now + 60)
    assert not of(decisions, events.StartShard)
    assert of(decisions, events.ReplicaRetired)[0].reason == (  # type: ignore[attr-defined]
        "failed, and surplus: big wants 0"
    )
    assert sim.state.replicas == {}


def test_a_replacement_and_new_replicas_placed_in_one_pass_spread_evenly() -> None:
    # A drain and a scale-out in the same pass: the replacement (placed on its own) was
    # counted twice on its node, so the new replicas shunned it: 3 and 1 on the two nodes
    # left, rather than 2 and 2.
    sim = Sim(config=ReconcileConfig(shard_drain_s=5))
    for node in ("a", "b", "c"):
        sim.register(node)
    sim.declare(profile("m", tensor_parallel=1, replicas=2))
    sim.settle()
    assert sorted(r.shards[0].node for r in sim.state.replicas.values()) == ["a", "b"]
    sim.drain("a")
    sim.change(profile("m", tensor_parallel=1, replicas=4))
    placed = replacements(sim.leader())
    assert [p.replaces != "" for p in placed] == [True, False, False]
    on = [r.shards[0].node for r in sim.state.replicas.values() if r.shards[0].node != "a"]
    assert sorted(on) == ["b", "b", "c", "c"]

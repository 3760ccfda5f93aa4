"""A lost node that comes back by heartbeat alone: its retired replicas' engines are orphans.

A node declared lost is often only cut off (a partition, a stalled agent, the log itself
unavailable) and its engines keep running. It may come back without a registration
report (its agent never reconnected: only its heartbeats had stopped reaching the
leader). The GPUs of the replicas retired meanwhile must not look free then: they stay
orphans of the node, placement avoids them, and the reconciler stops them.
Found by tests/e2e (a SIGSTOPped agent, then SIGCONT): the next replica placed on those
GPUs was refused by the agent ("GPU 0 is already used by another shard"), in a loop.
"""

from __future__ import annotations

from llmgw.core import events, state
from llmgw.core.reconcile import ReconcileConfig

from .scenarios import Sim, fabric, profile


def kinds(decisions: list[events.Event]) -> list[str]:
    return [type(d).__name__ for d in decisions]


def lost_and_back() -> tuple[Sim, state.ReplicaState, str]:
    sim = Sim(config=ReconcileConfig(unreachable_after_s=10, lost_after_s=60))
    sim.register("a", fabrics=[fabric("ib-a", ["mlx5_0", "mlx5_1"])])
    sim.register("b", fabrics=[fabric("ib-a", ["mlx5_2", "mlx5_3"])])
    sim.declare(profile("m", tensor_parallel=4))
    sim.settle()
    (r,) = sim.state.replicas.values()
    dead = r.shards[0].node
    sim.silent.add(dead)
    sim.advance(11)
    assert kinds(sim.step()) == ["NodeUnreachable"]
    sim.advance(61)
    assert kinds(sim.step()) == ["NodeLost"]
    replaced = sim.settle()
    assert "ReplicaPlaced" in kinds(replaced)
    assert sim.rejected == []
    return sim, r, dead


def test_a_lost_nodes_retired_shards_become_orphans_holding_their_gpus() -> None:
    sim, r, dead = lost_and_back()
    node = sim.state.nodes[dead]
    assert r.id not in sim.state.replicas  # released from the replica's point of view
    assert [(o.replica_id, o.generation, o.gpus) for o in node.orphans] == [
        (r.id, r.generation, r.shards[0].gpus)
    ]
    assert not any(g in node.holders for g in r.shards[0].gpus)
    # No StopShard while the node is lost: nobody would hear it.
    assert sim.settle() == []


def test_back_by_heartbeat_alone_the_orphan_is_stopped_and_its_gpus_avoided_until() -> None:
    sim, r, dead = lost_and_back()
    gpus = r.shards[0].gpus
    sim.silent.discard(dead)
    sim.heartbeat(dead)
    assert kinds(sim.step()) == ["NodeRecovered"]
    stop = sim.step()
    assert kinds(stop) == ["StopShard"]
    cmd = stop[0]
    assert isinstance(cmd, events.StopShard)
    assert (cmd.node, cmd.replica_id, cmd.generation) == (dead, r.id, r.generation)
    assert sim.step() == []  # sent once

    # A model wanting a whole node: only the recovered node could host it, and half of
    # its GPUs are still held by the orphan's engine.
    sim.declare(profile("big", tensor_parallel=8))
    assert "ReplicaPlaced" not in kinds(sim.settle())
    # The agent stops the engine and says so: the GPUs are free, the big model lands.
    assert sim.status(dead, r.id, r.generation, 0, "stopped") is None
    assert sim.state.nodes[dead].orphans == []
    placed = [d for d in sim.settle() if isinstance(d, events.ReplicaPlaced)]
    assert [p.shards[0].node for p in placed] == [dead]
    assert set(gpus) <= set(placed[0].shards[0].gpus)
    assert sim.rejected == []


def test_a_registration_report_on_return_settles_the_orphans_instead() -> None:
    sim, _, dead = lost_and_back()
    sim.silent.discard(dead)
    # The agent restarted meanwhile and its engine is gone: it reports nothing running.
    sim.register(dead, fabrics=[fabric("ib-a", ["mlx5_0", "mlx5_1"])], shards=[])
    assert sim.state.nodes[dead].orphans == []
    assert "StopShard" not in kinds(sim.settle())


def test_the_fold_with_orphans_is_deterministic() -> None:
    sim, _, _ = lost_and_back()
    replay, rejected = state.fold_records(sim.durable_records())
    assert rejected == []
    assert state.digest(replay) == state.digest(sim.state)

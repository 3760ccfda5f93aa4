"""Property: a drain places exactly one replacement per drained replica, in any topology.

Random fleets (node count, GPUs per node, which nodes exist when the model is first
placed, so that any share of the replicas can sit on the drained node) and a random
model; draining one node must place one replica per replica it held, each naming that
replica, never one more (retired as surplus a pass later: a model load thrown away),
and the model ends with the replicas it wants, none of them on the drained node.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core import events
from llmgw.core.reconcile import ReconcileConfig

from .scenarios import Sim, profile

CONFIG = ReconcileConfig(shard_drain_s=5)


@settings(max_examples=60, deadline=None)
@given(
    gpus=st.lists(st.sampled_from([2, 4, 8]), min_size=2, max_size=4),
    early=st.integers(1, 4),
    replicas=st.integers(1, 4),
    tp=st.sampled_from([1, 2]),
    pick=st.integers(0, 3),
)
def test_a_drain_places_one_replacement_per_drained_replica(
    gpus: list[int], early: int, replicas: int, tp: int, pick: int
) -> None:
    nodes = [f"n{i}" for i in range(len(gpus))]
    sim = Sim(config=CONFIG)
    early = min(early, len(nodes))
    for name, count in zip(nodes[:early], gpus[:early], strict=True):
        sim.register(name, count=count)
    sim.declare(profile("m", tensor_parallel=tp, replicas=replicas))
    sim.settle()
    for name, count in zip(nodes[early:], gpus[early:], strict=True):
        sim.register(name, count=count)
    sim.settle()  # replicas that did not fit on the early nodes land on the late ones
    holders = sorted({r.shards[0].node for r in sim.state.replicas.values()})
    if not holders:
        return  # nothing fit anywhere: nothing to drain
    node = holders[pick % len(holders)]
    on_node = sorted(r.id for r in sim.state.replicas.values() if r.shards[0].node == node)
    placed_before = len(sim.state.replicas)
    free_elsewhere = sum(
        (count - sum(1 for _ in sim.state.nodes[n].holders)) // tp
        for n, count in zip(nodes, gpus, strict=True)
        if n != node
    )

    sim.drain(node, grace_s=600)
    decisions = sim.settle()
    decisions += sim.settle(sim.now + CONFIG.shard_drain_s + 1)

    placed = [d for d in decisions if isinstance(d, events.ReplicaPlaced)]
    assert all(p.replaces in on_node for p in placed), placed
    assert len({p.replaces for p in placed}) == len(placed), placed
    retired = [d for d in decisions if isinstance(d, events.ReplicaRetired)]
    assert not [d for d in retired if "surplus" in d.reason], retired
    if free_elsewhere >= len(on_node):
        assert sorted(p.replaces for p in placed) == on_node
        live = sim.state.active_replicas("m")
        assert len(live) == placed_before
        assert all(s.node != node for r in live for s in r.shards)

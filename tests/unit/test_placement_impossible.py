"""What can never be placed says so, and why: a shard larger than any node, a replica
spanning more nodes than the fleet has. Not "7 of 16 free" (which asks for freeing GPUs
that do not exist) nor a fabric to blame."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core import placement
from llmgw.core.placement import Placement, Unplaceable

from .scenarios import Sim, fabric, profile


def fleet(*sizes: int, hcas: bool = True) -> Sim:
    sim = Sim()
    for i, count in enumerate(sizes):
        fabrics = [fabric("ib-a", [f"mlx5_{i}"])] if hcas else []
        assert sim.register(f"n{i}", count=count, fabrics=fabrics) is None
    return sim


def test_a_shard_larger_than_every_node_is_impossible_not_short_of_free_gpus() -> None:
    sim = fleet(8, 8)
    sim.declare(profile("big", tensor_parallel=16))
    exp = placement.explain(sim.state, "big", 0.0)
    assert exp.placement is None
    assert exp.verdict.startswith("unplaceable: never fits this fleet: a shard needs 16 h100-80g")
    assert "the largest node has 8" in exp.verdict
    assert "split it over more nodes" in exp.verdict
    assert "too few free GPUs" not in exp.verdict
    for v in exp.nodes:
        assert v.reason == "too small: has 8 h100-80g, a shard needs 16 of one class on one node"
        assert "free" not in v.reason
    result = placement.place(sim.state, sim.state.models["big"].profile)
    assert isinstance(result, Unplaceable)
    assert result.code == "never fits"


def test_more_nodes_per_replica_than_the_fleet_has_blames_the_fleet_not_the_fabric() -> None:
    sim = fleet(8, 8)
    sim.declare(profile("wide", tensor_parallel=32, nodes=4))
    exp = placement.explain(sim.state, "wide", 0.0)
    assert exp.placement is None
    assert "never fits this fleet: a replica needs 4 nodes with 8 h100-80g each" in exp.verdict
    assert "the fleet has 2 such nodes" in exp.verdict
    assert "fabric" not in exp.verdict.split(";")[0]
    for v in exp.nodes:
        assert not v.reason.startswith("no shared fabric"), v.reason
        assert "the fleet has 2 such nodes" in v.reason


def test_a_busy_fleet_that_could_fit_it_still_says_what_is_free() -> None:
    sim = fleet(8, 8)
    sim.declare(profile("filler", tensor_parallel=4, replicas=4))
    sim.settle()
    result = placement.place(sim.state, profile("m", tensor_parallel=8))
    assert isinstance(result, Unplaceable)
    assert "never fits" not in result.reason
    assert result.code == "too few free GPUs"


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 16), min_size=1, max_size=5),
    per_node=st.integers(1, 16),
    nodes=st.integers(1, 6),
)
def test_impossible_exactly_when_an_idle_fleet_cannot_place_it(
    sizes: list[int], per_node: int, nodes: int
) -> None:
    sim = fleet(*sizes)
    prof = profile("m", tensor_parallel=per_node * nodes, nodes=nodes)
    never = placement.impossible(sim.state, prof)
    result = placement.place(sim.state, prof)
    # Every node idle and healthy on one fabric: only the hardware's size can stop it.
    assert (never is None) == isinstance(result, Placement), (never, result)
    if never is not None:
        assert isinstance(result, Unplaceable)
        assert result.reason.startswith(never)

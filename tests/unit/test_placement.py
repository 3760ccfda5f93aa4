"""Placement rules, one table row per rule, and explain's operator language."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.core import events, placement
from llmgw.core.inventory import Gpu
from llmgw.core.placement import Placement, Unplaceable

from .scenarios import Sim, fabric, gpus, profile


def sim_with(*nodes: tuple[str, dict[str, Any]]) -> Sim:
    sim = Sim()
    for name, kw in nodes:
        assert sim.register(name, **kw) is None
    return sim


def hold(sim: Sim, node: str, gpu_list: tuple[int, ...], model: str = "filler") -> None:
    """Occupy GPUs with a replica of a throwaway model."""
    if model not in sim.state.models:
        sim.declare(profile(model, replicas=0, gpu_class=""))
    port = 8700 + 2 * len(sim.state.replicas)
    reason = sim.append(
        events.ReplicaPlaced(
            id=sim.eid(),
            ts=sim.now,
            epoch=sim.epoch,
            replica_id=f"hold-{node}-{port}",
            model=model,
            shards=(events.ShardAssignment(shard=0, node=node, gpus=gpu_list, port=port),),
        )
    )
    assert reason is None, reason


def where(result: Placement | Unplaceable) -> list[tuple[str, tuple[int, ...]]]:
    assert isinstance(result, Placement), result
    return [(s.node, s.gpus) for s in result.shards]


def test_tp_group_stays_in_one_nvlink_domain_best_fit() -> None:
    # Domain 0 has 4 free, domain 1 has only 2 free after a holder: TP2 fits best in domain 1.
    sim = sim_with(("a", {"per_domain": 4}))
    hold(sim, "a", (4, 5))
    assert where(placement.place(sim.state, profile("m", tensor_parallel=2))) == [("a", (6, 7))]
    assert where(placement.place(sim.state, profile("m", tensor_parallel=4))) == [
        ("a", (0, 1, 2, 3))
    ]


def test_a_node_where_the_group_fits_a_domain_beats_one_where_it_spans_pcie() -> None:
    sim = sim_with(("a-pcie", {"per_domain": None}), ("b-nvl", {"per_domain": 4}))
    result = placement.place(sim.state, profile("m", tensor_parallel=4))
    assert where(result) == [("b-nvl", (0, 1, 2, 3))]
    assert isinstance(result, Placement)
    assert result.nvlink_fit


def test_a_group_spans_pcie_when_no_domain_fits_anywhere() -> None:
    sim = sim_with(("a", {"per_domain": 2}))
    result = placement.place(sim.state, profile("m", tensor_parallel=4))
    assert where(result) == [("a", (0, 1, 2, 3))]
    assert isinstance(result, Placement)
    assert not result.nvlink_fit
    sim.declare(profile("m", tensor_parallel=4))
    text = placement.explain(sim.state, "m", 0.0).render()
    assert "NVLink domain too small" in text


def test_replicas_of_a_model_spread_across_nodes() -> None:
    sim = sim_with(("a", {}), ("b", {}), ("c", {}))
    sim.declare(profile("m", tensor_parallel=2, replicas=3))
    results = placement.place_many(sim.state, sim.state.models["m"].profile, 3)
    assert sorted(node for r in results for node, _ in where(r)) == ["a", "b", "c"]


def test_ties_break_by_fewest_gpus_left_then_name() -> None:
    sim = sim_with(("b", {}), ("a", {}), ("c", {}))
    hold(sim, "c", (0, 1, 2, 3, 4, 5))
    # c has 2 left: the tightest fit wins, keeping whole nodes free for big models.
    assert where(placement.place(sim.state, profile("m", tensor_parallel=2))) == [("c", (6, 7))]
    hold(sim, "c", (6, 7))
    assert where(placement.place(sim.state, profile("m", tensor_parallel=2))) == [("a", (0, 1))]


def test_unhealthy_gpus_are_skipped_and_explained() -> None:
    sim = sim_with(("a", {"count": 4, "per_domain": 4, "unhealthy": [2]}))
    sim.declare(profile("m", tensor_parallel=4))
    result = placement.place(sim.state, sim.state.models["m"].profile)
    assert isinstance(result, Unplaceable)
    assert result.nodes["a"] == "3 of 4 h100-80g free; GPU 2 unhealthy: uncorrected ECC errors (2)"
    assert where(placement.place(sim.state, profile("m", tensor_parallel=2))) == [("a", (0, 1))]


def test_a_gpu_with_foreign_memory_is_unhealthy() -> None:
    sim = Sim()
    g = gpus("h100-80g", 2, per_domain=2)
    g = (g[0], Gpu(**{**_fields(g[1]), "foreign_memory_mib": 512}))
    sim.register("a", gpu_list=g)
    result = placement.place(sim.state, profile("m", tensor_parallel=2))
    assert isinstance(result, Unplaceable)
    assert "GPU 1 unhealthy: 512 MiB held by a foreign process" in result.nodes["a"]


def _fields(g: Gpu) -> dict[str, Any]:
    return {f: getattr(g, f) for f in g.__struct_fields__}


@pytest.mark.parametrize(
    ("setup", "reason", "code"),
    [
        (lambda s: s.cordon("a", "bad fan"), "cordoned (bad fan)", "cordoned"),
        (lambda s: s.drain("a"), "draining", "draining"),
        (
            lambda s: s.liveness("a", events.NodeUnreachable),
            "unreachable (last heartbeat",
            "unreachable",
        ),
        (lambda s: s.liveness("a", events.NodeLost), "lost", "lost"),
    ],
    ids=["cordoned", "draining", "unreachable", "lost"],
)
def test_unusable_nodes_are_rejected_in_operator_language(
    setup: Any, reason: str, code: str
) -> None:
    sim = sim_with(("a", {}))
    setup(sim)
    sim.declare(profile("m"))
    result = placement.place(sim.state, sim.state.models["m"].profile)
    assert isinstance(result, Unplaceable)
    assert result.code == code
    explanation = placement.explain(sim.state, "m", sim.now + 42)
    (verdict,) = explanation.nodes
    assert not verdict.ok
    assert verdict.reason.startswith(reason), verdict.reason


def test_wrong_class_and_fp8_are_explained() -> None:
    sim = sim_with(("a100", {"gpu_class": "a100-80g"}), ("l40s", {"gpu_class": "l40s-45g"}))
    sim.declare(profile("m", gpu_class="h100-80g"))
    text = placement.explain(sim.state, "m", 0.0).render()
    assert "wrong class: has a100-80g, needs h100-80g" in text
    # No class given: any class, but fp8 only where compute capability >= 8.9.
    sim.declare(profile("f", gpu_class="", dtype="fp8"))
    exp = placement.explain(sim.state, "f", 0.0)
    by_node = {v.node: v for v in exp.nodes}
    assert by_node["a100"].reason == "dtype fp8 needs compute capability 8.9, a100-80g has 8.0"
    assert by_node["l40s"].ok


def test_a_replica_never_mixes_gpu_classes_on_a_mixed_node() -> None:
    sim = Sim()
    mixed = gpus("rtx4090-24g", 1, node="m") + tuple(
        Gpu(**{**_fields(g), "index": g.index + 1}) for g in gpus("l40s-45g", 1, node="m")
    )
    sim.register("m", gpu_list=mixed)
    result = placement.place(sim.state, profile("x", tensor_parallel=2, gpu_class=""))
    assert isinstance(result, Unplaceable)
    # One GPU of each class: a two-GPU replica can never fit, whatever is freed.
    assert result.nodes["m"].startswith("too small: has 1 l40s-45g, 1 rtx4090-24g")


def test_multi_node_uses_one_shared_fabric_and_one_class() -> None:
    sim = sim_with(
        ("a", {"fabrics": [fabric("ib-1", ["mlx5_0"])]}),
        ("b", {"fabrics": [fabric("ib-2", ["mlx5_0"])]}),
        ("c", {"fabrics": [fabric("ib-2", ["mlx5_0"])]}),
        ("d", {"fabrics": [fabric("ib-1", ["mlx5_0"])], "gpu_class": "a100-80g"}),
    )
    result = placement.place(sim.state, profile("m", tensor_parallel=8, nodes=2))
    assert where(result) == [("b", tuple(range(4))), ("c", tuple(range(4)))]
    assert isinstance(result, Placement)
    assert result.fabric == "ib-2"


def test_multi_node_without_a_shared_fabric_is_explained() -> None:
    sim = sim_with(
        ("a", {"fabrics": [fabric("ib-1")]}),
        ("b", {"fabrics": [fabric("ib-2")]}),
        ("c", {"fabrics": [fabric("ib-3", [])]}),
    )
    sim.declare(profile("m", tensor_parallel=16, nodes=2))
    exp = placement.explain(sim.state, "m", 0.0)
    by_node = {v.node: v.reason for v in exp.nodes}
    assert by_node["a"].startswith("no shared fabric: a replica needs 2 nodes with 8 free h100-80g")
    assert by_node["c"] == "no shared fabric: this node is on no RDMA fabric with HCAs"
    assert exp.placement is None
    assert exp.verdict.startswith("unplaceable: no node offers 2 nodes on one fabric")


def test_ports_are_distinct_per_node_and_skip_the_head_port() -> None:
    sim = sim_with(("a", {}))
    sim.declare(profile("m", tensor_parallel=1, replicas=3))
    results = placement.place_many(sim.state, sim.state.models["m"].profile, 3)
    ports = [r.shards[0].port for r in results if isinstance(r, Placement)]
    assert ports == [8100, 8102, 8104]


def test_place_many_stops_at_the_first_unplaceable_and_never_reuses_a_gpu() -> None:
    sim = sim_with(("a", {}), ("b", {"count": 4, "per_domain": 4}))
    sim.declare(profile("m", tensor_parallel=4, replicas=5))
    results = placement.place_many(sim.state, sim.state.models["m"].profile, 5)
    assert [type(r).__name__ for r in results] == ["Placement"] * 3 + ["Unplaceable"]
    used = [
        (s.node, g) for r in results if isinstance(r, Placement) for s in r.shards for g in s.gpus
    ]
    assert len(used) == len(set(used)) == 12


def test_explain_an_undeclared_model_says_what_to_do() -> None:
    exp = placement.explain(Sim().state, "nope", 0.0)
    assert "is not declared" in exp.verdict
    assert "llmgw ctl apply -f models.yaml" in exp.verdict


def test_explain_names_the_landing_spot() -> None:
    sim = sim_with(("a", {}), ("b", {}))
    sim.declare(profile("m", tensor_parallel=4))
    exp = placement.explain(sim.state, "m", 0.0)
    assert exp.verdict == "a new replica lands on a"
    assert exp.nodes[0].reason == "lands here: GPUs 0-3 (h100-80g, port 8100)"
    assert exp.nodes[1].reason == "could host it; another node ranks first"
    assert exp.render().splitlines()[0] == "model m: a new replica lands on a"


def test_the_code_is_chosen_where_the_reason_is_written_not_read_from_its_words() -> None:
    # An operator's words may name another reason; the label stays the cordon.
    sim = sim_with(("a", {}), ("b", {}))
    sim.cordon("a", "lost its fan, unreachable by ssh")
    sim.cordon("b", "too few free GPUs, they say")
    result = placement.place(sim.state, profile("m"))
    assert isinstance(result, Unplaceable)
    assert result.code == "cordoned"
    assert result.reason.endswith("(cordoned: 2)")


def test_codes_of_a_replica_nobody_can_take() -> None:
    empty = placement.place(Sim().state, profile("m"))
    assert isinstance(empty, Unplaceable)
    assert empty.code == "no nodes"
    bad = placement.place(sim_with(("a", {})).state, profile("m", tensor_parallel=3, nodes=2))
    assert isinstance(bad, Unplaceable)
    assert (bad.code, bad.reason.startswith("the profile's GPU arithmetic")) == ("other", True)
    mixed = sim_with(("b", {"gpu_class": "a100-80g"}), ("c", {"count": 1}), ("d", {"count": 1}))
    result = placement.place(mixed.state, profile("m", tensor_parallel=2))
    assert isinstance(result, Unplaceable)
    # The most common code among the nodes: two are too small for a shard, one has the
    # wrong class.
    assert result.code == "never fits"
    assert result.reason.endswith("(never fits: 2, wrong class: 1)")

"""Many declared models: a declaration's name check, and a pass over models that cannot land.

Every reader folds every declaration, and the leader reconciles every model each second on
its event loop: work per declaration or per pass that grows with the product of the catalog
and the fleet stalls the whole control plane, however few of those models serve anything.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core import events, fleet_metrics, placement, reconcile, refusals, state, views
from llmgw.ctl import catalogfile
from llmgw.ctl.errors import BadInput

from .scenarios import Sim, cluster, fabric, gpus, profile


def _declare(i: int, **kw: Any) -> events.ModelDeclared:
    prof = profile(f"m{i}", replicas=0, aliases=(f"m{i}-a", f"m{i}-b"), **kw)
    return events.ModelDeclared(id=f"d{i}", ts=1.0, operator="alice", profile=prof)


def test_a_declaration_checks_its_names_without_reading_every_other_model(
    names_read: Callable[[], int],
) -> None:
    sim = Sim()
    sim.extend(_declare(i) for i in range(1500))
    assert len(sim.state.models) == 1500
    assert not sim.rejected
    # Reading every other model's names on each declaration: 1500 * 1499 / 2 calls.
    assert names_read() < 10 * 1500


def test_names_stay_taken_and_are_freed_as_models_change() -> None:
    sim = Sim()
    sim.extend(_declare(i) for i in range(3))
    assert "already a name or alias of model 'm1'" in (
        sim.declare(profile("x", aliases=("m1-b",))) or ""
    )
    assert "already a name or alias of model 'm2'" in (
        sim.declare(profile("m2-a", aliases=())) or ""
    )
    # An alias given up by a change, or by a removal, may be taken by another model.
    assert sim.change(profile("m1", replicas=0, aliases=("m1-c",))) is None
    assert sim.declare(profile("x", aliases=("m1-b",))) is None
    assert "model 'm1'" in (sim.declare(profile("y", aliases=("m1-c",))) or "")
    sim.append(events.ModelRemoved(id="rm", ts=2.0, operator="alice", name="m1"))
    assert sim.declare(profile("y", aliases=("m1-c", "m1"))) is None
    # A model may keep its own names across a change.
    assert sim.change(profile("y", aliases=("m1-c", "m1", "z"))) is None


def test_a_restored_or_copied_state_still_knows_every_name() -> None:
    sim = Sim()
    sim.extend(_declare(i) for i in range(3))
    restored = state.decode_snapshot(state.encode_snapshot(sim.state))
    clash = events.ModelDeclared(
        id="c", ts=2.0, operator="alice", profile=profile("x", aliases=("m0-a",))
    )
    assert "model 'm0'" in (state.apply(restored, clash, 100) or "")
    built = state.ClusterState(models=dict(sim.state.models))
    assert "model 'm0'" in (state.apply(built, clash, 100) or "")
    # A state whose models were replaced by hand is read afresh.
    restored.models = {}
    assert state.apply(restored, clash, 101) is None


def _full_fleet(nodes: int) -> Sim:
    sim = Sim()
    sim.extend(cluster(nodes, ts=sim.now))
    sim.declare(profile("base", tensor_parallel=8, replicas=nodes))
    sim.settle()
    assert len(sim.serving("base")) == nodes
    return sim


def _pass_judging_nodes(sim: Sim, monkeypatch: pytest.MonkeyPatch) -> tuple[reconcile.Outcome, int]:
    """One reconcile pass over `sim`, and how many times it judged a node for a shape
    (`placement._why_not`)."""
    judged = 0
    why_not = placement._why_not

    def counted(*args: Any) -> Any:
        nonlocal judged
        judged += 1
        return why_not(*args)

    monkeypatch.setattr(placement, "_why_not", counted)
    return reconcile.reconcile_detail(sim.state, sim.now, epoch=1), judged


def test_a_pass_explains_each_shape_that_cannot_land_once(monkeypatch: pytest.MonkeyPatch) -> None:
    sim = _full_fleet(40)
    shapes = [{"tensor_parallel": 8}, {"tensor_parallel": 2}, {"tensor_parallel": 4, "nodes": 2}]
    waiting = [profile(f"w{i}", **shapes[i % 3]) for i in range(150)]
    for prof in waiting:
        assert sim.declare(prof) is None
    alone = {p.name: placement.place(sim.state, p) for p in waiting}
    outcome, judged = _pass_judging_nodes(sim, monkeypatch)
    assert outcome.decisions == []
    # Each model on its own: the same reason and code as in the pass.
    for name, result in alone.items():
        assert isinstance(result, placement.Unplaceable)
        assert outcome.unplaceable[name] == result.reason
        assert outcome.unplaceable_codes[name] == result.code
    # Judging every node again for each model: 150 x 40 calls.
    assert judged <= 2 * len(shapes) * 40


def test_what_a_pass_placed_is_judged_anew(monkeypatch: pytest.MonkeyPatch) -> None:
    sim = _full_fleet(4)
    sim.register("spare", count=2, per_domain=None)
    sim.settle()
    for name in ("a", "b", "c"):
        assert sim.declare(profile(name, tensor_parallel=2)) is None
    outcome = reconcile.reconcile_detail(sim.state, sim.now, epoch=1)
    placed = [d for d in outcome.decisions if isinstance(d, events.ReplicaPlaced)]
    assert [d.model for d in placed] == ["a"]
    assert set(outcome.unplaceable) == {"b", "c"}
    assert "too few free GPUs" in outcome.unplaceable["b"]


class _CountedReads(dict[str, state.ReplicaState]):
    """The replicas, counting how many a pass reads through `values()`."""

    reads = 0

    def values(self) -> Any:
        for r in super().values():
            self.reads += 1
            yield r


def _reads_of_a_pass(sim: Sim) -> tuple[int, list[events.Event]]:
    replicas = _CountedReads(sim.state.replicas)
    sim.state.replicas = replicas
    outcome = reconcile.reconcile_detail(sim.state, sim.now, epoch=1)
    return replicas.reads, outcome.decisions


@pytest.mark.parametrize("change", ["engine_args", "shrink"])
def test_a_pass_over_a_changed_model_reads_each_replica_a_few_times(change: str) -> None:
    sim = Sim()
    sim.extend(cluster(20, ts=sim.now))
    sim.declare(profile("small", replicas=160))
    sim.settle()
    assert len(sim.serving("small")) == 160
    args: dict[str, Any] = {"engine_args": ("--x",)}
    if change == "shrink":
        args["replicas"] = 1
    assert sim.change(profile("small", **{"replicas": 160, **args})) is None
    reads, decisions = _reads_of_a_pass(sim)
    if change == "shrink":
        retired = [d for d in decisions if isinstance(d, events.ReplicaRetired)]
        assert len(retired) == 159
    # Counting the model's replicas anew for each of them: 160 x 160 reads.
    assert reads <= 10 * 160


def test_the_models_view_and_the_fleet_gauges_read_each_replica_a_few_times() -> None:
    sim = Sim()
    sim.extend(cluster(10, ts=sim.now))
    for i in range(80):
        sim.declare(profile(f"m{i}", replicas=1))
    sim.settle()
    assert len(sim.state.replicas) == 80
    replicas = _CountedReads(sim.state.replicas)
    sim.state.replicas = replicas
    rows = views.model_rows(sim.state, sim.now, why={})
    gauges = fleet_metrics.families(sim.state, {})
    assert [r["replicas_serving"] for r in rows] == [1] * 80
    active = next(f for f in gauges if f.name == "llmgw_fleet_model_replicas_active")
    assert [v for _, v in active.samples] == [1.0] * 80
    # Reading every replica once per model: 80 x 80 reads for each.
    assert replicas.reads <= 10 * 80


def _odd_fleet() -> Sim:
    """Full H100 nodes on a fabric, and nodes of every other kind a refusal counts."""
    sim = _full_fleet(12)
    sim.register("l40s", gpu_class="l40s-45g", count=4, per_domain=None)
    sim.register("bare", count=0)
    sim.register("mixed", gpu_list=gpus("a100-80g", 2, node="mixed") + gpus("rtx4090-24g", 1))
    sim.register("away", gpu_class="a100-80g", count=16)
    sim.settle()
    assert sim.cordon("away") is None
    return sim


SHAPES: list[dict[str, Any]] = [
    *({"tensor_parallel": tp} for tp in (9, 16, 24, 40)),
    *({"tensor_parallel": tp, "gpu_class": ""} for tp in (17, 32)),
    *({"gpu_class": f"zz{i}-80g"} for i in range(6)),
    {"gpu_class": "l40s-45g", "tensor_parallel": 8},
    {"gpu_class": "a100-80g", "tensor_parallel": 16},  # only on the cordoned node
    {"tensor_parallel": 32, "nodes": 2},
    {"tensor_parallel": 2, "nodes": 2, "gpu_class": "zz-80g"},
    {"tensor_parallel": 4, "gpu_class": "", "nodes": 2},
]


def test_shapes_no_node_could_host_are_refused_without_judging_each_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sim = _odd_fleet()
    waiting = [profile(f"w{i}", **shape) for i, shape in enumerate(SHAPES)]
    for prof in waiting:
        assert sim.declare(prof) is None
    judged = {
        p.name: placement._refused(
            sim.state, p, placement._reasons(sim.state, placement.Capacity(sim.state), p)
        )
        for p in waiting
    }
    outcome, calls = _pass_judging_nodes(sim, monkeypatch)
    for name, result in judged.items():
        assert (outcome.unplaceable[name], outcome.unplaceable_codes[name]) == (
            result.reason,
            result.code,
        ), name
    # Only two shapes need the nodes judged: 16 A100s fit the cordoned node, 2 GPUs of a
    # class fit many. Every other is beyond each registered node's GPUs.
    assert calls <= 2 * len(sim.state.nodes)


def test_a_long_models_file_is_checked_in_the_time_of_its_names(
    names_read: Callable[[], int],
) -> None:
    entries = [{"name": f"m{i}", "engine": "sim", "aliases": [f"m{i}-a"]} for i in range(1500)]
    assert len(catalogfile.parse(json.dumps(entries), "models.json")) == 1500
    assert names_read() < 10 * 1500
    entries.append({"name": "x", "engine": "sim", "aliases": ["m7-a"]})
    with pytest.raises(BadInput, match="'m7-a' is already a name or alias of model 'm7'"):
        catalogfile.parse(json.dumps(entries), "models.json")
    entries[-1] = {"name": "x", "engine": "sim", "aliases": ["m9"]}  # another model's name
    with pytest.raises(BadInput, match="'m9' is already a name or alias of model 'm9'"):
        catalogfile.parse(json.dumps(entries), "models.json")
    with pytest.raises(BadInput, match="listed twice"):
        catalogfile.parse(json.dumps([*entries[:3], entries[1]]), "models.json")


_NODE = st.fixed_dictionaries(
    {
        "gpu_class": st.sampled_from(["h100-80g", "a100-80g", "l40s-45g"]),
        "count": st.integers(0, 16),
        "fabric": st.booleans(),
        "cordoned": st.booleans(),
    }
)


@settings(max_examples=300, deadline=None)
@given(
    nodes=st.lists(_NODE, min_size=1, max_size=5),
    gpu_class=st.sampled_from(["", "h100-80g", "a100-80g", "l40s-45g", "zz-80g"]),
    per_node=st.integers(1, 20),
    spread=st.integers(1, 3),
)
def test_the_fleets_summary_refuses_as_judging_every_node_does(
    nodes: list[dict[str, Any]], gpu_class: str, per_node: int, spread: int
) -> None:
    """`refusals.Hardware` words a refusal from the fleet's sizes alone: it must say what the
    nodes judged one by one say, whatever the fleet and the shape."""
    sim = Sim()
    for i, n in enumerate(nodes):
        fabrics = (fabric(),) if n["fabric"] else ()
        sim.register(f"n{i}", gpu_class=n["gpu_class"], count=n["count"], per_domain=None,
                     fabrics=fabrics)  # fmt: skip
        if n["cordoned"]:
            assert sim.cordon(f"n{i}") is None
    prof = profile("w", gpu_class=gpu_class, tensor_parallel=per_node * spread, nodes=spread)
    cap = placement.Capacity(sim.state)
    summary = refusals.Hardware(sim.state, cap.nodes, cap.rejected.codes).beyond_every_node(prof)
    if summary is None:
        return
    judged = placement._refused(sim.state, prof, placement._reasons(sim.state, cap, prof))
    assert summary == (judged.code, judged.reason)

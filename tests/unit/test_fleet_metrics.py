"""The fleet's state as metrics (llmgw.core.fleet_metrics): exact figures for a fleet the
in-memory leader settled, and invariants for any folded log (Hypothesis)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core import events, fleet_metrics, state, views

from .scenarios import Sim, profile
from .strategies import any_event


def by_name(fams: list[fleet_metrics.Family]) -> dict[str, dict[tuple[str, ...], float]]:
    return {f.name: dict(f.samples) for f in fams}


def settled(replicas: int = 2, tp: int = 2) -> Sim:
    sim = Sim()
    for n in ("node-a", "node-b", "node-c"):
        sim.register(n)
    sim.declare(profile("m", tensor_parallel=tp, replicas=replicas))
    sim.settle()
    return sim


def test_a_settled_fleet_reads_as_it_is() -> None:
    sim = settled()
    got = by_name(fleet_metrics.families(sim.state, {}))
    assert got["llmgw_fleet_nodes"] == {("ready",): 3, ("unreachable",): 0, ("lost",): 0}
    assert got["llmgw_fleet_gpus"] == {
        ("h100-80g", "free"): 20,
        ("h100-80g", "used"): 4,
        ("h100-80g", "unhealthy"): 0,
    }
    assert got["llmgw_fleet_replicas"][("m", "serving")] == 2
    assert sum(got["llmgw_fleet_replicas"].values()) == 2
    assert got["llmgw_fleet_model_replicas_desired"] == {("m",): 2}
    assert got["llmgw_fleet_model_replicas_active"] == {("m",): 2}
    assert got["llmgw_fleet_model_replicas_serving"] == {("m",): 2}
    assert got["llmgw_fleet_model_unplaceable"] == {}
    assert got["llmgw_fleet_node_liveness"][("node-a", "ready")] == 1
    assert got["llmgw_fleet_node_liveness"][("node-a", "lost")] == 0


def test_flags_liveness_and_an_unplaceable_model_show() -> None:
    sim = settled()
    sim.cordon("node-a", "maintenance")
    sim.drain("node-b")
    sim.liveness("node-c", events.NodeLost)
    sim.declare(profile("huge", tensor_parallel=8, replicas=5))
    codes = views.unplaceable_codes(sim.state, sim.now)
    got = by_name(fleet_metrics.families(sim.state, codes))
    assert got["llmgw_fleet_nodes_flagged"] == {
        ("cordoned",): 1,
        ("draining",): 1,
        ("quarantined",): 0,
    }
    assert got["llmgw_fleet_nodes"][("lost",)] == 1
    assert got["llmgw_fleet_node_liveness"][("node-c", "lost")] == 1
    assert got["llmgw_fleet_node_liveness"][("node-c", "ready")] == 0
    assert set(got["llmgw_fleet_model_unplaceable"]) == set(codes.items())
    assert "huge" in codes
    assert codes["huge"] != "other"
    # An unplaceable verdict for a model no longer declared is not exported.
    assert (
        by_name(fleet_metrics.families(sim.state, {"gone": "no nodes"}))[
            "llmgw_fleet_model_unplaceable"
        ]
        == {}
    )


@settings(max_examples=150, deadline=None)
@given(st.lists(any_event, max_size=40))
def test_any_folded_log_exports_consistent_figures(log: list[events.Event]) -> None:
    folded = state.ClusterState()
    for seq, event in enumerate(log, start=1):
        state.apply(folded, event, seq)
    fams = fleet_metrics.families(folded, {})
    for fam in fams:
        keys = [labels for labels, _ in fam.samples]
        assert len(keys) == len(set(keys)), fam.name  # no series twice
        assert all(len(k) == len(fam.labels) for k in keys), fam.name
        assert all(v >= 0 for _, v in fam.samples), fam.name
    got = by_name(fams)
    assert sum(got["llmgw_fleet_nodes"].values()) == len(folded.nodes)
    per_node = got["llmgw_fleet_node_liveness"]
    for node in folded.nodes:
        assert sum(v for (n, _), v in per_node.items() if n == node) == 1
    total_gpus = sum(len(n.gpus) for n in folded.nodes.values())
    assert sum(got["llmgw_fleet_gpus"].values()) == total_gpus
    live = [r for r in folded.replicas.values() if not r.retired]
    assert sum(got["llmgw_fleet_replicas"].values()) == len(live)
    for key, serving in got["llmgw_fleet_model_replicas_serving"].items():
        assert serving <= got["llmgw_fleet_model_replicas_active"][key]


def test_prometheus_targets_list_each_serving_engine_and_the_control_plane() -> None:
    sim = settled()
    secret = "engine-key-that-must-not-leak"
    for r in sim.state.replicas.values():
        for shard in r.shards:
            shard.api_key = secret
    for ep in sim.state.endpoints.values():
        ep.api_key = secret
    groups = views.prometheus_targets(sim.state, "127.0.0.1:9090", "control-a")
    assert secret not in json.dumps(groups)
    engines = [g for g in groups if g["labels"]["job"] == "llmgw-engine"]
    serving = [r for r in sim.state.replicas.values() if not r.retired]
    assert len(engines) == sum(1 for r in serving for s in r.shards if s.endpoint)
    assert len(engines) == 2
    for g in engines:
        (target,) = g["targets"]
        host, _, port = target.rpartition(":")
        assert host
        assert port.isdigit()
        replica = sim.state.replicas[g["labels"]["replica"]]
        assert g["labels"]["model"] == replica.model == "m"
        assert g["labels"]["node"] in sim.state.nodes
        assert g["labels"]["engine"] == "vllm"
    assert groups[-1] == {
        "targets": ["127.0.0.1:9090"],
        "labels": {"job": "llmgw-control", "control": "control-a"},
    }


@given(st.text(max_size=40))
def test_an_endpoint_without_a_port_is_no_target(url: str) -> None:
    got = views._host_port(url)
    if got is not None:
        assert got.rpartition(":")[2].isdigit()
        assert "/" not in got

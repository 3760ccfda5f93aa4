"""The fleet's state as metrics (llmgw.core.fleet_metrics): exact figures for a fleet the
in-memory leader settled, and invariants for any folded log (Hypothesis)."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw import listeners
from llmgw.control.scaler import REPORT_FORGET_S, Scaler
from llmgw.core import events, fleet_metrics, loadreport, state, subjects, views

from . import scenarios
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


def register_with_metrics(sim: Sim, node: str, metrics: str) -> None:
    ev = scenarios.registered(node, ts=sim.now)
    sim.append(msgspec.structs.replace(ev, id=sim.eid("reg"), metrics=metrics))


def test_agents_and_routers_are_targets_with_their_names() -> None:
    sim = settled()
    register_with_metrics(sim, "node-a", "node-a.internal:9101")
    register_with_metrics(sim, "node-b", "[fd00::2]:9101")
    groups = views.prometheus_targets(
        sim.state, "127.0.0.1:9090", "control-a", {"router-1": "10.0.0.5:9090"}
    )
    agents = [g for g in groups if g["labels"]["job"] == "llmgw-agent"]
    assert [(g["targets"], g["labels"]) for g in agents] == [
        (["node-a.internal:9101"], {"job": "llmgw-agent", "node": "node-a", "liveness": "ready"}),
        (["[fd00::2]:9101"], {"job": "llmgw-agent", "node": "node-b", "liveness": "ready"}),
    ]
    routers = [g for g in groups if g["labels"]["job"] == "llmgw-router"]
    assert routers == [
        {"targets": ["10.0.0.5:9090"], "labels": {"job": "llmgw-router", "router": "router-1"}}
    ]
    # A node without an admin listener (node-c) is no agent target; a re-registration
    # without one takes its target away.
    register_with_metrics(sim, "node-a", "")
    groups = views.prometheus_targets(sim.state, "127.0.0.1:9090", "control-a")
    assert [g["labels"]["node"] for g in groups if g["labels"]["job"] == "llmgw-agent"] == [
        "node-b"
    ]


HOSTILE = [
    "http://evil:80",  # a URL, not host:port
    "evil:80/metrics?x=1",  # a path smuggled in
    "evil",  # no port
    "evil:0",
    "evil:65536",
    "evil:99999",
    "ev il:80",
    "evil:80\nother:80",
    "evil:80,other:80",
    ":80",
    "-evil:80",
    "[::1:80",
    "evil:8o",
    "évil:80",
]


@given(st.one_of(st.sampled_from(HOSTILE), st.text(max_size=60)))
def test_a_target_a_node_or_router_writes_is_host_port_or_nothing(where: str) -> None:
    """Nodes write their own registration and routers their reports: whatever they put
    there, the discovery hands Prometheus only a plain host:port."""
    sim = settled()
    register_with_metrics(sim, "node-a", where)
    groups = views.prometheus_targets(sim.state, "c:1", "c", {"router-1": where})
    listed = [
        t
        for g in groups
        if g["labels"]["job"] in ("llmgw-agent", "llmgw-router")
        for t in g["targets"]
    ]
    for target in listed:
        host, _, port = target.rpartition(":")
        assert host
        assert port.isdigit()
        assert 0 < int(port) < 65536
        assert not set(target) & set("/?#@,; \t\r\n")
        assert target == where
    if where in HOSTILE:
        assert listed == []


def test_the_routers_named_are_those_that_reported_in_the_last_minute() -> None:
    scaler = Scaler()
    report = loadreport.LoadReport(ts=1000.0, metrics="10.0.0.5:9090")
    scaler.note(subjects.router_signals("router-1", 0), report)
    scaler.note(subjects.router_signals("router-1", 1), report)
    scaler.note(subjects.router_signals("router-2", 0), msgspec.structs.replace(report, ts=900.0))
    scaler.note(subjects.router_signals("router-3", 0), msgspec.structs.replace(report, metrics=""))
    scaler.note(subjects.node_signals("node-a"), report)  # an agent's: not a router
    assert scaler.router_targets(1001.0) == {"router-1": "10.0.0.5:9090"}
    assert scaler.router_targets(1000.0 + REPORT_FORGET_S + 1) == {}


@pytest.mark.parametrize(
    ("url", "reachable_as", "want"),
    [
        ("", "node-a", ""),
        ("http://127.0.0.1:9101", "node-a", "127.0.0.1:9101"),
        ("http://0.0.0.0:9101", "node-a.internal", "node-a.internal:9101"),
        ("http://[::]:9101", "fd00::2", "[fd00::2]:9101"),
        ("http://[fd00::3]:9101", "node-a", "[fd00::3]:9101"),
    ],
)
def test_a_listeners_scrape_target(url: str, reachable_as: str, want: str) -> None:
    assert listeners.scrape_target(url, reachable_as) == want

"""Whose word an engine's figures are: a node's agent owns its engines and routers only
observe them (llmgw.core.loadreport, through llmgw.control.scaler); no report is dated
later than the server stored it; and `llmgw ctl explain-scaling` shows the leader's
signals, computed the same way."""

from __future__ import annotations

import msgspec
from hypothesis import assume, given
from hypothesis import strategies as st

from llmgw.control.scaler import REPORT_MAX_AGE_S as MAX_AGE_S
from llmgw.control.scaler import Scaler
from llmgw.core import events, loadreport, subjects
from llmgw.core.autoscale import Autoscale
from llmgw.core.loadreport import EndpointLoad, LoadReport, ModelTraffic
from llmgw.core.profile import ModelProfile
from llmgw.core.state import ClusterState, Endpoint, apply
from llmgw.ctl import scaling as scaling_view

NOW = 100.0
NODE_A = subjects.node_signals("node-a")

Figures = tuple[float, float, float]
"""An engine's queue, running requests and KV-cache usage."""


def _fleet() -> ClusterState:
    """Model m on node-a's e1 (node-a reports), model u on node-b's e2 (node-b is silent)."""
    state = ClusterState()
    for i, name in enumerate(("m", "u"), 1):
        profile = ModelProfile(name=name, engine="sim", autoscale=Autoscale(
            min=1, max=8, running_per_replica=4.0))  # fmt: skip
        event = events.ModelDeclared(id=f"d{i}", ts=1.0, operator="a", profile=profile)
        assert apply(state, event, i) is None
    state.endpoints["e1"] = Endpoint(replica_id="e1", model="m", url="http://a:1", node="node-a")
    state.endpoints["e2"] = Endpoint(replica_id="e2", model="u", url="http://b:1", node="node-b")
    return state


def _load(endpoint: str, model: str, figures: Figures) -> EndpointLoad:
    queue, running, kv = figures
    return EndpointLoad(endpoint=endpoint, model=model, queue=queue, running=running, kv_usage=kv)


def _engine_signals(scaler: Scaler, state: ClusterState, model: str) -> Figures:
    got = scaler.signals(state, NOW)[model]
    return got.waiting, got.running, got.kv_usage


def test_a_router_dating_its_report_ahead_cannot_override_a_nodes_own_figures() -> None:
    # The router's report is dated 5 s ahead (still fresh): "a later report wins" let it
    # show the leader node-a's engine saturated, or idle, whatever node-a measured.
    state = _fleet()
    scaler = Scaler()
    scaler.note(NODE_A, LoadReport(ts=NOW, endpoints=(_load("e1", "m", (0.0, 2.0, 0.25)),)))
    liar = LoadReport(ts=NOW + MAX_AGE_S, endpoints=(_load("e1", "m", (500.0, 0.0, 1.0)),))
    scaler.note(subjects.router_signals("r", 0), liar, state=state)
    assert _engine_signals(scaler, state, "m") == (0.0, 2.0, 0.25)


figures = st.tuples(
    st.integers(0, 10_000).map(float),
    st.integers(0, 10_000).map(float),
    st.integers(0, 100).map(lambda n: n / 100),
)
offsets = st.floats(-MAX_AGE_S, MAX_AGE_S)
router_subjects = st.builds(subjects.router_signals, st.sampled_from(["r1", "r2", "r3"]),
                            st.integers(0, 3))  # fmt: skip


@given(
    own=figures,
    claimed_for_node_b=figures,
    node_offset=offsets,
    routers=st.dictionaries(router_subjects, st.tuples(offsets, figures, figures), max_size=8),
)
def test_a_fresh_report_from_the_owning_node_decides_its_engines_figures(
    own: Figures,
    claimed_for_node_b: Figures,
    node_offset: float,
    routers: dict[str, tuple[float, Figures, Figures]],
) -> None:
    # Which of two equally dated readings is "later" is not defined: dates as the reports
    # carry them (NOW + 1e-117 is NOW), distinct.
    times = [NOW + offset for offset, _, _ in routers.values()]
    assume(len(set(times)) == len(times))
    state = _fleet()
    scaler = Scaler()
    # node-a's report also names node-b's engine: not its own, so never believed.
    scaler.note(NODE_A, LoadReport(ts=NOW + node_offset, endpoints=(
        _load("e1", "m", own), _load("e2", "u", claimed_for_node_b))))  # fmt: skip
    for subject, (offset, on_e1, on_e2) in routers.items():
        report = LoadReport(ts=NOW + offset, endpoints=(_load("e1", "m", on_e1),
                                                        _load("e2", "u", on_e2)))  # fmt: skip
        scaler.note(subject, report, state=state)
    assert _engine_signals(scaler, state, "m") == own
    # node-b reports nothing: its engine's figures are still the latest router's reading.
    latest = max(routers.values(), default=None)
    assert _engine_signals(scaler, state, "u") == (latest[2] if latest else (0.0, 0.0, 0.0))


def test_no_report_is_dated_later_than_the_server_stored_it() -> None:
    ahead = LoadReport(ts=NOW + MAX_AGE_S)
    assert loadreport.received(ahead, NOW).ts == NOW
    held_back = LoadReport(ts=NOW - 3.0)  # sent late, by a writer cut off for a while
    assert loadreport.received(held_back, NOW) == held_back


def test_a_router_dating_its_report_ahead_gains_no_precedence_over_other_routers() -> None:
    # Node-b reports nothing, so routers' readings of e2 count: the one stored last
    # wins, not the one that claims the latest date.
    state = _fleet()
    scaler = Scaler()
    liar = LoadReport(ts=NOW + MAX_AGE_S, endpoints=(_load("e2", "u", (900.0, 0.0, 1.0)),))
    honest = LoadReport(ts=NOW, endpoints=(_load("e2", "u", (1.0, 3.0, 0.5)),))
    scaler.note(subjects.router_signals("liar", 0), loadreport.received(liar, NOW - 1.0))
    scaler.note(subjects.router_signals("honest", 0), loadreport.received(honest, NOW))
    assert _engine_signals(scaler, state, "u") == (1.0, 3.0, 0.5)


traffic = st.builds(ModelTraffic, model=st.sampled_from(["m", "u", "gone"]),
                    requests=st.integers(0, 1000), waiting=st.integers(0, 50),
                    ttft_p90_s=st.integers(0, 4000).map(lambda ms: ms / 1000),
                    samples=st.integers(0, 1000))  # fmt: skip
engine_loads = st.builds(_load, st.sampled_from(["e1", "e2", "e9"]), st.sampled_from(["m", "u"]),
                         figures)  # fmt: skip
any_subjects = st.one_of(
    router_subjects, st.builds(subjects.node_signals, st.sampled_from(["node-a", "node-b"]))
)
reports = st.dictionaries(any_subjects, st.builds(
    LoadReport, ts=offsets.map(lambda o: NOW + o), models=st.lists(traffic, max_size=3).map(tuple),
    endpoints=st.lists(engine_loads, max_size=3).map(tuple)), max_size=6)  # fmt: skip


@given(reports)
def test_explain_scaling_shows_the_signals_the_leader_decides_on(
    reports: dict[str, LoadReport],
) -> None:
    # explain-scaling aggregated every report as it came: a node's agent's traffic counted
    # (the leader ignores it), and so did its figures for other nodes' engines.
    state = _fleet()
    scaler = Scaler()
    for subject, report in reports.items():
        scaler.note(subject, report, state=state)
    leader = msgspec.structs.asdict(scaler.signals(state, NOW)["m"])
    shown = scaling_view.explain(state, "m", reports, [], NOW)["signals"]
    assert shown == {k: v for k, v in leader.items() if k != "serving"}


def test_explain_scaling_counts_routers_not_their_worker_processes() -> None:
    state = _fleet()
    busy = LoadReport(ts=NOW, models=(ModelTraffic(model="m", requests=5),))
    reports = {subjects.router_signals("r1", w): busy for w in range(4)}
    reports[subjects.router_signals("r2", 0)] = busy
    doc = scaling_view.explain(state, "m", reports, [], NOW)
    assert doc["signals"]["routers"] == 2
    assert "signals from 2 routers:" in scaling_view.render(doc)


@given(age=st.floats(min_value=0.0, max_value=3 * MAX_AGE_S))
def test_a_nodes_figures_hold_until_its_next_report_is_due_then_the_routers(age: float) -> None:
    # A node's agent reports every NODE_EVERY_S, the freshness limit's length: counted only
    # while as fresh as a router's, its figures would lapse to a router's before each report.
    state = _fleet()
    scaler = Scaler()
    node = (0.0, 2.0, 0.25)
    router = (7.0, 5.0, 0.75)
    dated = NOW - age
    scaler.note(NODE_A, LoadReport(ts=dated, endpoints=(_load("e1", "m", node),)))
    seen = LoadReport(ts=NOW, endpoints=(_load("e1", "m", router),))
    scaler.note(subjects.router_signals("r", 0), seen, state=state)
    held = NOW - dated <= MAX_AGE_S + loadreport.NODE_EVERY_S  # its age as its date tells
    assert _engine_signals(scaler, state, "m") == (node if held else router)

"""What one node or router controls (the content and size of what it publishes on its
own subjects) costs the control plane bounded work and memory, and never a log that
grows by itself."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.control.scaler import Scaler
from llmgw.core import autoscale, events, kvblocks, kvindex, loadreport, subjects
from llmgw.core.autoscale import Autoscale
from llmgw.core.events import codec
from llmgw.core.profile import ModelProfile
from llmgw.core.state import ClusterState, Endpoint, apply
from llmgw.router.config import RouterConfig, validate

from .scenarios import Sim


def test_a_heartbeat_listing_a_gpu_twice_is_recorded_once_not_forever() -> None:
    # Two different reports of GPU 0 in one heartbeat: the leader recorded the first as a
    # change, folded it, then saw the second differ and recorded it, and so on, a durable
    # GpuHealthChanged at every pass for as long as the agent sent that heartbeat.
    sim = Sim()
    sim.register("n1", count=2)
    sim.heartbeat("n1", [events.GpuHealth(index=0, ecc_uncorrected=1), events.GpuHealth(index=0)])
    recorded = [d for _ in range(6) for d in sim.leader() if isinstance(d, events.GpuHealthChanged)]
    assert len(recorded) == 1
    assert sim.state.seen["n1"].health == (events.GpuHealth(index=0, ecc_uncorrected=1),)


def test_a_router_naming_endless_workers_holds_a_bounded_number_of_reports() -> None:
    # A router's certificate lets it write `llmgw.signals.router.<its name>.*`: the leader
    # kept the latest report of every subject for a minute and aggregated all of them
    # every second, so a router writing under a new worker token per message grew both
    # with its message rate rather than with its workers.
    scaler = Scaler()
    report = loadreport.LoadReport(ts=10.0)
    for i in range(subjects.MAX_ROUTER_WORKERS + 500):
        scaler.note(f"llmgw.signals.router.r1.w{i}", report)
    for token in ("x", "w01", "w-1", "w" + "9" * 40):
        scaler.note(f"llmgw.signals.router.r1.{token}", report)
    assert len(scaler.reports) == subjects.MAX_ROUTER_WORKERS
    assert subjects.signals_owner(subjects.router_signals("r1", 0)) == ("router", "r1")
    assert subjects.signals_owner("llmgw.signals.router.r1.anything") is None


def test_a_router_cannot_be_configured_with_more_workers_than_are_read() -> None:
    too_many = RouterConfig(workers=subjects.MAX_ROUTER_WORKERS + 1)
    assert any("workers must be between 1" in p for p in validate(too_many, where="x"))
    most = RouterConfig(workers=subjects.MAX_ROUTER_WORKERS)
    assert not any("workers" in p for p in validate(most, where="x"))


def test_a_node_inventing_endpoints_holds_a_bounded_share_of_a_routers_kv_index(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Endpoints per node (256) and keys per endpoint (4M) were bounded, not their product:
    # one node's full updates for 256 invented endpoints made every router hold a billion
    # keys (about 110 bytes each). Here the bounds are scaled down a thousandfold.
    monkeypatch.setattr(kvindex, "MAX_KEYS_PER_ENDPOINT", 4_000)
    monkeypatch.setattr(kvindex, "MAX_KEYS_PER_NODE", 8_000, raising=False)
    index = kvindex.KvIndex()
    refused = []
    for e in range(16):
        keys = list(range(e * 4_000, (e + 1) * 4_000))
        update = kvblocks.KvUpdate(endpoint=f"fake{e}", model="m", block_size=16,
                                   instance="i", seq=1, full=True, stored=keys)  # fmt: skip
        refused.append(index.apply(update, "n1", 0.0))
    assert len(index) == 8_000
    assert refused[2] == "node n1 would hold over 8000 blocks"
    # Another node's engine is not crowded out by it.
    other = kvblocks.KvUpdate(endpoint="real", model="m", block_size=16, instance="i", seq=1,
                              full=True, stored=[-1, -2])  # fmt: skip
    assert index.apply(other, "n2", 0.0) is None
    # A node's blocks count once they are gone: it may store again.
    index.forget("fake0")
    assert index.apply(msgspec.structs.replace(other, endpoint="fake2"), "n1", 0.0) is None


_KV_STEP = st.tuples(
    st.sampled_from(["a", "b"]),
    st.sampled_from(["e1", "e2", "e3"]),
    st.integers(1, 4),
    st.booleans(),
    st.lists(st.integers(0, 30), max_size=8),
    st.lists(st.integers(0, 30), max_size=4),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(_KV_STEP, st.sampled_from(["e1", "e2"])), max_size=40))
def test_each_nodes_key_count_is_what_its_endpoints_hold(steps: list[object]) -> None:
    index = kvindex.KvIndex()
    for step in steps:
        if isinstance(step, str):
            index.forget(step)
            continue
        node, ep, seq, full, stored, removed = step  # type: ignore[misc]
        index.apply(kvblocks.KvUpdate(endpoint=ep, model="m", block_size=4, instance="i",
                                      seq=seq, full=full, stored=stored, removed=removed),
                    node, 0.0)  # fmt: skip
        held: dict[str, int] = {}
        for (n, _), blocks in index.endpoints.items():
            held[n] = held.get(n, 0) + len(blocks.keys)
        assert {n: index._node_keys[n] for n in held} == held
        assert set(index._node_keys) == {n for n, _ in index.endpoints}


def _one_model(spec_max: int = 4) -> tuple[Scaler, ClusterState]:
    st = ClusterState()
    profile = ModelProfile(name="m", engine="sim", autoscale=Autoscale(
        min=1, max=spec_max, waiting_per_replica=2.0, running_per_replica=1.0))  # fmt: skip
    assert apply(st, events.ModelDeclared(id="d", ts=1.0, operator="a", profile=profile),
                 1) is None  # fmt: skip
    return Scaler(), st


def test_a_router_reporting_huge_figures_gets_decisions_the_log_can_read() -> None:
    # Each report's figures are within bounds, but their sum over a router's workers (or
    # the count they recommend) was not: the leader published ScaleDecided events whose
    # observation failed the event's own validation, so no reader folded them, the model
    # never scaled, and the leader wrote another every second.
    scaler, st = _one_model()
    st.endpoints["e1"] = Endpoint(replica_id="e1", model="m", url="http://a:1")
    huge = loadreport.LoadReport(ts=10.0, models=(
        loadreport.ModelTraffic(model="m", requests=10**9, waiting=10**9),
    ), endpoints=(
        loadreport.EndpointLoad(endpoint="e1", model="m", queue=1e9, running=1e9),
    ))  # fmt: skip
    for w in range(3):
        scaler.note(subjects.router_signals("r1", w), huge)
    (d,) = scaler.decide(st, 10.0, epoch=0, basis_seq=1, unplaceable={}, ids=lambda b: b)
    assert (d.from_replicas, d.to_replicas) == (1, 3)
    back = codec.decode(codec.encode(d))
    assert back == d
    assert autoscale.verify_decision(st.models["m"].profile.autoscale, 1,  # type: ignore[arg-type]
                                     d.observation) == (3, d.reason)  # fmt: skip


def test_a_report_dated_in_the_future_neither_lasts_nor_blocks_the_routers_next() -> None:
    # The leader kept a report while `now - ts` was within the freshness limit, which a
    # report dated ahead always is: one report from a router (or one whose clock jumped)
    # counted for ever, was never forgotten, and its subject refused every later report
    # with an earlier date.
    scaler, st = _one_model()
    subject = subjects.router_signals("r1", 0)
    scaler.note(subject, loadreport.LoadReport(ts=1e9, models=(
        loadreport.ModelTraffic(model="m", requests=100, waiting=1000),)))  # fmt: skip
    assert scaler.signals(st, 100.0)["m"].waiting == 0
    scaler.note(subject, loadreport.LoadReport(ts=101.0, models=(
        loadreport.ModelTraffic(model="m", requests=1),)))  # fmt: skip
    assert scaler.signals(st, 101.0)["m"].requests == 1
    # Alone, it does not count as a router reporting either.
    alone = Scaler()
    alone.note(subject, loadreport.LoadReport(ts=1e9, models=(
        loadreport.ModelTraffic(model="m", requests=100, waiting=1000),)))  # fmt: skip
    assert alone.decide(st, 100.0, epoch=0, basis_seq=1, unplaceable={}, ids=lambda b: b) == []
    # A clock a little ahead (within the freshness limit) still counts.
    scaler.note(subject, loadreport.LoadReport(ts=103.0, models=(
        loadreport.ModelTraffic(model="m", requests=7),)))  # fmt: skip
    assert scaler.signals(st, 101.0)["m"].requests == 7


def test_a_router_naming_endless_unknown_models_and_endpoints_holds_only_the_logs() -> None:
    # A report may name 2,000 models and 20,000 endpoints (850 KB, under NATS' payload
    # limit), and a router writes 1,024 worker subjects: the leader (and every standby)
    # held them all for a minute, about 5 GB of reports from one router's certificate,
    # though only entries naming the log's models and endpoints ever count.
    scaler, st = _one_model()
    st.endpoints["e1"] = Endpoint(replica_id="e1", model="m", url="http://a:1")
    models = [loadreport.ModelTraffic(model=f"x{i}", waiting=5)
              for i in range(loadreport.MAX_MODELS - 1)]  # fmt: skip
    models.append(loadreport.ModelTraffic(model="m", requests=3))
    eps = [loadreport.EndpointLoad(endpoint=f"e{i}", model="m", queue=1) for i in range(2, 500)]
    eps.append(loadreport.EndpointLoad(endpoint="e1", model="m", running=2.0))
    eps.append(loadreport.EndpointLoad(endpoint="e1", model="other", running=9.0))
    junk = loadreport.LoadReport(ts=10.0, models=tuple(models), endpoints=tuple(eps))
    subject = subjects.router_signals("r1", 0)
    scaler.note(subject, junk, state=st)
    held = scaler.reports[subject]
    assert [t.model for t in held.models] == ["m"]
    assert [(e.endpoint, e.model) for e in held.endpoints] == [("e1", "m")]
    got = scaler.signals(st, 10.0)["m"]
    assert (got.requests, got.running, got.waiting) == (3, 2.0, 0)

"""The autoscaler's core: rules, recommendations, windows, decisions, load reports, the
fold of its events and the replay check (llmgw.core.autoscale, llmgw.core.loadreport,
llmgw.core.state.scaling, llmgw.control.scaler)."""

from __future__ import annotations

import itertools
import math

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.control.scaler import Scaler
from llmgw.core import autoscale, catalog, events, loadreport, reconcile
from llmgw.core.autoscale import Autoscale, Observation, Recommendations, Signals
from llmgw.core.profile import ModelProfile
from llmgw.core.state import ClusterState, Endpoint, ReplicaState, apply
from llmgw.core.state.scaling import note_serving, target_replicas

SPEC = Autoscale(min=1, max=4, waiting_per_replica=2.0, ttft_p90_s=0.5, up_window_s=10.0,
                 down_window_s=60.0, max_step=2)  # fmt: skip


def obs(s: Signals, rec: int, floor: int | None = None, ceiling: int | None = None) -> Observation:
    return Observation(signals=s, recommended=rec, up_floor=rec if floor is None else floor,
                       down_ceiling=rec if ceiling is None else ceiling)  # fmt: skip


def test_rules_say_what_is_wrong_and_what_to_change() -> None:
    bad = ModelProfile(name="m", engine="sim", replicas=5,
                       autoscale=Autoscale(min=3, max=2))  # fmt: skip
    found = " | ".join(catalog.problems(bad))
    assert "autoscale.min (3) is above autoscale.max (2)" in found
    assert "replicas (5) is the count the model starts with" in found
    assert "autoscale has no signal: set one or more of" in found
    assert "kv_usage is 1.5: a fraction" in " ".join(Autoscale(kv_usage=1.5).problems(1))
    assert catalog.problems(ModelProfile(name="m", engine="sim", autoscale=SPEC)) == []
    # A profile with unknown autoscale fields is refused when decoded, naming the field.
    with pytest.raises(msgspec.ValidationError, match="surge"):
        msgspec.convert({"name": "m", "autoscale": {"surge": 2}}, ModelProfile)


def test_waiting_requests_recommend_enough_replicas_and_say_why() -> None:
    count, why = autoscale.recommend(SPEC, 1, Signals(serving=1, waiting=7, requests=40), 0.0)
    assert count == 4
    assert "7 waiting, target 2 per replica" in why
    # A slow-starting model aims lower: 300 s to start aims at 3/4 of... the target halves
    # at STARTUP_HORIZON_S; 300 s is a quarter off.
    slow, _ = autoscale.recommend(SPEC, 1, Signals(serving=1, waiting=7, requests=40), 300.0)
    assert slow == math.ceil(7 / (2.0 * 0.5)) == 7
    # Latency over the SLO asks for at least one more; well under it holds nothing up.
    over, why = autoscale.recommend(SPEC, 2, Signals(serving=2, ttft_p90_s=2.0, requests=9), 0)
    assert over == 8
    assert "TTFT p90 2000 ms over its SLO 500 ms" in why
    idle, why = autoscale.recommend(SPEC, 2, Signals(serving=2), 0.0)
    assert (idle, why) == (0, "idle: no requests")
    # Waiting and latency under their targets show the count suffices, not that fewer
    # would: with traffic they hold it, unless a signal that grows with load sizes it.
    assert autoscale.recommend(SPEC, 2, Signals(serving=2, requests=1), 0.0) == (
        2, "0 waiting, target 2 per replica")  # fmt: skip
    sized = msgspec.structs.replace(SPEC, running_per_replica=4.0)
    assert autoscale.recommend(sized, 3, Signals(serving=3, running=5, requests=9), 0.0) == (
        2, "5 running, target 4 per replica")  # fmt: skip
    # Any request at all keeps one replica, whatever the targets say.
    assert autoscale.recommend(sized, 2, Signals(serving=2, requests=1), 0.0)[0] == 1


def test_decisions_respect_bounds_step_and_zero() -> None:
    s = Signals(serving=1, waiting=20, requests=50)
    assert autoscale.decide(SPEC, 1, obs(s, 10), "r") == (3, "out: r")  # max_step 2
    assert autoscale.decide(SPEC, 3, obs(s, 10), "r") == (4, "out: r")  # max 4
    assert autoscale.decide(SPEC, 4, obs(s, 10), "r") is None
    # In, bounded by the step and min.
    quiet = Signals(serving=4)
    decided = autoscale.decide(SPEC, 4, obs(quiet, 0), "idle")
    assert decided is not None
    assert decided[0] == 2
    assert autoscale.decide(SPEC, 1, obs(quiet, 0), "idle") is None
    # From zero no window applies.
    zero = Autoscale(min=0, max=3, waiting_per_replica=1.0, up_window_s=60.0)
    held = Signals(waiting=1)
    assert autoscale.decide(zero, 0, obs(held, 1, floor=0), "r") == (1, "from zero: r")


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 6), st.integers(1, 8), st.integers(1, 3), st.integers(0, 12),
    st.integers(0, 12), st.integers(0, 12),
)  # fmt: skip
def test_a_decision_stays_within_min_max_and_step(
    lo: int, span: int, step: int, current: int, floor: int, ceiling: int
) -> None:
    spec = Autoscale(min=lo, max=lo + span, max_step=step, running_per_replica=1.0)
    hi = lo + span
    decided = autoscale.decide(spec, current, obs(Signals(), floor, floor, ceiling), "r")
    if decided is None:
        return
    to, _ = decided
    assert lo <= to <= hi
    if lo <= current <= hi and current > 0:
        assert abs(to - current) <= step


def test_windows_give_the_trough_and_the_crest() -> None:
    h = Recommendations(started=0.0)
    for t, c in [(0, 1), (5, 4), (10, 2), (12, 3)]:
        h.add(t, c, keep_s=60)
    assert h.floor(12, 5) == 2  # 10 s and 12 s
    assert h.floor(12, 0) == 3  # the newest alone
    assert h.ceiling(12, 60, current=1) == 4  # a whole window not seen yet: at least current
    assert h.ceiling(70, 60, current=9) == 3  # once seen: the window's highest (10-70 s)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 9), st.integers(1, 10))
def test_a_square_wave_faster_than_the_windows_does_not_flap(half_period: int, amp: int) -> None:
    # Load alternates between high and low every `half_period` seconds, faster than both
    # windows: after any first move, the count never goes back.
    spec = Autoscale(min=1, max=8, waiting_per_replica=1.0, up_window_s=20.0,
                     down_window_s=40.0, max_step=8)  # fmt: skip
    history = Recommendations(started=0.0)
    current, moves = 1, []
    for t in range(600):
        high = (t // half_period) % 2 == 0
        s = Signals(serving=current, waiting=float(amp if high else 0), requests=5)
        o, why = autoscale.observe(spec, current, s, history, float(t))
        decided = autoscale.decide(spec, current, o, why)
        if decided is not None:
            moves.append(decided[0])
            current = decided[0]
    assert all(b >= a for a, b in itertools.pairwise(moves)), moves
    assert len(moves) <= 1, moves


def test_quantile_follows_prometheus() -> None:
    bounds = (0.1, 0.5, 1.0)
    assert loadreport.quantile(0.9, bounds, [0, 0, 0, 0]) == 0.0
    assert loadreport.quantile(0.5, bounds, [10, 0, 0, 0]) == pytest.approx(0.05)
    assert loadreport.quantile(0.9, bounds, [5, 5, 0, 0]) == pytest.approx(0.1 + 0.4 * 0.8)
    assert loadreport.quantile(0.99, bounds, [0, 0, 0, 3]) == 1.0  # +Inf: the top bound


@given(st.lists(st.floats(0.0, 100.0), min_size=1, max_size=30), st.floats(0.01, 0.99))
def test_quantile_is_within_the_buckets(values: list[float], q: float) -> None:
    bounds = (0.5, 1, 5, 10, 50)
    counts = [0.0] * (len(bounds) + 1)
    for v in values:
        counts[next((i for i, b in enumerate(bounds) if v <= b), len(bounds))] += 1
    got = loadreport.quantile(q, bounds, counts)
    assert 0.0 <= got <= 50
    exact = sorted(values)[max(math.ceil(q * len(values)) - 1, 0)]
    i = next((i for i, b in enumerate(bounds) if exact <= b), len(bounds))
    lower = bounds[i - 1] if 0 < i <= len(bounds) else 0.0
    upper = bounds[i] if i < len(bounds) else 50
    assert lower - 1e-9 <= got <= upper + 1e-9


def test_aggregate_adds_routers_and_believes_only_the_logs_endpoints() -> None:
    a = loadreport.LoadReport(ts=100.0, models=(
        loadreport.ModelTraffic(model="m", requests=10, waiting=2, ttft_p90_s=0.2, samples=10),
    ), endpoints=(
        loadreport.EndpointLoad(endpoint="r1", model="m", queue=3, running=4, kv_usage=0.5),
        loadreport.EndpointLoad(endpoint="fake", model="m", queue=99, running=99),
    ))  # fmt: skip
    b = loadreport.LoadReport(ts=101.0, models=(
        loadreport.ModelTraffic(model="m", requests=30, ttft_p90_s=0.6, samples=30),
        loadreport.ModelTraffic(model="other", requests=1000),
    ), endpoints=(
        loadreport.EndpointLoad(endpoint="r1", model="m", queue=1, running=2, kv_usage=0.3),
    ))  # fmt: skip
    stale = loadreport.LoadReport(ts=10.0, models=(
        loadreport.ModelTraffic(model="m", requests=10_000),
    ))  # fmt: skip
    # Two processes of one router: their p90s average by their samples alone.
    reports = {"llmgw.signals.router.r.w0": a, "llmgw.signals.router.r.w1": b,
               "llmgw.signals.router.old.w0": stale}  # fmt: skip
    got = loadreport.aggregate(reports, {"r1": "m"}, 102.0, 5.0, models=["z"])
    assert set(got) == {"m", "z"}
    m = got["m"]
    assert (m.requests, m.routers, m.serving) == (40, 1, 1)  # one router, two processes
    assert m.waiting == 2 + 1
    assert m.running == 2
    assert m.kv_usage == 0.3
    assert m.ttft_p90_s == pytest.approx((0.2 * 10 + 0.6 * 30) / 40)
    assert got["z"] == Signals()


@given(st.binary(max_size=200))
def test_a_bad_report_is_refused_with_a_reason(data: bytes) -> None:
    result: loadreport.LoadReport | str
    try:
        result = loadreport.decode(data)
    except ValueError as exc:
        result = str(exc)
    assert isinstance(result, loadreport.LoadReport) or result.startswith("not a load report")


def test_a_report_with_out_of_range_values_is_refused() -> None:
    good = loadreport.LoadReport(ts=1.0, endpoints=(
        loadreport.EndpointLoad(endpoint="e", model="m", kv_usage=0.5),))  # fmt: skip
    raw = msgspec.msgpack.decode(loadreport.encode(good))
    raw["endpoints"][0][4] = 7.0  # KV usage 700 %
    with pytest.raises(ValueError, match="not a load report"):
        loadreport.decode(msgspec.msgpack.encode(raw))
    raw["endpoints"] = [["e", "m", 0, 0, 0]] * (loadreport.MAX_ENDPOINTS + 1)
    with pytest.raises(ValueError, match="not a load report"):
        loadreport.decode(msgspec.msgpack.encode(raw))


# --------------------------------------------------------------------------- the fold


def _declared(spec: Autoscale | None = SPEC, replicas: int = 1) -> ClusterState:
    st = ClusterState()
    profile = ModelProfile(name="m", engine="sim", replicas=replicas, autoscale=spec)
    assert apply(st, events.ModelDeclared(id="d", ts=1.0, operator="alice", profile=profile),
                 1) is None  # fmt: skip
    return st


def _scaled(st: ClusterState, frm: int, to: int, seq: int, epoch: int = 0) -> str | None:
    o = obs(Signals(serving=frm, waiting=9, requests=9), to)
    ev = events.ScaleDecided(
        id=f"s{seq}", ts=float(seq), epoch=epoch, model="m", from_replicas=frm,
        to_replicas=to, reason="out", observation=o,
    )  # fmt: skip
    return apply(st, ev, seq)


def test_the_fold_follows_decisions_and_pins() -> None:
    st = _declared()
    assert target_replicas(st.models["m"]) == 1
    assert _scaled(st, 1, 3, 2) is None
    assert target_replicas(st.models["m"]) == 3
    # A decision from a count the model does not have is refused (a stale or replayed one).
    assert "from 1 replicas, but it has 3" in (_scaled(st, 1, 2, 3) or "")
    pin = events.ScalePinned(id="p", ts=4.0, operator="bob", model="m", replicas=2)
    assert apply(st, pin, 4) is None
    assert target_replicas(st.models["m"]) == 2
    assert "pinned at 2 by an operator" in (_scaled(st, 2, 4, 5) or "")
    assert "above its autoscale.max 4" in (apply(st, msgspec.structs.replace(
        pin, id="p2", replicas=9), 6) or "")  # fmt: skip
    assert apply(st, events.ScaleReleased(id="r", ts=7.0, operator="bob", model="m"), 7) is None
    assert target_replicas(st.models["m"]) == 2
    assert st.models["m"].pinned is None
    # A model without autoscale cannot be pinned: the refusal says what to do instead.
    fixed = _declared(spec=None, replicas=2)
    assert "change its replicas instead" in (apply(fixed, pin, 2) or "")


def test_a_lowered_max_bounds_the_count_at_once_and_a_pin_at_most_max() -> None:
    st = _declared()
    assert _scaled(st, 1, 4, 2) is None
    assert target_replicas(st.models["m"]) == 4
    lowered = msgspec.structs.replace(
        st.models["m"].profile, autoscale=msgspec.structs.replace(SPEC, max=2)
    )
    assert apply(st, events.ModelChanged(id="c", ts=3.0, operator="alice", profile=lowered),
                 3) is None  # fmt: skip
    assert target_replicas(st.models["m"]) == 2
    pin = events.ScalePinned(id="p", ts=4.0, operator="bob", model="m", replicas=3)
    assert "above its autoscale.max 2" in (apply(st, pin, 4) or "")
    assert st.models["m"].pinned is None


def test_only_a_replicas_first_start_is_timed_into_its_models_startup() -> None:
    """A restarted generation's time to serve includes its failure and backoff."""
    st = _declared()
    model = st.models["m"]
    first = ReplicaState(id="r1", model="m", generation=1, placed_ts=100.0, shards=[])
    note_serving(st, first, 160.0)
    assert model.startup_s == 60.0
    again = ReplicaState(id="r2", model="m", generation=2, placed_ts=100.0, shards=[])
    note_serving(st, again, 1000.0)
    assert model.startup_s == 60.0
    # Another first start moves the average by its weight, not to its own time.
    other = ReplicaState(id="r3", model="m", generation=1, placed_ts=100.0, shards=[])
    note_serving(st, other, 200.0)
    assert model.startup_s == 72.0


def test_a_deposed_leaders_decision_is_refused() -> None:
    st = _declared()
    st.epoch = 5
    assert "a deposed leader's decision" in (_scaled(st, 1, 2, 2, epoch=4) or "")


# --------------------------------------------------------------------------- leader + replay


def _report(ts: float, waiting: int) -> loadreport.LoadReport:
    """A router's report: `waiting` held, traffic while any are (idle after)."""
    return loadreport.LoadReport(ts=ts, models=(
        loadreport.ModelTraffic(model="m", requests=20 if waiting else 0, waiting=waiting),
    ))  # fmt: skip


def test_scaler_decisions_replay_exactly_and_a_forged_one_does_not() -> None:
    st = _declared()
    scaler = Scaler()
    log: list[tuple[int, events.Event]] = [(1, events.ModelDeclared(
        id="d", ts=1.0, operator="alice", profile=st.models["m"].profile))]  # fmt: skip
    seq = 1
    for t in range(0, 200, 2):
        scaler.note("llmgw.signals.router.r.w0", _report(float(t), 8 if t < 60 else 0))
        for d in scaler.decide(st, float(t), epoch=0, basis_seq=seq, unplaceable={},
                               ids=lambda b: b):  # fmt: skip
            seq += 1
            assert apply(st, d, seq) is None
            log.append((seq, d))
    counts = [e.to_replicas for _, e in log if isinstance(e, events.ScaleDecided)]
    assert counts[0] > 1, counts  # out under load,
    assert counts[-1] == 1, counts  # back in after it
    report = reconcile.verify(log)
    assert report.ok, report.mismatches
    assert report.scalings == len(counts)
    # Change what one decision says it saw: the replay no longer reproduces it.
    i = next(i for i, (_, e) in enumerate(log) if isinstance(e, events.ScaleDecided))
    seq_i, first = log[i]
    assert isinstance(first, events.ScaleDecided)
    forged = msgspec.structs.replace(first, observation=msgspec.structs.replace(
        first.observation, signals=Signals(serving=1, requests=20)))  # fmt: skip
    log[i] = (seq_i, forged)
    bad = reconcile.verify(log)
    assert not bad.ok
    assert "its signals recommend" in bad.mismatches[0]
    # Keep what it saw but change the count it went to (within bounds, so the fold takes
    # it): the observation gives another count, and the replay says so.
    lied = msgspec.structs.replace(first, to_replicas=first.to_replicas + 1)
    log[i] = (seq_i, lied)
    bad = reconcile.verify(log)
    assert not bad.ok
    assert f"recorded {lied.to_replicas} replicas" in bad.mismatches[0]


def test_a_kv_usage_within_the_tolerance_of_its_target_keeps_the_count() -> None:
    spec = Autoscale(min=1, max=10, kv_usage=0.8)
    near = Signals(serving=4, kv_usage=0.85, requests=10)
    assert autoscale.recommend(spec, 4, near, 0.0)[0] == 4
    over = Signals(serving=4, kv_usage=0.9, requests=10)
    assert autoscale.recommend(spec, 4, over, 0.0)[0] == 5


def test_a_model_at_its_min_gives_up_no_replica_to_a_higher_priority() -> None:
    spec = Autoscale(min=2, max=6, waiting_per_replica=1.0, priority=-1)
    short = Observation(signals=Signals(), recommended=2, up_floor=2, down_ceiling=2,
                        short_of="urgent", short_priority=5)  # fmt: skip
    assert autoscale.decide(spec, 2, short, "") is None
    above = autoscale.decide(spec, 3, short, "")
    assert above is not None
    assert above[0] == 2


def test_short_of_gpus_a_lower_priority_model_gives_a_replica_never_below_min() -> None:
    st = ClusterState()
    hi = ModelProfile(name="hi", engine="sim", autoscale=Autoscale(
        min=1, max=4, running_per_replica=1, priority=10))  # fmt: skip
    lo = ModelProfile(name="lo", engine="sim", replicas=2, autoscale=Autoscale(
        min=1, max=4, running_per_replica=1, priority=0))  # fmt: skip
    for i, p in enumerate([hi, lo], 1):
        assert apply(st, events.ModelDeclared(id=f"d{i}", ts=1.0, operator="a", profile=p),
                     i) is None  # fmt: skip
    scaler = Scaler()
    busy = loadreport.LoadReport(ts=10.0, models=(
        loadreport.ModelTraffic(model="lo", requests=50),
        loadreport.ModelTraffic(model="hi", requests=50),
    ))  # fmt: skip
    scaler.note("llmgw.signals.router.r.w0", busy)
    short = {"hi": "too few free GPUs"}
    (d,) = scaler.decide(st, 10.0, epoch=0, basis_seq=2, unplaceable=short, ids=lambda b: b)
    assert (d.model, d.from_replicas, d.to_replicas) == ("lo", 2, 1)
    assert "preempted: hi (priority 10)" in d.reason
    assert apply(st, d, 3) is None
    assert reconcile.verify([(3, d)], state=_copy(st, undo=d)).ok
    # At its min it gives nothing more.
    assert scaler.decide(st, 11.0, epoch=0, basis_seq=3, unplaceable=short, ids=lambda b: b) == []


def _copy(st: ClusterState, undo: events.ScaleDecided) -> ClusterState:
    """`st` as it was before `undo` (for the replay check of one decision)."""
    before = msgspec.msgpack.decode(msgspec.msgpack.encode(st), type=ClusterState)
    before.models[undo.model].desired = None
    before.last_seq = 2
    return before


def test_a_model_declared_later_waits_its_own_down_window_before_scaling_in() -> None:
    spec = Autoscale(min=0, max=2, running_per_replica=2.0, down_window_s=30.0)
    st = _declared(spec=spec)
    scaler = Scaler()  # a leader long in place
    decided = []
    for t in range(1000, 1040):
        scaler.note("llmgw.signals.router.r.w0", loadreport.LoadReport(ts=float(t)))  # idle
        for d in scaler.decide(st, float(t), epoch=0, basis_seq=t, unplaceable={},
                               ids=lambda b: b):  # fmt: skip
            assert apply(st, d, t) is None
            decided.append(d)
    assert [(d.ts, d.to_replicas) for d in decided] == [(1030.0, 0)]


def test_without_any_router_report_every_count_holds() -> None:
    # Routers cut off from NATS may be serving on what they last knew: silence is not idle.
    spec = Autoscale(min=0, max=2, running_per_replica=2.0, down_window_s=5.0)
    st = _declared(spec=spec)
    scaler = Scaler()
    scaler.note("llmgw.signals.router.r.w0", loadreport.LoadReport(ts=100.0))
    assert all(scaler.decide(st, float(t), epoch=0, basis_seq=1, unplaceable={},
                             ids=lambda b: b) == [] for t in range(106, 200))  # fmt: skip


def test_a_model_removed_while_its_replicas_still_serve_is_no_longer_scaled() -> None:
    # A removed model's endpoints stay up until the reconciler retires its replicas, and
    # the leader aggregated signals for every model with an endpoint: it then looked the
    # removed one up in the catalog, and the KeyError ended the control plane's decide
    # loop (and the process) before the reconciler could retire anything.
    st = _declared(spec=SPEC)
    st.endpoints["e1"] = Endpoint(replica_id="e1", model="m", url="http://a:1")
    scaler = Scaler()
    scaler.note("llmgw.signals.router.r.w0", loadreport.LoadReport(ts=100.0, models=(
        loadreport.ModelTraffic(model="m", requests=5, waiting=9),)))  # fmt: skip
    assert scaler.decide(st, 100.0, epoch=0, basis_seq=1, unplaceable={}, ids=lambda b: b)
    assert set(scaler.observations(st, 100.0)) == {"m"}
    removed = events.ModelRemoved(id="rm", ts=101.0, operator="alice", name="m")
    assert apply(st, removed, 2) is None
    assert "e1" in st.endpoints  # still serving, on its way out
    assert scaler.signals(st, 101.0) == {}
    assert scaler.decide(st, 101.0, epoch=0, basis_seq=2, unplaceable={}, ids=lambda b: b) == []
    assert scaler.observations(st, 101.0) == {}
    assert scaler.history == {}


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 8), st.floats(0, 50), st.floats(0, 5), st.integers(0, 100),
       st.floats(0, 600))  # fmt: skip
def test_pressure_signals_never_scale_a_busy_model_in(
    current: int, waiting: float, ttft: float, requests: int, startup: float
) -> None:
    # Waiting and latency alone: under their targets they hold, over them they add.
    spec = Autoscale(min=0, max=10, waiting_per_replica=2.0, ttft_p90_s=0.5)
    s = Signals(serving=current, waiting=waiting, ttft_p90_s=ttft, requests=requests)
    count, _ = autoscale.recommend(spec, current, s, startup)
    if requests or waiting:
        assert count >= max(current, 1)
    elif ttft == 0:
        assert count == 0  # idle: nothing holds it up


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 8), st.floats(0, 200), st.floats(0, 200))
def test_more_running_never_recommends_fewer(current: int, a: float, b: float) -> None:
    spec = Autoscale(min=0, max=50, running_per_replica=4.0)
    lo, hi = sorted((a, b))
    count = [autoscale.recommend(spec, current, Signals(serving=current, running=r,
                                                        requests=1), 0.0)[0]
             for r in (lo, hi)]  # fmt: skip
    assert count[0] <= count[1]
    assert count[1] == max(math.ceil(round(hi / 4.0, 6)), 1)


def test_a_count_that_broke_the_slo_is_not_returned_to_at_that_load() -> None:
    # Sized on running requests at the engines' saturation: at 3 replicas and 12 running,
    # TTFT breaks its SLO; at 4 it holds. A square wave must not take it back to 3.
    spec = Autoscale(min=1, max=4, running_per_replica=4.0, ttft_p90_s=0.4, up_window_s=2.0,
                     down_window_s=10.0, max_step=2)  # fmt: skip
    history = Recommendations(started=0.0)
    current, moves = 3, []
    for t in range(200):
        high = (t // 5) % 2 == 0
        running = 12.0 if high else 3.0
        ttft = 1.2 if high and current < 4 else 0.05
        s = Signals(serving=current, running=running, ttft_p90_s=ttft, requests=50)
        o, why = autoscale.observe(spec, current, s, history, float(t))
        assert autoscale.verify_decision(spec, current, o) == autoscale.decide(spec, current,
                                                                               o, why)  # fmt: skip
        decided = autoscale.decide(spec, current, o, why)
        if decided is not None:
            moves.append(decided[0])
            current = decided[0]
    assert moves == [4], moves
    # Once the load is lower than when 3 broke the SLO, 3 (and fewer) are fine again.
    for t in range(200, 230):
        s = Signals(serving=current, running=3.0, ttft_p90_s=0.05, requests=50)
        o, why = autoscale.observe(spec, current, s, history, float(t))
        decided = autoscale.decide(spec, current, o, why)
        if decided is not None:
            current = decided[0]
    assert current == 1


def test_a_nodes_report_counts_only_for_its_own_endpoints() -> None:
    st = _declared(spec=Autoscale(min=1, max=4, running_per_replica=2.0))
    st.endpoints["r1"] = Endpoint(replica_id="r1", model="m", url="http://a:1", node="node-a")
    st.endpoints["r2"] = Endpoint(replica_id="r2", model="m", url="http://b:1", node="node-b")
    scaler = Scaler()
    own = loadreport.EndpointLoad(endpoint="r1", model="m", running=3.0)
    other = loadreport.EndpointLoad(endpoint="r2", model="m", running=50.0)
    scaler.note("llmgw.signals.node.node-a", loadreport.LoadReport(ts=10.0, endpoints=(own, other)))
    # Node reports alone carry no traffic: without a router's report every count holds.
    assert scaler.decide(st, 10.0, epoch=0, basis_seq=1, unplaceable={}, ids=lambda b: b) == []
    scaler.note("llmgw.signals.router.r.w0", loadreport.LoadReport(ts=10.0, models=(
        loadreport.ModelTraffic(model="m", requests=9),)))  # fmt: skip
    signals = scaler.signals(st, 10.0)["m"]
    assert signals.running == 3.0  # node-a's word for r1; not for node-b's r2
    assert signals.routers == 1


def test_no_replica_is_taken_on_gpus_the_waiting_model_cannot_use() -> None:
    st = ClusterState()
    hi = ModelProfile(name="hi", engine="sim", gpu_class="h100-80g", autoscale=Autoscale(
        min=1, max=4, running_per_replica=1, priority=10))  # fmt: skip
    lo = ModelProfile(name="lo", engine="sim", replicas=2, autoscale=Autoscale(
        min=1, max=4, running_per_replica=1, priority=0))  # fmt: skip
    for i, p in enumerate([hi, lo], 1):
        assert apply(st, events.ModelDeclared(id=f"d{i}", ts=1.0, operator="a", profile=p),
                     i) is None  # fmt: skip
    # lo's replicas run on A100s: giving one up frees nothing hi can use.
    st.replicas["r1"] = ReplicaState(id="r1", model="lo", generation=1, shards=[],
                                     gpu_class="a100-80g")  # fmt: skip
    scaler = Scaler()
    scaler.note("llmgw.signals.router.r.w0", loadreport.LoadReport(ts=10.0, models=(
        loadreport.ModelTraffic(model="lo", requests=50),)))  # fmt: skip
    short = {"hi": "too few free GPUs"}
    assert scaler.decide(st, 10.0, epoch=0, basis_seq=2, unplaceable=short, ids=lambda b: b) == []
    st.replicas["r1"].gpu_class = "h100-80g"
    (d,) = scaler.decide(st, 11.0, epoch=0, basis_seq=2, unplaceable=short, ids=lambda b: b)
    assert (d.model, d.to_replicas) == ("lo", 1)


def test_latency_speaks_for_a_count_only_once_it_settled() -> None:
    # Just scaled from 1 to 3: the routers' p90 still holds the queue of the one replica.
    spec = Autoscale(min=1, max=4, running_per_replica=4.0, ttft_p90_s=0.4)
    history = Recommendations(started=0.0)
    late = Signals(serving=3, running=12.0, ttft_p90_s=2.0, requests=50)
    o, why = autoscale.observe(spec, 3, late, history, 100.0, settled=False)
    assert (o.recommended, o.slo_floor, o.settled) == (3, 0, False)
    assert autoscale.verify_decision(spec, 3, o) is None
    # Once settled, the same p90 would be this count's: more, and remembered.
    o, why = autoscale.observe(spec, 3, late, history, 101.0)
    assert (o.recommended, o.slo_floor) == (15, 4)  # 3 x 2000/400; 3 broke it
    assert "TTFT p90 2000 ms over its SLO" in why


def test_from_zero_a_decision_adds_at_most_max_step() -> None:
    spec = Autoscale(min=0, max=10, waiting_per_replica=1.0, max_step=2)
    decided = autoscale.decide(spec, 0, obs(Signals(waiting=9.0), 9), "9 waiting")
    assert decided == (2, "from zero: 9 waiting")


def test_a_count_above_max_comes_down_to_max_at_once() -> None:
    """autoscale.max was lowered: one replica over it is over it."""
    spec = Autoscale(min=1, max=3, waiting_per_replica=1.0)
    assert autoscale.decide(spec, 4, obs(Signals(), 4), "") == (3, "above autoscale.max 3")


def test_a_slow_starting_model_aims_at_no_less_than_half_its_targets() -> None:
    assert autoscale.headroom(autoscale.STARTUP_HORIZON_S * 2) == 0.5
    assert autoscale.headroom(autoscale.STARTUP_HORIZON_S / 4) == 0.75


def test_a_broken_slo_is_forgotten_after_its_memory() -> None:
    history = Recommendations(started=0.0)
    history.broke(0.0, 3, 12.0)
    assert history.slo_floor(autoscale.SLO_MEMORY_S, 12.0) == 4
    assert history.slo_floor(autoscale.SLO_MEMORY_S + 1, 12.0) == 0


def test_latency_with_nothing_running_sets_no_slo_floor() -> None:
    """A p90 over the SLO while no request runs (the routers' window still holds the last
    burst) says nothing about how many replicas this load needs."""
    spec = Autoscale(min=1, max=6, running_per_replica=4.0, ttft_p90_s=0.4)
    history = Recommendations(started=0.0)
    idle = Signals(serving=2, running=0.0, ttft_p90_s=2.0, requests=5)
    autoscale.observe(spec, 2, idle, history, 10.0)
    assert history.slo_floor(11.0, 0.0) == 0

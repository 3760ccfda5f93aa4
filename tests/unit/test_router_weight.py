"""One router's weight in the fleet's latency: the leader averages the routers' p90s by
their samples, and a router writes its own sample count, so no router may weigh more than
all the others together (llmgw.core.loadreport.aggregate, through llmgw.control.scaler)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llmgw.control.scaler import Scaler
from llmgw.core import autoscale, events, loadreport, subjects
from llmgw.core.autoscale import Autoscale
from llmgw.core.profile import ModelProfile
from llmgw.core.state import ClusterState, Endpoint, apply

NOW = 100.0
SLO_S = 1.5
TOLERANCE_S = 1e-4
"""The combined p90s are rounded to 0.1 ms."""


def _one_model() -> ClusterState:
    st_ = ClusterState()
    profile = ModelProfile(name="m", engine="sim", replicas=2, autoscale=Autoscale(
        min=1, max=8, ttft_p90_s=SLO_S, up_window_s=0.0))  # fmt: skip
    event = events.ModelDeclared(id="d", ts=1.0, operator="a", profile=profile)
    assert apply(st_, event, 1) is None
    return st_


def _traffic(samples: int, ttft: float, itl: float = 0.0) -> loadreport.LoadReport:
    traffic = loadreport.ModelTraffic(
        model="m", requests=samples, ttft_p90_s=ttft, itl_p90_s=itl, samples=samples
    )
    return loadreport.LoadReport(ts=NOW, models=(traffic,))


def _with_reports(honest: list[tuple[int, float]], liar: list[tuple[int, float]]) -> Scaler:
    """Honest routers h0, h1, ... one report each; the liar one report per worker."""
    scaler = Scaler()
    for i, (samples, ttft) in enumerate(honest):
        scaler.note(subjects.router_signals(f"h{i}", 0), _traffic(samples, ttft, ttft / 10))
    for w, (samples, ttft) in enumerate(liar):
        scaler.note(subjects.router_signals("liar", w), _traffic(samples, ttft, ttft / 10))
    return scaler


def test_a_router_claiming_a_billion_samples_cannot_hide_a_latency_miss() -> None:
    # Two routers see a TTFT p90 of 4 s, over the 1.5 s SLO; a third claimed 10**9 first
    # tokens at 0 s. Weighted by the samples each claims, the fleet's p90 read as 0 s and
    # the model never scaled out; the third router now weighs as much as the other two.
    st_ = _one_model()
    for e in ("e1", "e2"):  # both replicas serve: the p90s speak for this count
        st_.endpoints[e] = Endpoint(replica_id=e, model="m", url=f"http://{e}:1")
    scaler = _with_reports([(100, 4.0), (100, 4.0)], [(10**9, 0.0)])
    got = scaler.signals(st_, NOW)["m"]
    assert got.ttft_p90_s == 2.0
    assert got.itl_p90_s == 0.2
    (d,) = scaler.decide(st_, NOW, epoch=0, basis_seq=1, unplaceable={}, ids=lambda b: b)
    assert d.to_replicas > d.from_replicas
    assert "TTFT" in d.reason


def test_a_router_spreading_its_claim_over_its_workers_weighs_as_one_router() -> None:
    # A router's certificate lets it publish as up to MAX_ROUTER_WORKERS processes: its
    # workers' reports are one router's, capped together.
    st_ = _one_model()
    scaler = _with_reports([(100, 4.0)], [(10**9, 0.0)] * 16)
    assert scaler.signals(st_, NOW)["m"].ttft_p90_s == 2.0


def test_busy_routers_still_outweigh_idle_ones_and_a_lone_measurement_stands() -> None:
    st_ = _one_model()
    busy = _with_reports([(200, 1.0), (100, 2.0), (100, 3.0)], [])
    assert busy.signals(st_, NOW)["m"].ttft_p90_s == (200 * 1.0 + 100 * 2.0 + 100 * 3.0) / 400
    # Over half of all samples, the busiest router weighs as the others together.
    skewed = _with_reports([(900, 1.0), (100, 3.0)], [])
    assert skewed.signals(st_, NOW)["m"].ttft_p90_s == 2.0
    # Only one router measured a first token: its p90 is the fleet's.
    alone = _with_reports([(50, 2.5), (0, 0.0)], [])
    assert alone.signals(st_, NOW)["m"].ttft_p90_s == 2.5


_HONEST = st.lists(
    st.tuples(st.integers(1, 100_000), st.floats(0.0, 600.0)), min_size=1, max_size=6
)
_LIAR = st.lists(
    st.tuples(st.integers(0, 10**9), st.floats(0.0, autoscale.MAX_AMOUNT)), min_size=1, max_size=4
)


@given(_HONEST, _LIAR)
def test_one_router_moves_the_fleets_p90s_at_most_halfway_to_its_own(
    honest: list[tuple[int, float]], liar: list[tuple[int, float]]
) -> None:
    """Whatever one router claims (any sample count, on any number of its workers), the
    combined p90 stays within the honest routers' range, or at most halfway from it
    towards the liar's figures."""
    st_ = _one_model()
    got = _with_reports(honest, liar).signals(st_, NOW)["m"]
    lo, hi = min(t for _, t in honest), max(t for _, t in honest)
    lie_lo, lie_hi = min(t for _, t in liar), max(t for _, t in liar)
    floor = min(lo, (lo + lie_lo) / 2)
    ceiling = max(hi, (hi + lie_hi) / 2)
    assert floor - TOLERANCE_S <= got.ttft_p90_s <= ceiling + TOLERANCE_S
    assert floor / 10 - TOLERANCE_S <= got.itl_p90_s <= ceiling / 10 + TOLERANCE_S

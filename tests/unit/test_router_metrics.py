"""The router's metrics: exposition a real Prometheus parser reads, and worker merging."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from llmgw.router.metrics import LATENCY_BUCKETS, Metrics, render


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@given(st.lists(st.floats(0, 1000, allow_nan=False), max_size=50))
def test_histogram_buckets_are_cumulative_and_exact(values: list[float]) -> None:
    m = Metrics()
    for v in values:
        m.first_token('we"ird\\model', v)
    s = samples(m.exposition())
    name = "llmgw_router_time_to_first_token_seconds"
    model = ("model", 'we"ird\\model')
    if not values:
        assert not any(k[0].startswith(name) for k in s)
        return
    assert s[(name + "_count", (model,))] == len(values)
    for bound in LATENCY_BUCKETS:
        key = (name + "_bucket", tuple(sorted((model, ("le", str(bound))))))
        assert s[key] == sum(1 for v in values if v <= bound)
    assert abs(s[(name + "_sum", (model,))] - sum(values)) < 1e-6 * max(1.0, sum(values))


def test_workers_merge_counters_sum_gauges_max_inflight_sum() -> None:
    a, b = Metrics(worker=0), Metrics(worker=1)
    a.request_done("m", 200, 0.1)
    b.request_done("m", 200, 0.2)
    b.request_done("m", 502, 0.3)
    a.endpoint("e", ready=False, queue=3, kv=0.5, inflight=2, breaker="closed")
    b.endpoint("e", ready=True, queue=1, kv=0.2, inflight=5, breaker="open")
    s = samples(render(a.all, [a.snapshot(), b.snapshot()]))
    assert s[("llmgw_router_requests_total", (("model", "m"), ("status", "200")))] == 2
    assert s[("llmgw_router_requests_total", (("model", "m"), ("status", "502")))] == 1
    assert s[("llmgw_router_request_duration_seconds_count", (("model", "m"),))] == 3
    assert s[("llmgw_router_endpoint_ready", (("endpoint", "e"),))] == 1
    assert s[("llmgw_router_endpoint_queue_depth", (("endpoint", "e"),))] == 3
    assert s[("llmgw_router_breaker_state", (("endpoint", "e"),))] == 2
    assert s[("llmgw_router_endpoint_inflight", (("endpoint", "e"),))] == 7

"""The router's metrics: exposition a real Prometheus parser reads, and worker merging."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from llmgw.router.metrics import LATENCY_BUCKETS, METRICS_DIR_ENV, Metrics, render, status_label


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
    assert f'le="+Inf"}} {float(len(values))!r}' in m.exposition().decode()  # the format's own


def test_workers_merge_counters_sum_gauges_max_inflight_sum() -> None:
    a, b = Metrics(worker=0), Metrics(worker=1)
    a.request_done("m", 200, 0.1)
    b.request_done("m", 200, 0.2)
    b.request_done("m", 502, 0.3)
    a.queued("m", 2)
    b.queued("m", 3)
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
    assert s[("llmgw_router_queue_depth", (("model", "m"),))] == 5  # each worker's own queue


def test_each_call_counts_in_its_own_family_under_its_own_labels() -> None:
    m = Metrics()
    m.key_request("k1", "t", "m", 429)
    m.key_usage("k1", "t", "m", 7, 0)
    m.count_tokens("m", 0, 9)
    m.cache_predicted("m", prompt=100, predicted=40, source="events")
    m.cache_delivered("m", 30)
    m.routed({"health": 2, "room": 0}, {"prefix": 0.5})
    m.endpoint("e", ready=False, queue=0.0, kv=0.25, inflight=0, breaker="half_open")
    m.queued("m", 3)
    m.queue_waited("m", 0.2, "deadline")
    m.retry("m", "connect")
    m.retry("m", "connect")
    m.request_done("m", 503, 2.5)
    m.fallback("m", "fb")
    m.slow_client("m")
    m.attempt("e")
    s = samples(m.exposition())
    p = "llmgw_router_"
    types = {f.name: f.type for f in text_string_to_metric_families(m.exposition().decode())}
    assert types[p + "key_requests"] == "counter"  # the parser names a counter without _total
    assert types[p + "endpoint_kv_usage"] == "gauge"
    assert types[p + "queue_wait_seconds"] == "histogram"
    assert s[(p + "key_requests_total", (("key", "k1"), ("model", "m"), ("status", "429"),
                                         ("team", "t")))] == 1  # fmt: skip
    assert s[(p + "key_tokens_total", (("direction", "in"), ("key", "k1"), ("model", "m"),
                                       ("team", "t")))] == 7  # fmt: skip
    assert s[(p + "tokens_total", (("direction", "out"), ("model", "m")))] == 9
    for kind, n in (("prompt", 100), ("predicted", 40), ("delivered", 30)):
        assert s[(p + "cache_tokens_total", (("kind", kind), ("model", "m")))] == n
    assert s[(p + "cache_predictions_total", (("model", "m"), ("source", "events")))] == 1
    assert s[(p + "filter_drops_total", (("filter", "health"),))] == 2
    assert s[(p + "scorer_value_count", (("scorer", "prefix"),))] == 1
    assert s[(p + "endpoint_ready", (("endpoint", "e"),))] == 0
    assert s[(p + "endpoint_kv_usage", (("endpoint", "e"),))] == 0.25
    assert s[(p + "breaker_state", (("endpoint", "e"),))] == 1
    assert s[(p + "queue_depth", (("model", "m"),))] == 3
    assert s[(p + "queue_wait_seconds_count", (("model", "m"), ("outcome", "deadline")))] == 1
    assert s[(p + "retries_total", (("model", "m"), ("reason", "connect")))] == 2
    assert s[(p + "requests_total", (("model", "m"), ("status", "503")))] == 1
    assert s[(p + "request_duration_seconds_sum", (("model", "m"),))] == 2.5
    assert s[(p + "fallbacks_total", (("fallback", "fb"), ("model", "m")))] == 1
    assert s[(p + "slow_clients_total", (("model", "m"),))] == 1
    assert s[(p + "endpoint_requests_total", (("endpoint", "e"),))] == 1
    # no zero-valued series for what was not counted
    assert (p + "key_tokens_total", (("direction", "out"), ("key", "k1"), ("model", "m"),
                                     ("team", "t"))) not in s  # fmt: skip
    assert (p + "tokens_total", (("direction", "in"), ("model", "m"))) not in s
    assert (p + "filter_drops_total", (("filter", "room"),)) in s


def test_label_values_and_odd_numbers_are_written_as_prometheus_reads_them() -> None:
    m = Metrics()
    m.retry("line\nbreak", 'quote"back\\slash\\n\\')
    m.clock_offset.set((), float("-inf"))
    m.queue_depth.set(("m",), float("inf"))
    s = samples(m.exposition())
    p = "llmgw_router_"
    labels = (("model", "line\nbreak"), ("reason", 'quote"back\\slash\\n\\'))
    assert s[(p + "retries_total", labels)] == 1
    assert s[(p + "clock_offset_seconds", ())] == float("-inf")
    assert s[(p + "queue_depth", (("model", "m"),))] == float("inf")


def test_a_scrape_with_workers_sees_its_own_latest_values_and_skips_a_torn_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each worker's snapshot is written every second; the worker answering a scrape
    writes its own first, and a snapshot being replaced (not whole JSON) is skipped."""
    monkeypatch.setenv(METRICS_DIR_ENV, str(tmp_path))
    a, b = Metrics(worker=0), Metrics(worker=1)
    b.request_done("m", 200, 0.1)
    b.write_snapshot(str(tmp_path))
    (tmp_path / "worker-2.json").write_bytes(b'{"llmgw_router_requests": [[["m", "2')
    a.request_done("m", 200, 0.1)  # after a's last snapshot (it has none yet)
    s = samples(a.exposition())
    assert s[("llmgw_router_requests_total", (("model", "m"), ("status", "200")))] == 2
    s = samples(b.exposition())  # the scrape wrote a's snapshot for the other workers
    assert s[("llmgw_router_requests_total", (("model", "m"), ("status", "200")))] == 2


def test_a_scrape_answers_with_this_workers_values_when_its_snapshot_cannot_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snapshot folder gone (or its disk full): the once-a-second writer says so and goes
    on, and a scrape still answers, with this worker's own values, rather than failing."""
    monkeypatch.setenv(METRICS_DIR_ENV, str(tmp_path / "gone"))
    m = Metrics(worker=0)
    m.request_done("m", 200, 0.1)
    s = samples(m.exposition())
    assert s[("llmgw_router_requests_total", (("model", "m"), ("status", "200")))] == 1


def test_a_status_the_router_does_not_know_is_labelled_by_its_class() -> None:
    assert [status_label(s) for s in (200, 404, 499, 502, 529)] == [
        "200", "404", "499", "502", "529"]  # fmt: skip
    assert [status_label(s) for s in (201, 302, 399, 418, 450)] == [
        "2xx", "3xx", "3xx", "4xx", "4xx"]  # fmt: skip

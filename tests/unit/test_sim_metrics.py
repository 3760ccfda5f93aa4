"""The simulated engine's `/metrics` page as vLLM writes it (llmgw.sim.metrics, .stats):
the families and their types under vLLM's names, every series labelled with the served
name and engine "0", prompt tokens split by source, the waiting requests by reason, the
cache's configuration, histograms whose buckets are cumulative with a bound's value in
its own bucket, and the page as the router's and agent's probes read it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from llmgw.core.engine_metrics import parse_engine_metrics
from llmgw.sim import stats as stats_
from llmgw.sim.metrics import registry_for
from tests.unit.test_sim_engine import make, prompt, req, run

FAMILIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_waiting_by_reason": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:prompt_tokens_by_source": "counter",
    "vllm:prompt_tokens_cached": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    **{
        f"vllm:{name}": "histogram"
        for name in (
            "time_to_first_token_seconds",
            "inter_token_latency_seconds",
            "request_time_per_output_token_seconds",
            "e2e_request_latency_seconds",
            "request_queue_time_seconds",
            "request_inference_time_seconds",
            "request_prefill_time_seconds",
            "request_decode_time_seconds",
            "request_prompt_tokens",
            "request_generation_tokens",
            "request_params_max_tokens",
        )
    },
    "vllm:cache_config_info": "gauge",
}


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def _value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
           **labels: str) -> float:  # fmt: skip
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_the_page_has_vllms_families_and_labels_and_its_figures_agree() -> None:
    e = make(max_num_seqs=1, block_size=4, num_blocks=64)
    shared = prompt(12, "s")
    for i in range(3):
        e.add(req(shared + prompt(2, f"t{i}"), max_tokens=3, rid=str(i)))
    e.step(0.0)  # one runs, two wait
    text = generate_latest(registry_for(e, "m1")).decode()
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert families == FAMILIES
    page = _samples(text)
    for (name, labels), _ in page.items():
        if name != "vllm:cache_config_info":
            assert ("model_name", "m1") in labels, name
            assert ("engine", "0") in labels, name
    assert _value(page, "vllm:num_requests_running") == 1
    assert _value(page, "vllm:num_requests_waiting") == 2
    assert _value(page, "vllm:num_requests_waiting_by_reason", reason="capacity") == 2
    assert _value(page, "vllm:num_requests_waiting_by_reason", reason="deferred") == 0
    usage = _value(page, "vllm:kv_cache_usage_perc")
    assert 0 < usage == e.pool.usage
    assert parse_engine_metrics(text) == (2, 1, usage)
    info = _value(page, "vllm:cache_config_info", engine="0", block_size="4",
                  num_gpu_blocks="64", enable_prefix_caching="True")  # fmt: skip
    assert info == 1

    run(e, 1.0)
    page = _samples(generate_latest(registry_for(e, "m1")).decode())
    s = e.stats
    assert s.prompt_tokens_cached > 0  # the later requests hit the shared prefix
    assert _value(page, "vllm:prompt_tokens_total") == s.prompt_tokens == 3 * 14
    assert _value(page, "vllm:prompt_tokens_cached_total") == s.prompt_tokens_cached
    local = _value(page, "vllm:prompt_tokens_by_source_total", source="local_compute")
    hit = _value(page, "vllm:prompt_tokens_by_source_total", source="local_cache_hit")
    assert (local + hit, hit) == (s.prompt_tokens, s.prompt_tokens_cached)
    assert _value(page, "vllm:prefix_cache_queries_total") == s.prefix_cache_queries
    assert _value(page, "vllm:prefix_cache_hits_total") == s.prefix_cache_hits
    assert s.prefix_cache_hits < s.prefix_cache_queries
    assert _value(page, "vllm:generation_tokens_total") == 9
    assert _value(page, "vllm:num_preemptions_total") == s.preemptions
    assert _value(page, "vllm:request_success_total", finished_reason="length") == 3
    assert _value(page, "vllm:request_success_total", finished_reason="stop") == 0
    assert _value(page, "vllm:request_prompt_tokens_count") == 3
    assert _value(page, "vllm:request_prompt_tokens_sum") == 3 * 14
    assert _value(page, "vllm:request_generation_tokens_sum") == 9
    assert _value(page, "vllm:request_params_max_tokens_bucket", le="5.0") == 3
    assert _value(page, "vllm:request_params_max_tokens_bucket", le="2.0") == 0
    assert _value(page, "vllm:e2e_request_latency_seconds_count") == 3
    queued = _value(page, "vllm:request_queue_time_seconds_sum")
    assert queued == s.queue_time.sum > 0  # two of them waited for the batch's slot
    assert _value(page, "vllm:request_prefill_time_seconds_sum") == s.prefill_time.sum
    assert _value(page, "vllm:request_decode_time_seconds_sum") == s.decode_time.sum
    assert s.prefill_time.sum != s.decode_time.sum


def test_token_buckets_are_1_2_5_up_to_the_context() -> None:
    assert stats_.buckets_1_2_5(100) == (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)
    assert stats_.buckets_1_2_5(99) == (1.0, 2.0, 5.0, 10.0, 20.0, 50.0)
    assert stats_.buckets_1_2_5(1) == (1.0,)


@given(st.lists(st.sampled_from([0.5, 1.0, 2.5]) | st.floats(0, 10), max_size=40))
def test_a_histograms_buckets_are_cumulative_and_a_bound_counts_in_its_own(
    values: list[float],
) -> None:
    h = stats_.Histogram((0.5, 1.0, 2.5))
    for v in values:
        h.observe(v)
    cumulative = h.cumulative()
    assert [le for le, _ in cumulative] == ["0.5", "1.0", "2.5", "+Inf"]
    for le, n in cumulative:
        bound = float(le)
        assert n == sum(1 for v in values if v <= bound), (le, values)
    assert h.count == len(values)
    assert abs(h.sum - sum(values)) < 1e-9

"""`/metrics` of the simulated engine, under vLLM's current metric names.

A prometheus_client collector that reads the engine's plain counters
(`llmgw.sim.stats`) at scrape time, so the engine's hot path never touches a
metric object. Names, types and labels follow vLLM 0.33 (`vllm/v1/metrics/
loggers.py`): every
series carries `model_name` (the first served name) and `engine` ("0"); counters
are exposed with `_total`. The removed names (`vllm:gpu_cache_usage_perc`,
`vllm:time_per_output_token_seconds`, `vllm:gpu_prefix_cache_*`) are not emitted.

Each `SimServer` has its own registry, so several sims in one test process do
not share series.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from llmgw.sim.engine import Engine
from llmgw.sim.stats import Stats

_LABELS = ["model_name", "engine"]

_HISTOGRAM_HELP = {
    "time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "request_time_per_output_token_seconds": "Histogram of time_per_output_token_seconds per request.",  # noqa: E501
    "e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
    "request_inference_time_seconds": "Histogram of time spent in RUNNING phase for request.",
    "request_prefill_time_seconds": "Histogram of time spent in PREFILL phase for request.",
    "request_decode_time_seconds": "Histogram of time spent in DECODE phase for request.",
    "request_prompt_tokens": "Number of prefill tokens processed.",
    "request_generation_tokens": "Number of generation tokens processed.",
    "request_params_max_tokens": "Histogram of the max_tokens request parameter.",
}


class EngineCollector(Collector):
    """vLLM's metric families, read from one engine when scraped."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.values = [model_name, "0"]

    def collect(self) -> Iterator[Metric]:
        yield from self._scheduler()
        yield from self._tokens()
        yield from self._requests()
        yield self._cache_config()

    @property
    def stats(self) -> Stats:
        return self.engine.stats

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=_LABELS)
        g.add_metric(self.values, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=_LABELS)
        c.add_metric(self.values, value)
        return c

    def _scheduler(self) -> Iterator[Metric]:
        """The batch, the queue and the KV cache's fill."""
        yield self._gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            len(self.engine.running),
        )
        yield self._gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            len(self.engine.waiting),
        )
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of requests waiting, by the reason they wait.",
            labels=[*_LABELS, "reason"],
        )
        by_reason.add_metric([*self.values, "capacity"], len(self.engine.waiting))
        by_reason.add_metric([*self.values, "deferred"], 0)
        yield by_reason
        yield self._gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            self.engine.pool.usage,
        )

    def _tokens(self) -> Iterator[Metric]:
        """Prompt and generated tokens, the prefix cache's hits, preemptions."""
        yield self._counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            self.stats.prefix_cache_queries,
        )
        yield self._counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            self.stats.prefix_cache_hits,
        )
        yield self._counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            self.stats.preemptions,
        )
        yield self._counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", self.stats.prompt_tokens
        )
        by_source = CounterMetricFamily(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            labels=[*_LABELS, "source"],
        )
        by_source.add_metric(
            [*self.values, "local_compute"],
            self.stats.prompt_tokens - self.stats.prompt_tokens_cached,
        )
        by_source.add_metric([*self.values, "local_cache_hit"], self.stats.prompt_tokens_cached)
        yield by_source
        yield self._counter(
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens.",
            self.stats.prompt_tokens_cached,
        )
        yield self._counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            self.stats.generation_tokens,
        )

    def _requests(self) -> Iterator[Metric]:
        """Finished requests by reason, and the per-request histograms."""
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*_LABELS, "finished_reason"],
        )
        for reason, n in self.stats.request_success.items():
            success.add_metric([*self.values, reason], n)
        yield success
        for name, h in self.stats.histograms().items():
            fam = HistogramMetricFamily(f"vllm:{name}", _HISTOGRAM_HELP[name], labels=_LABELS)
            fam.add_metric(self.values, buckets=h.cumulative(), sum_value=h.sum)
            yield fam

    def _cache_config(self) -> Metric:
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["engine", "block_size", "num_gpu_blocks", "enable_prefix_caching"],
        )
        info.add_metric(
            ["0", str(self.engine.block_size), str(self.engine.pool.num_blocks), "True"], 1
        )
        return info


def registry_for(engine: Engine, model_name: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, model_name))
    return registry

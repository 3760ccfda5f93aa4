"""What the simulated engine counts, in plain numbers, for `/metrics`.

The engine updates these on its hot path (once per generated token for the
inter-token latency), so they are plain ints, floats and bucket lists rather than
prometheus_client objects with a lock per update; `llmgw.sim.metrics` turns them
into vLLM's metric families when `/metrics` is scraped. Bucket bounds are vLLM's
(`vllm/v1/metrics/loggers.py`). Purely computational.
"""

from __future__ import annotations

from bisect import bisect_left

# vLLM 0.33's bucket bounds, in seconds.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

FINISH_REASONS = ("stop", "length", "abort", "error")


def buckets_1_2_5(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > limit:
                return tuple(out)
            out.append(float(value))
        exponent += 1


class Histogram:
    """Counts per bucket (non-cumulative; the last slot is +Inf) and a sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bucket (le = "<=").
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, cumulative count) pairs as Prometheus exposes them, +Inf last."""
        out: list[tuple[str, int]] = []
        total = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            total += n
            out.append((repr(float(bound)), total))
        total += self.counts[-1]
        out.append(("+Inf", total))
        return out


class Stats:
    """Counters and histograms of one engine since it started."""

    def __init__(self, max_model_len: int) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prompt_tokens_cached = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.preemptions = 0
        self.request_success = dict.fromkeys(FINISH_REASONS, 0)
        tokens = buckets_1_2_5(max_model_len)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.tpot = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        self.queue_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.inference_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prefill_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.decode_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = Histogram(tokens)
        self.request_generation_tokens = Histogram(tokens)
        self.request_max_tokens = Histogram(tokens)

    def histograms(self) -> dict[str, Histogram]:
        """vLLM metric name (without the `vllm:` prefix) -> histogram."""
        return {
            "time_to_first_token_seconds": self.ttft,
            "inter_token_latency_seconds": self.itl,
            "request_time_per_output_token_seconds": self.tpot,
            "e2e_request_latency_seconds": self.e2e,
            "request_queue_time_seconds": self.queue_time,
            "request_inference_time_seconds": self.inference_time,
            "request_prefill_time_seconds": self.prefill_time,
            "request_decode_time_seconds": self.decode_time,
            "request_prompt_tokens": self.request_prompt_tokens,
            "request_generation_tokens": self.request_generation_tokens,
            "request_params_max_tokens": self.request_max_tokens,
        }

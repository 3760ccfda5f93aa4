"""The router's Prometheus metrics, served on the admin listener.

Requests by model and status, duration, time to first token, inter-token
latency (per-request mean: one observation per request keeps the hot path
cheap), tokens in and out, retries, fallbacks, each scorer's value for the
chosen endpoint, per-filter drops, and per-endpoint breaker state, readiness,
queue depth and KV usage as the last probe saw them.

With `--workers N` every worker writes its samples to files in
PROMETHEUS_MULTIPROC_DIR and any worker's admin listener aggregates them all
(prometheus_client's multiprocess mode), so one scrape sees the whole router.
Label children are cached in dicts: `.labels()` costs more than the increment.
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)  # fmt: skip
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
SCORE_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
BREAKER_VALUE = {"closed": 0, "half_open": 1, "open": 2}


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class Metrics:
    """Every metric of one router process, in its own registry (tests build several)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        p = "llmgw_router_"
        self.requests = Counter(
            p + "requests", "Requests answered, by model asked for and HTTP status.",
            ["model", "status"], registry=r,
        )  # fmt: skip
        self.duration = Histogram(
            p + "request_duration_seconds", "Request start to last byte.",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            p + "time_to_first_token_seconds", "Request start to the engine's first body byte.",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            p + "inter_token_latency_seconds",
            "Mean gap between streamed chunks, one observation per stream.",
            ["model"], buckets=ITL_BUCKETS, registry=r,
        )  # fmt: skip
        self.tokens = Counter(
            p + "tokens", "Tokens counted from the engines' usage, by direction (in, out).",
            ["model", "direction"], registry=r,
        )  # fmt: skip
        self.retries = Counter(
            p + "retries", "Requests re-sent to another endpoint before their first byte.",
            ["model", "reason"], registry=r,
        )  # fmt: skip
        self.fallbacks = Counter(
            p + "fallbacks", "Requests moved to a fallback model.",
            ["model", "fallback"], registry=r,
        )  # fmt: skip
        self.scores = Histogram(
            p + "scorer_value", "Each scorer's value for the endpoint chosen.",
            ["scorer"], buckets=SCORE_BUCKETS, registry=r,
        )  # fmt: skip
        self.drops = Counter(
            p + "filter_drops", "Endpoints removed by each filter, summed over requests.",
            ["filter"], registry=r,
        )  # fmt: skip
        self.breaker = Gauge(
            p + "breaker_state", "Circuit breaker per endpoint: 0 closed, 1 half-open, 2 open.",
            ["endpoint"], registry=r, multiprocess_mode="max",
        )  # fmt: skip
        self.ready = Gauge(
            p + "endpoint_ready", "1 when the endpoint's last health probe succeeded.",
            ["endpoint"], registry=r, multiprocess_mode="max",
        )  # fmt: skip
        self.queue = Gauge(
            p + "endpoint_queue_depth", "Requests waiting in the engine, from its /metrics.",
            ["endpoint"], registry=r, multiprocess_mode="max",
        )  # fmt: skip
        self.kv = Gauge(
            p + "endpoint_kv_usage", "Engine KV-cache usage 0..1, from its /metrics.",
            ["endpoint"], registry=r, multiprocess_mode="max",
        )  # fmt: skip
        self.inflight = Gauge(
            p + "endpoint_inflight", "Requests this router has in flight per endpoint.",
            ["endpoint"], registry=r, multiprocess_mode="livesum",
        )  # fmt: skip
        self.sent = Counter(
            p + "endpoint_requests", "Attempts sent to each endpoint (retries included).",
            ["endpoint"], registry=r,
        )  # fmt: skip
        self._children: dict[tuple[Any, ...], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def request_done(self, model: str, status: int, duration: float) -> None:
        self._child(self.requests, model, str(status)).inc()
        self._child(self.duration, model).observe(duration)

    def first_token(self, model: str, ttft: float) -> None:
        self._child(self.ttft, model).observe(ttft)

    def inter_token(self, model: str, mean_gap: float) -> None:
        self._child(self.itl, model).observe(mean_gap)

    def count_tokens(self, model: str, prompt: int, completion: int) -> None:
        if prompt:
            self._child(self.tokens, model, "in").inc(prompt)
        if completion:
            self._child(self.tokens, model, "out").inc(completion)

    def attempt(self, endpoint: str) -> None:
        self._child(self.sent, endpoint).inc()

    def breaker_changed(self, endpoint: str, state: str) -> None:
        self._child(self.breaker, endpoint).set(BREAKER_VALUE[state])

    def retry(self, model: str, reason: str) -> None:
        self._child(self.retries, model, reason).inc()

    def fallback(self, model: str, fallback: str) -> None:
        self._child(self.fallbacks, model, fallback).inc()

    def routed(self, drops: dict[str, int], scores: dict[str, float]) -> None:
        for name, n in drops.items():
            self._child(self.drops, name).inc(n)
        for name, v in scores.items():
            self._child(self.scores, name).observe(v)

    def exposition(self) -> bytes:
        mp = multiprocess_dir()
        if mp:
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry, path=mp)  # type: ignore[no-untyped-call]
            return generate_latest(registry)
        return generate_latest(self.registry)

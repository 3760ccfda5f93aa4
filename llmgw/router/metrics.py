"""The router's Prometheus metrics, served on the admin listener.

Requests by model and status, duration, time to first token, inter-token
latency (per-request mean: one observation per request keeps the hot path
cheap), tokens in and out, retries, fallbacks, streams of slow clients, attempts
per endpoint, each scorer's value for the chosen endpoint (sampled), per-filter
drops, and per endpoint the breaker state, readiness, queue depth, KV usage and
in-flight count as the last probe saw them.

The hot path only adds to plain dicts: one event loop owns them, so there is
nothing to lock, and a histogram observation is one bisect. (prometheus_client
spent more per request — a lock and a Python loop over the buckets for every
observation — than the routing decision.) The text exposition format is written
here at scrape time.

With `--workers N` each worker writes a snapshot of its values to
LLMGW_ROUTER_METRICS_DIR every second (and right before it answers a scrape);
any worker's admin listener merges its own values with the others' snapshots (its
own even when its snapshot cannot be written), so one scrape sees the whole router:
counters and histograms add up, per-endpoint gauges take the largest value (in-flight
counts add up).
"""

from __future__ import annotations

import contextlib
import math
import os
from bisect import bisect_left
from pathlib import Path
from typing import Any

import msgspec

METRICS_DIR_ENV = "LLMGW_ROUTER_METRICS_DIR"

KNOWN_STATUSES = frozenset({
    200, 204, 400, 401, 402, 403, 404, 405, 408, 409, 413, 415, 422, 429, 431, 499, 500,
    501, 502, 503, 504, 529,
})  # fmt: skip
"""The statuses the router answers itself, and those engines answer that it relays."""
_STATUS_LABELS = {s: str(s) for s in KNOWN_STATUSES}


def status_label(status: int) -> str:
    """A status as a label (a request's `status`, a retry's reason): the status when
    `KNOWN_STATUSES` holds it, else its class ("2xx" ... "9xx"). The router relays an
    engine's 2xx to 4xx as they are and retries its 5xx, and an engine answering a new one
    each time made a series per status for every key and model it served."""
    return _STATUS_LABELS.get(status) or f"{status // 100}xx"


LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)  # fmt: skip
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
SCORE_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
BREAKER_VALUE = {"closed": 0, "half_open": 1, "open": 2}
PREFIX = "llmgw_router_"

Labels = tuple[str, ...]


def metrics_dir() -> str | None:
    return os.environ.get(METRICS_DIR_ENV) or None


class Counter:
    kind = "counter"

    def __init__(self, name: str, doc: str, labels: tuple[str, ...]) -> None:
        self.name = name
        self.doc = doc
        self.labels = labels
        self.values: dict[Labels, float] = {}

    def inc(self, labels: Labels, amount: float = 1.0) -> None:
        v = self.values
        v[labels] = v.get(labels, 0.0) + amount


class Gauge:
    kind = "gauge"

    def __init__(self, name: str, doc: str, labels: tuple[str, ...], merge: str = "max") -> None:
        self.name = name
        self.doc = doc
        self.labels = labels
        self.merge = merge
        self.values: dict[Labels, float] = {}

    def set(self, labels: Labels, value: float) -> None:
        self.values[labels] = value


class Histogram:
    kind = "histogram"

    def __init__(
        self, name: str, doc: str, labels: tuple[str, ...], buckets: tuple[float, ...]
    ) -> None:
        self.name = name
        self.doc = doc
        self.labels = labels
        self.bounds = buckets
        self.values: dict[Labels, list[float]] = {}
        """Per label set: a count per bucket (the last one is +Inf), then the sum."""

    def observe(self, labels: Labels, value: float) -> None:
        d = self.values.get(labels)
        if d is None:
            d = self.values[labels] = [0.0] * (len(self.bounds) + 2)
        d[bisect_left(self.bounds, value)] += 1
        d[-1] += value


Metric = Counter | Gauge | Histogram


class Metrics:
    """Every metric of one router process."""

    # long: one declaration per metric family (22 of them), each with its help text
    def __init__(self, *, worker: int = 0) -> None:
        self.worker = worker
        p = PREFIX
        self.requests = Counter(
            p + "requests", "Requests answered, by model asked for and HTTP status.",
            ("model", "status"),
        )  # fmt: skip
        self.duration = Histogram(
            p + "request_duration_seconds", "Request start to last byte.", ("model",),
            LATENCY_BUCKETS,
        )  # fmt: skip
        self.ttft = Histogram(
            p + "time_to_first_token_seconds", "Request start to the engine's first token.",
            ("model",), LATENCY_BUCKETS,
        )  # fmt: skip
        self.itl = Histogram(
            p + "inter_token_latency_seconds",
            "Mean gap between streamed chunks, one observation per stream.", ("model",),
            ITL_BUCKETS,
        )  # fmt: skip
        self.tokens = Counter(
            p + "tokens", "Tokens counted from the engines' usage, by direction (in, out).",
            ("model", "direction"),
        )  # fmt: skip
        self.retries = Counter(
            p + "retries",
            "Attempts that failed before the first byte (the request moved on to the next"
            " endpoint or fallback model while one was left).",
            ("model", "reason"),
        )  # fmt: skip
        self.fallbacks = Counter(
            p + "fallbacks", "Requests moved to a fallback model.", ("model", "fallback")
        )
        self.slow_clients = Counter(
            p + "slow_clients",
            "Streams whose client read slower than the engine wrote: their chunks are relayed"
            " through awaited writes instead of straight from the engine's connection.",
            ("model",),
        )
        self.sent = Counter(
            p + "endpoint_requests", "Attempts sent to each endpoint (retries included).",
            ("endpoint",),
        )  # fmt: skip
        self.scores = Histogram(
            p + "scorer_value", "Each scorer's value for the endpoint chosen (sampled).",
            ("scorer",), SCORE_BUCKETS,
        )  # fmt: skip
        self.drops = Counter(
            p + "filter_drops", "Endpoints removed by each filter, summed over requests.",
            ("filter",),
        )  # fmt: skip
        self.breaker = Gauge(
            p + "breaker_state", "Circuit breaker per endpoint: 0 closed, 1 half-open, 2 open.",
            ("endpoint",),
        )  # fmt: skip
        self.ready = Gauge(
            p + "endpoint_ready", "1 when the endpoint's last health probe succeeded.",
            ("endpoint",),
        )  # fmt: skip
        self.queue = Gauge(
            p + "endpoint_queue_depth", "Requests waiting in the engine, from its /metrics.",
            ("endpoint",),
        )  # fmt: skip
        self.kv = Gauge(
            p + "endpoint_kv_usage", "Engine KV-cache usage 0..1, from its /metrics.",
            ("endpoint",),
        )  # fmt: skip
        self.inflight = Gauge(
            p + "endpoint_inflight", "Requests this router has in flight per endpoint.",
            ("endpoint",), merge="sum",
        )  # fmt: skip
        self.cache_tokens = Counter(
            p + "cache_tokens",
            "Requests routed on the KV cache: their prompt tokens (kind=prompt), the tokens"
            " predicted cached on the endpoint chosen (predicted), and those the engine"
            " reported cached (delivered, where its usage says).",
            ("model", "kind"),
        )
        self.cache_sources = Counter(
            p + "cache_predictions",
            "Requests routed on the KV cache, by where the chosen endpoint's prediction came"
            " from: events (the engines' KV events), recent (this router's routes),"
            " approximate (prompt text), none.",
            ("model", "source"),
        )
        self.key_requests = Counter(
            p + "key_requests", "Requests answered per API key (its name, never the secret),"
            " team, model and HTTP status.", ("key", "team", "model", "status"),
        )  # fmt: skip
        self.key_tokens = Counter(
            p + "key_tokens", "Tokens per API key, team and model, from the engines' usage,"
            " by direction (in, out).", ("key", "team", "model", "direction"),
        )  # fmt: skip
        self.queue_depth = Gauge(
            p + "queue_depth", "Requests waiting in this router for a free endpoint, per"
            " model (its profile's queue bounds).", ("model",), merge="sum",
        )  # fmt: skip
        self.queue_wait = Histogram(
            p + "queue_wait_seconds", "Time requests waited in the queue, by how it ended"
            " (sent, deadline, full, gone).", ("model", "outcome"), LATENCY_BUCKETS,
        )  # fmt: skip
        self.clock_offset = Gauge(
            p + "clock_offset_seconds", "The NATS server's time less this router host's"
            " clock, as last measured (keys' limits and expiry are read on the server's).",
            (),
        )  # fmt: skip
        self.all: tuple[Metric, ...] = (
            self.requests, self.duration, self.ttft, self.itl, self.tokens, self.retries,
            self.fallbacks, self.slow_clients, self.sent, self.scores, self.drops, self.breaker,
            self.ready, self.queue, self.kv, self.inflight, self.cache_tokens,
            self.cache_sources, self.key_requests, self.key_tokens, self.queue_depth,
            self.queue_wait, self.clock_offset,
        )  # fmt: skip

    # ------------------------------------------------------------------ the hot path

    def request_done(self, model: str, status: int, duration: float) -> None:
        self.requests.inc((model, status_label(status)))
        self.duration.observe((model,), duration)

    def queued(self, model: str, depth: int) -> None:
        self.queue_depth.set((model,), float(depth))

    def queue_waited(self, model: str, seconds: float, outcome: str) -> None:
        self.queue_wait.observe((model, outcome), seconds)

    def key_request(self, key: str, team: str, model: str, status: int) -> None:
        self.key_requests.inc((key, team, model, status_label(status)))

    def key_usage(self, key: str, team: str, model: str, prompt: int, completion: int) -> None:
        if prompt:
            self.key_tokens.inc((key, team, model, "in"), prompt)
        if completion:
            self.key_tokens.inc((key, team, model, "out"), completion)

    def first_token(self, model: str, ttft: float) -> None:
        self.ttft.observe((model,), ttft)

    def inter_token(self, model: str, mean_gap: float) -> None:
        self.itl.observe((model,), mean_gap)

    def count_tokens(self, model: str, prompt: int, completion: int) -> None:
        if prompt:
            self.tokens.inc((model, "in"), prompt)
        if completion:
            self.tokens.inc((model, "out"), completion)

    def cache_predicted(self, model: str, prompt: int, predicted: int, source: str) -> None:
        self.cache_tokens.inc((model, "prompt"), prompt)
        if predicted:
            self.cache_tokens.inc((model, "predicted"), predicted)
        self.cache_sources.inc((model, source))

    def cache_delivered(self, model: str, cached: int) -> None:
        if cached:
            self.cache_tokens.inc((model, "delivered"), cached)

    def slow_client(self, model: str) -> None:
        self.slow_clients.inc((model,))

    def attempt(self, endpoint: str) -> None:
        self.sent.inc((endpoint,))

    def breaker_changed(self, endpoint: str, state: str) -> None:
        self.breaker.set((endpoint,), BREAKER_VALUE[state])

    def retry(self, model: str, reason: str) -> None:
        self.retries.inc((model, reason))

    def fallback(self, model: str, fallback: str) -> None:
        self.fallbacks.inc((model, fallback))

    def routed(self, drops: dict[str, int], scores: dict[str, float]) -> None:
        for name, n in drops.items():
            self.drops.inc((name,), n)
        for name, v in scores.items():
            self.scores.observe((name,), v)

    def endpoint(
        self, endpoint: str, *, ready: bool, queue: float, kv: float, inflight: int, breaker: str
    ) -> None:
        key = (endpoint,)
        self.ready.set(key, 1.0 if ready else 0.0)
        self.queue.set(key, queue)
        self.kv.set(key, kv)
        self.inflight.set(key, float(inflight))
        self.breaker.set(key, BREAKER_VALUE[breaker])

    # ------------------------------------------------------------------ snapshots, scrapes

    def snapshot(self) -> dict[str, list[tuple[Labels, Any]]]:
        return {m.name: list(m.values.items()) for m in self.all}

    def write_snapshot(self, folder: str) -> None:
        """Atomically replace this worker's snapshot file."""
        path = Path(folder) / f"worker-{self.worker}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.encode(self.snapshot()))
        tmp.replace(path)

    def exposition(self) -> bytes:
        """The Prometheus text format of this process, or of every worker when there are several."""
        folder = metrics_dir()
        if folder is None:
            return render(self.all, [self.snapshot()])
        with contextlib.suppress(OSError):  # the writer's loop says so (llmgw.router.app)
            self.write_snapshot(folder)  # for the other workers' scrapes
        own = f"worker-{self.worker}.json"
        snaps: list[dict[str, list[tuple[Labels, Any]]]] = [self.snapshot()]  # this moment's
        for f in sorted(Path(folder).glob("worker-*.json")):
            if f.name == own:
                continue
            try:
                raw = msgspec.json.decode(f.read_bytes())
            except (OSError, msgspec.DecodeError):
                continue  # being replaced right now: the next scrape has it
            snaps.append({name: [(tuple(k), v) for k, v in items] for name, items in raw.items()})
        return render(self.all, snaps)


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: tuple[str, ...], values: Labels, extra: tuple[str, str] | None = None) -> str:
    pairs = sorted(zip(names, values, strict=False))
    if extra is not None:
        pairs.append(extra)
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}"


def _num(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def render(metrics: tuple[Metric, ...], snaps: list[dict[str, list[tuple[Labels, Any]]]]) -> bytes:
    """Merge snapshots (one per worker) and write the text exposition format."""
    out: list[str] = []
    for m in metrics:
        merged: dict[Labels, Any] = {}
        for snap in snaps:
            for labels, value in snap.get(m.name, []):
                old = merged.get(labels)
                if old is None:
                    merged[labels] = list(value) if isinstance(value, list) else value
                elif isinstance(m, Histogram):
                    merged[labels] = [a + b for a, b in zip(old, value, strict=True)]
                elif isinstance(m, Gauge) and m.merge == "max":
                    merged[labels] = max(old, value)
                else:
                    merged[labels] = old + value
        name = m.name + ("_total" if isinstance(m, Counter) else "")
        out.append(f"# HELP {name} {m.doc}")
        out.append(f"# TYPE {name} {m.kind}")
        for labels in sorted(merged):
            value = merged[labels]
            if isinstance(m, Histogram):
                cumulative = 0.0
                for bound, count in zip((*m.bounds, math.inf), value[:-1], strict=True):
                    cumulative += count
                    le = ("le", "+Inf" if math.isinf(bound) else repr(float(bound)))
                    out.append(f"{m.name}_bucket{_labels(m.labels, labels, le)} {cumulative!r}")
                out.append(f"{m.name}_sum{_labels(m.labels, labels)} {_num(value[-1])}")
                out.append(f"{m.name}_count{_labels(m.labels, labels)} {cumulative!r}")
            else:
                out.append(f"{name}{_labels(m.labels, labels)} {_num(value)}")
    return ("\n".join(out) + "\n").encode()

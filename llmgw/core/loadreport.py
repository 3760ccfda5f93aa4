"""The routers' load reports: what each router saw of each model, for the autoscaler.

Every router process publishes a `LoadReport` every second or so on
`llmgw.signals.router.<its name>.<worker>` (only it may: llmgw.pki.authorization): per
model, the requests it received and held waiting for an endpoint in its last window and
its TTFT and inter-token p90 (from its own histograms), and per endpoint the engine's
queue, running requests and KV-cache usage as its probes last read them. The leader
aggregates the latest report of every router (`aggregate`) into one
`llmgw.core.autoscale.Signals` per model. Reports live in the memory stream
`llmgw-signals` for seconds; what a decision was made on is recorded in the log beside
it, so the reports themselves never need replaying.

`quantile` turns a histogram's bucket counts into a quantile as Prometheus'
`histogram_quantile` does. Pure.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated

import msgspec

from llmgw.core.autoscale import MAX_AMOUNT, MAX_REPLICAS, MAX_REQUESTS, Signals
from llmgw.core.limits import Name

WINDOW_S = 10.0
"""The window a router's report covers (its requests, held requests and p90s)."""
MAX_MODELS = 2_000
MAX_ENDPOINTS = 20_000
Amount = Annotated[float, msgspec.Meta(ge=0.0, le=1e9)]
Count = Annotated[int, msgspec.Meta(ge=0, le=10**9)]


class ModelTraffic(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    model: Name
    requests: Count = 0
    """Requests received in the window."""
    waiting: Count = 0
    """Requests held now, waiting for an endpoint of the model."""
    ttft_p90_s: Amount = 0.0
    itl_p90_s: Amount = 0.0
    samples: Count = 0
    """First tokens measured in the window (the p90s' weight)."""


class EndpointLoad(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    endpoint: Name
    model: Name
    queue: Amount = 0.0
    running: Amount = 0.0
    kv_usage: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0


class LoadReport(msgspec.Struct, frozen=True, kw_only=True):
    ts: float
    window_s: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)] = 10.0
    models: Annotated[tuple[ModelTraffic, ...], msgspec.Meta(max_length=MAX_MODELS)] = ()
    endpoints: Annotated[tuple[EndpointLoad, ...], msgspec.Meta(max_length=MAX_ENDPOINTS)] = ()
    metrics: Name = ""
    """`host:port` of the reporter's /metrics (a router's admin listener), for the control
    plane's Prometheus service discovery; empty when it has none."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(LoadReport)


def encode(report: LoadReport) -> bytes:
    return _encoder.encode(report)


def decode(data: bytes) -> LoadReport:
    """A report, or ValueError saying what is wrong with it."""
    try:
        report = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"not a load report: {exc}") from None
    if not math.isfinite(report.ts):
        raise ValueError("not a load report: ts is not a finite time")
    return report


def quantile(q: float, bounds: Sequence[float], counts: Sequence[float]) -> float:
    """The q-quantile of a histogram: `counts` per bucket (upper `bounds`, then +Inf),
    interpolated linearly within the bucket; 0.0 without observations. As Prometheus,
    a quantile in the +Inf bucket is the highest finite bound."""
    total = sum(counts)
    if total <= 0:
        return 0.0
    rank = q * total
    seen = 0.0
    for i, n in enumerate(counts):
        if n > 0 and seen + n >= rank:
            if i >= len(bounds):
                return float(bounds[-1]) if bounds else 0.0
            lower = bounds[i - 1] if i > 0 else 0.0
            return float(lower + (bounds[i] - lower) * (rank - seen) / n)
        seen += n
    return float(bounds[-1]) if bounds else 0.0


def is_fresh(report: LoadReport, now: float, max_age_s: float) -> bool:
    """Whether a report counts at `now`: no older than `max_age_s`, and no further ahead
    either (a report dated ahead would otherwise count for ever, whatever its router
    reports after it)."""
    return abs(now - report.ts) <= max_age_s


def _capped(value: float, digits: int) -> float:
    return min(round(value, digits), MAX_AMOUNT)


def aggregate(
    reports: Iterable[LoadReport],
    serving: Mapping[str, str],
    now: float,
    max_age_s: float,
    models: Iterable[str] = (),
) -> dict[str, Signals]:
    """One `Signals` per model of `serving` (endpoint id -> model: the endpoints the log
    has up) and of `models` (those at zero replicas included) from the routers' reports no
    older than `max_age_s`. Routers' requests and held requests add up; an endpoint's
    engine load is the freshest any router read; the p90s are the routers' averaged by
    their samples. Reports about endpoints or models the
    log does not have are left out: a router can speak only for what it was told. Sums are
    capped at `Signals`' bounds (many reports at their own bounds add up past them)."""
    fresh = sorted((r for r in reports if is_fresh(r, now, max_age_s)), key=lambda r: r.ts)
    models = set(serving.values()) | set(models)
    engines: dict[str, EndpointLoad] = {}
    traffic: dict[str, list[ModelTraffic]] = {m: [] for m in models}
    routers: dict[str, int] = dict.fromkeys(models, 0)
    for report in fresh:
        for ep in report.endpoints:
            if serving.get(ep.endpoint) == ep.model:
                engines[ep.endpoint] = ep  # a later report wins
        for t in report.models:
            if t.model in traffic:
                traffic[t.model].append(t)
                routers[t.model] += 1
    out: dict[str, Signals] = {}
    for model in sorted(models):
        eps = [e for e in engines.values() if e.model == model]
        seen = traffic[model]
        weight = sum(t.samples for t in seen)
        ttft = sum(t.ttft_p90_s * t.samples for t in seen)
        itl = sum(t.itl_p90_s * t.samples for t in seen)
        out[model] = Signals(
            serving=min(sum(1 for m in serving.values() if m == model), MAX_REPLICAS),
            waiting=_capped(sum(t.waiting for t in seen) + sum(e.queue for e in eps), 3),
            running=_capped(sum(e.running for e in eps), 3),
            kv_usage=round(sum(e.kv_usage for e in eps) / len(eps), 4) if eps else 0.0,
            ttft_p90_s=_capped(ttft / weight, 4) if weight else 0.0,
            itl_p90_s=_capped(itl / weight, 4) if weight else 0.0,
            requests=min(sum(t.requests for t in seen), MAX_REQUESTS),
            routers=min(routers[model], MAX_REPLICAS),
        )
    return out

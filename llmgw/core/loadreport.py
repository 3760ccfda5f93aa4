"""The load reports of routers and node agents: what each saw, for the autoscaler.

Every router process publishes a `LoadReport` every second or so on
`llmgw.signals.router.<its name>.<worker>` (only it may: llmgw.pki.authorization): per
model, the requests it received and held waiting for an endpoint in its last window and
its TTFT and inter-token p90 (from its own histograms), and per endpoint the engine's
queue, running requests and KV-cache usage as its probes last read them. Every node's
agent publishes its own engines' figures on `llmgw.signals.node.<its id>`. The leader
aggregates the latest report of every subject (`fleet_signals`, `aggregate`) into one
`llmgw.core.autoscale.Signals` per model. Reports live in the memory stream
`llmgw-signals` for seconds; what a decision was made on is recorded in the log beside
it, so the reports themselves never need replaying.

An engine belongs to its node's agent; routers only observe it. Where the agent reported
an engine within the freshness window, its figures are the engine's, whatever any router
says of it and however late a router dates its report; a router's figures count for
engines whose agent has no fresh report of them. And no report is dated later than the
server stored it (`received`): a writer that dates its reports ahead gains nothing over
the others.

A router writes its own sample counts, so the p90s are averaged by samples with no router
weighing more than all the others together (`bounded_weights`): one router, whatever it
claims on however many of its workers' subjects, moves the fleet's p90s at most halfway
from the other routers' towards its own.

`quantile` turns a histogram's bucket counts into a quantile as Prometheus'
`histogram_quantile` does. Pure.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Annotated

import msgspec

from llmgw.core import subjects
from llmgw.core.autoscale import MAX_AMOUNT, MAX_REPLICAS, MAX_REQUESTS, Signals
from llmgw.core.limits import Name

if TYPE_CHECKING:
    from llmgw.core.state import ClusterState

WINDOW_S = 10.0
"""The window a router's report covers (its requests, held requests and p90s)."""
MAX_AGE_S = 5.0
"""A report older than this no longer counts (its writer stopped), nor one dated further
ahead than this of the reader's clock."""
NODE_EVERY_S = 5.0
"""How often a node's agent reports its engines' figures (llmgw.agent.loads). A node's
report counts that much longer than a router's, so that its figures do not lapse to the
routers' while its next report is on its way."""
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


def received(report: LoadReport, at: float) -> LoadReport:
    """`report` as its reader takes it, stored by the server at `at`: dated no later than
    that. A report is as old as it says (one its writer held back while cut off stays
    old), but never newer than its arrival: a writer dating its reports ahead would
    otherwise have the last word on every figure the freshest report decides."""
    return report if report.ts <= at else msgspec.structs.replace(report, ts=at)


def supersedes(report: LoadReport, held: LoadReport | None) -> bool:
    """Whether `report` replaces `held` as its subject's latest (no older than it)."""
    return held is None or report.ts >= held.ts


def _capped(value: float, digits: int) -> float:
    return min(round(value, digits), MAX_AMOUNT)


def writer_of(subject: str) -> str:
    """Who published the report on `subject`: a router (whose worker processes' reports are
    all its own) or a node; any other subject stands for itself."""
    owner = subjects.signals_owner(subject)
    return f"{owner[0]} {owner[1]}" if owner is not None else subject


def bounded_weights(samples: Sequence[int]) -> list[int]:
    """Each router's weight in the fleet's p90s: its samples, but never more than all the
    other routers' together, once two or more routers measured anything. A router claiming
    any count then moves the average at most halfway to its own figure, while routers that
    share the traffic still weigh by it; a router alone in measuring keeps its figure.
    (Bounding a report's samples by its requests would not do: the first tokens of a window
    include requests received before it, and a router writes its request count too.)"""
    total = sum(samples)
    if sum(1 for n in samples if n > 0) < 2:
        return list(samples)
    return [min(n, total - n) for n in samples]


def _latencies(seen: Iterable[tuple[str, ModelTraffic]]) -> tuple[float, float]:
    """One model's TTFT and inter-token p90s from its routers' traffic: each router's
    reports (one per worker) averaged by their samples, then the routers' figures by their
    `bounded_weights`."""
    routers: dict[str, tuple[int, float, float]] = {}
    """writer -> (samples, TTFT x samples, ITL x samples)"""
    for writer, t in seen:
        n, ttft, itl = routers.get(writer, (0, 0.0, 0.0))
        routers[writer] = (n + t.samples, ttft + t.ttft_p90_s * t.samples,
                           itl + t.itl_p90_s * t.samples)  # fmt: skip
    figures = list(routers.values())
    weights = bounded_weights([n for n, _, _ in figures])
    total = sum(weights)
    if not total:
        return 0.0, 0.0
    ttft = sum(w * t / n for w, (n, t, _) in zip(weights, figures, strict=True) if w)
    itl = sum(w * i / n for w, (n, _, i) in zip(weights, figures, strict=True) if w)
    return _capped(ttft / total, 4), _capped(itl / total, 4)


def _node_of(subject: str) -> str | None:
    """The node whose agent publishes on `subject`; None for a router's (or any other)."""
    owner = subjects.signals_owner(subject)
    return owner[1] if owner is not None and owner[0] == "node" else None


def _counts(subject: str, report: LoadReport, now: float, max_age_s: float) -> bool:
    """Whether a subject's latest report counts at `now`: a router's while fresh, a node's
    a report interval (`NODE_EVERY_S`) longer, neither when dated further ahead than
    `max_age_s`."""
    if _node_of(subject) is None:
        return is_fresh(report, now, max_age_s)
    return -max_age_s <= now - report.ts <= max_age_s + NODE_EVERY_S


def _engines(
    fresh: Sequence[tuple[str, LoadReport]], serving: Mapping[str, str], owners: Mapping[str, str]
) -> dict[str, EndpointLoad]:
    """Each endpoint's engine figures from `fresh` (subject, report; oldest first): its
    owning node's agent's latest where that agent reported it, else the latest any router
    read. A node's figures count only for its own endpoints, and anyone's only for an
    endpoint `serving` has with that model."""
    observed: dict[str, EndpointLoad] = {}
    owned: dict[str, EndpointLoad] = {}
    for subject, report in fresh:
        node = _node_of(subject)
        for ep in report.endpoints:
            if serving.get(ep.endpoint) != ep.model:
                continue
            if node is None:
                observed[ep.endpoint] = ep  # a later router's reading wins
            elif owners.get(ep.endpoint) == node:
                owned[ep.endpoint] = ep
    return observed | owned


def aggregate(
    reports: Mapping[str, LoadReport],
    serving: Mapping[str, str],
    now: float,
    max_age_s: float,
    models: Iterable[str] = (),
    *,
    owners: Mapping[str, str] | None = None,
) -> dict[str, Signals]:
    """One `Signals` per model of `serving` (endpoint id -> model: the endpoints the log
    has up) and of `models` (those at zero replicas included) from the latest report of
    each subject (`reports`: subject -> report) no older than `max_age_s` (a node's
    `NODE_EVERY_S` more). Routers'
    requests and held requests add up (a node's agent reports no traffic: any it names is
    left out); an endpoint's engine load is its owning node's (`owners`: endpoint id ->
    node id) where that node's agent reported it, else the freshest any router read; the
    p90s are the routers' averaged by their samples, each router's weight bounded
    (`bounded_weights`). Reports about endpoints or models the log does not have are left
    out: a writer can speak only for what it was told. Sums are capped at `Signals`'
    bounds (many reports at their own bounds add up past them)."""
    fresh = sorted(((s, r) for s, r in reports.items() if _counts(s, r, now, max_age_s)),
                   key=lambda sr: sr[1].ts)  # fmt: skip
    models = set(serving.values()) | set(models)
    engines = _engines(fresh, serving, owners or {})
    traffic: dict[str, list[tuple[str, ModelTraffic]]] = {m: [] for m in models}
    for subject, report in fresh:
        if _node_of(subject) is not None:
            continue
        for t in report.models:
            if t.model in traffic:
                traffic[t.model].append((writer_of(subject), t))
    out: dict[str, Signals] = {}
    for model in sorted(models):
        eps = [e for e in engines.values() if e.model == model]
        seen = [t for _, t in traffic[model]]
        ttft, itl = _latencies(traffic[model])
        out[model] = Signals(
            serving=min(sum(1 for m in serving.values() if m == model), MAX_REPLICAS),
            waiting=_capped(sum(t.waiting for t in seen) + sum(e.queue for e in eps), 3),
            running=_capped(sum(e.running for e in eps), 3),
            kv_usage=round(sum(e.kv_usage for e in eps) / len(eps), 4) if eps else 0.0,
            ttft_p90_s=ttft,
            itl_p90_s=itl,
            requests=min(sum(t.requests for t in seen), MAX_REQUESTS),
            routers=min(len({w for w, _ in traffic[model]}), MAX_REPLICAS),
        )
    return out


def fleet_signals(
    state: ClusterState,
    reports: Mapping[str, LoadReport],
    now: float,
    max_age_s: float = MAX_AGE_S,
) -> dict[str, Signals]:
    """The leader's `Signals` from each subject's latest report, as `aggregate` makes them
    of the log's `state`: one per model of the catalog that is autoscaled or has an
    endpoint up (a removed model's endpoints stay up until its replicas are retired), each
    endpoint owned by the node the log has it on. `llmgw ctl explain-scaling` shows what
    this gives, so it cannot tell another story than the leader's."""
    up = {rid: ep for rid, ep in state.endpoints.items() if ep.model in state.models}
    serving = {rid: ep.model for rid, ep in up.items()}
    owners = {rid: ep.node for rid, ep in up.items() if ep.node}
    scaled = [n for n, m in state.models.items() if m.profile.autoscale is not None]
    return aggregate(reports, serving, now, max_age_s, scaled, owners=owners)

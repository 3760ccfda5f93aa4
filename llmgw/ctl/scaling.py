"""`llmgw ctl explain-scaling`: an autoscaled model's signals now, its targets, what the
autoscaler will do next and why, and its last decisions. Pure: ctl reads the log and the
load reports (llmgw.cli.ctl_scaling) and hands them in; the signals are the leader's own
computation of them (`loadreport.fleet_signals`)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from llmgw import wording
from llmgw.core import autoscale, events, loadreport
from llmgw.core.state import ClusterState
from llmgw.core.state.scaling import target_replicas

LAST_DECISIONS = 10


def explain(
    st: ClusterState,
    model: str,
    reports: Mapping[str, loadreport.LoadReport],
    decisions: Sequence[events.ScaleDecided],
    now: float,
) -> dict[str, Any]:
    """What `explain-scaling` shows, as data, from each subject's latest load report
    (`reports`); ValueError for a model without autoscale."""
    m = st.models[model]
    spec = m.profile.autoscale
    if spec is None:
        raise ValueError(
            f"model {model!r} has no autoscale section: its replica count is fixed at "
            f"{m.profile.replicas} (add `autoscale:` to its profile to scale it)"
        )
    signals = loadreport.fleet_signals(st, reports, now)[model]
    current = target_replicas(m)
    count, reason = autoscale.recommend(spec, current, signals, m.startup_s)
    # What it does if this moment's load lasts both windows.
    steady = autoscale.Observation(
        signals=signals,
        recommended=count,
        up_floor=count,
        down_ceiling=count,
        startup_s=m.startup_s,
    )
    will = _next(model, m.pinned, m.pinned_by, spec, current, steady, reason)
    return {
        "model": model,
        "replicas": current,
        "serving": signals.serving,
        "pinned": m.pinned,
        "startup_s": m.startup_s,
        "targets": {k: v for k, v in _targets(spec).items() if v},
        "bounds": {
            "min": spec.min,
            "max": spec.max,
            "max_step": spec.max_step,
            "up_window_s": spec.up_window_s,
            "down_window_s": spec.down_window_s,
            "priority": spec.priority,
        },
        "signals": {
            "waiting": signals.waiting,
            "running": signals.running,
            "kv_usage": signals.kv_usage,
            "ttft_p90_s": signals.ttft_p90_s,
            "itl_p90_s": signals.itl_p90_s,
            "requests": signals.requests,
            "routers": signals.routers,
        },
        "recommended": count,
        "next": will,
        "decisions": [
            {"ts": d.ts, "from": d.from_replicas, "to": d.to_replicas, "reason": d.reason}
            for d in list(decisions)[-LAST_DECISIONS:]
        ],
    }


def _next(
    model: str,
    pinned: int | None,
    pinned_by: str,
    spec: autoscale.Autoscale,
    current: int,
    steady: autoscale.Observation,
    reason: str,
) -> str:
    """What the autoscaler does next if this moment's load lasts its window."""
    if pinned is not None:
        return f"nothing: pinned at {pinned} by {pinned_by} (`llmgw ctl scale {model} --release`)"
    nxt = autoscale.decide(spec, current, steady, reason)
    if nxt is None:
        bound = ""
        if steady.recommended > current >= spec.max:
            bound = ", its autoscale.max"
        elif steady.recommended < current <= spec.min:
            bound = ", its autoscale.min"
        return f"stay at {current}{bound}: {reason}"
    window = spec.up_window_s if nxt[0] > current else spec.down_window_s
    return f"go to {nxt[0]} if this lasts {window:g} s ({nxt[1]})"


def _targets(spec: autoscale.Autoscale) -> dict[str, float]:
    return {
        "waiting_per_replica": spec.waiting_per_replica,
        "running_per_replica": spec.running_per_replica,
        "kv_usage": spec.kv_usage,
        "ttft_p90_s": spec.ttft_p90_s,
        "itl_p90_s": spec.itl_p90_s,
    }


def render(doc: dict[str, Any]) -> str:
    """The text form of `explain`'s document."""
    s = doc["signals"]
    b = doc["bounds"]
    lines = [
        f"{doc['model']}: {doc['replicas']} replicas wanted, {doc['serving']} serving "
        f"(min {b['min']}, max {b['max']}, priority {b['priority']}"
        + (f", pinned at {doc['pinned']}" if doc["pinned"] is not None else "")
        + ")",
        f"  start-up time {doc['startup_s']:.1f} s (measured; lowers the targets aimed at)",
        "  targets: " + ", ".join(f"{k} {v:g}" for k, v in doc["targets"].items()),
        f"  signals from {wording.count(s['routers'], 'router')}: {s['requests']} requests in "
        "their window, "
        f"{s['waiting']:g} waiting, {s['running']:g} running, KV {s['kv_usage']:.0%}, "
        f"TTFT p90 {s['ttft_p90_s'] * 1000:.0f} ms, ITL p90 {s['itl_p90_s'] * 1000:.0f} ms",
        f"  recommended now: {doc['recommended']}",
        f"  next: {doc['next']}",
    ]
    if doc["decisions"]:
        lines.append("  last decisions:")
        for d in doc["decisions"]:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(d["ts"]))
            lines.append(f"    {when}  {d['from']} -> {d['to']}  {d['reason']}")
    else:
        lines.append("  no scaling decisions yet")
    return "\n".join(lines)

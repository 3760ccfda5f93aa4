"""Live status of the embedded fleet: nodes, replicas, requests per second.

Read from the control plane's management API (`/v1/nodes`, `/v1/replicas`, `/v1/models`)
and the router's admin `/metrics` (`llmgw_router_requests_total`); `render` turns one
reading into the lines `llmgw up` prints — redrawn in place on a terminal, printed as plain
lines when they change otherwise. Fetching is plain blocking HTTP with a short timeout on
loopback: `up` runs one loop and no threads. Used by `llmgw.up.running`.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

_REQUESTS = re.compile(r"^llmgw_router_requests_total\{[^}]*\}\s+([0-9.eE+-]+)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Reading:
    """One look at the fleet; counts are None when their source did not answer."""

    nodes_ready: int | None = None
    nodes_total: int | None = None
    replicas_serving: int | None = None
    replicas_wanted: int | None = None
    endpoints: dict[str, str] = field(default_factory=dict)
    """Serving replica id -> engine URL."""
    engines: tuple[str, ...] = ()
    """`URL (node)` of every serving engine, sorted: what runs where."""
    phases: dict[str, int] = field(default_factory=dict)
    """Shards per phase (starting, loading, serving, failed...)."""
    requests_total: float | None = None
    unplaceable: str = ""


def fetch(url: str, timeout_s: float) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            body: bytes = resp.read()
            return body
    except (urllib.error.URLError, OSError, ValueError):
        return None


def _json(url: str, timeout_s: float) -> Any:
    body = fetch(url, timeout_s)
    if body is None:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return None


def models_listed(body: bytes | None) -> set[str]:
    """The model ids a router's GET /v1/models lists; empty when it did not answer. Pure."""
    try:
        data = json.loads(body) if body else None
    except ValueError:
        return set()
    items = data.get("data") if isinstance(data, dict) else None
    if not isinstance(items, list):
        return set()
    return {str(m["id"]) for m in items if isinstance(m, dict) and "id" in m}


def ready_models(body: bytes) -> set[str]:
    """The models a router's /ready counts at least one ready endpoint for. Pure."""
    try:
        data = json.loads(body)
    except ValueError:
        return set()
    per_model = data.get("ready_endpoints") if isinstance(data, dict) else None
    if not isinstance(per_model, dict):
        return set()
    return {str(m) for m, n in per_model.items() if isinstance(n, int) and n > 0}


def requests_total(metrics_text: str) -> float:
    """Sum of `llmgw_router_requests_total` over its labels. Purely computational."""
    return sum(float(v) for v in _REQUESTS.findall(metrics_text))


def read(control_admin: str, router_admin: str, *, timeout_s: float = 1.0) -> Reading:
    """What the control plane and the router say now (either may be empty)."""
    nodes = _json(f"{control_admin}/v1/nodes", timeout_s) if control_admin else None
    replicas = _json(f"{control_admin}/v1/replicas", timeout_s) if control_admin else None
    models = _json(f"{control_admin}/v1/models", timeout_s) if control_admin else None
    metrics = fetch(f"{router_admin}/metrics", timeout_s) if router_admin else None
    return parse(nodes, replicas, models, metrics.decode(errors="replace") if metrics else None)


def parse(nodes: Any, replicas: Any, models: Any, metrics: str | None) -> Reading:
    """A Reading from the management API's JSON and the router's metrics text.

    Purely computational; anything missing or malformed leaves its counts at None.
    """
    out: dict[str, Any] = {}
    if isinstance(nodes, list):
        out["nodes_total"] = len(nodes)
        out["nodes_ready"] = sum(
            1 for n in nodes if isinstance(n, dict) and n.get("liveness") == "ready"
        )
    if isinstance(replicas, list):
        endpoints: dict[str, str] = {}
        engines: list[str] = []
        phases: dict[str, int] = {}
        for r in replicas:
            if not isinstance(r, dict) or r.get("retired"):
                continue
            if isinstance(r.get("endpoint"), str) and r["endpoint"]:
                endpoints[str(r.get("id"))] = r["endpoint"]
                shards = r.get("shards")
                first = shards[0] if isinstance(shards, list) and shards else None
                node = first.get("node") if isinstance(first, dict) else None
                engines.append(f"{r['endpoint']} ({node})" if node else r["endpoint"])
            for s in r.get("shards") or ():
                if isinstance(s, dict):
                    phase = str(s.get("phase"))
                    phases[phase] = phases.get(phase, 0) + 1
        out["endpoints"] = endpoints
        out["engines"] = tuple(sorted(engines))
        out["phases"] = phases
        out["replicas_serving"] = len(endpoints)
    if isinstance(models, list):
        out["replicas_wanted"] = sum(
            int(m.get("replicas_wanted") or 0) for m in models if isinstance(m, dict)
        )
        out["unplaceable"] = "; ".join(
            f"{m.get('name')}: {m['unplaceable']}"
            for m in models
            if isinstance(m, dict) and m.get("unplaceable")
        )
    if metrics is not None:
        out["requests_total"] = requests_total(metrics)
    return Reading(**out)


def _count(value: int | None) -> str:
    return "?" if value is None else str(value)


def render(reading: Reading, rate: float | None) -> list[str]:
    """The status lines for one reading and the request rate since the previous one.
    Purely computational."""
    phases = ", ".join(f"{n} {p}" for p, n in sorted(reading.phases.items()) if p != "serving")
    lines = [
        f"nodes {_count(reading.nodes_ready)}/{_count(reading.nodes_total)} ready"
        f" | replicas {_count(reading.replicas_serving)}/{_count(reading.replicas_wanted)} serving"
        + (f" ({phases})" if phases else "")
        + f" | {'?' if rate is None else f'{rate:.1f}'} req/s"
        + ("" if reading.requests_total is None else f" | {int(reading.requests_total)} requests")
    ]
    if reading.engines:
        lines.append(f"engines: {', '.join(reading.engines)}")
    if reading.unplaceable:
        lines.append(f"unplaceable: {reading.unplaceable}")
    return lines

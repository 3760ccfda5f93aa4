"""Nodes, replicas and models as plain data from a folded state: what `llmgw ctl nodes /
replicas / models` show and what the control plane's admin API serves.

The same functions render the live fleet and any past point `ctl replay` rebuilds,
so a replay reads exactly like the present, and the admin API like ctl. Each returns
JSON-ready dicts (what `--json` prints); `llmgw.ctl.render` turns them into tables.

Purely computational: `now` is an argument (the replay's target time for the past).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import msgspec

from llmgw.core import reconcile, state
from llmgw.core.phases import RANK
from llmgw.core.state.scaling import target_replicas


def _phase_summary(replica: state.ReplicaState) -> str:
    phases = sorted({s.phase for s in replica.shards}, key=lambda p: RANK.get(p, 9))
    return phases[0] if len(phases) == 1 else "/".join(phases)


def _heartbeat_age(node: state.NodeState, seen: state.Seen | None, now: float) -> float | None:
    """From the newest heartbeat in the log; once that expired (per-message TTL), from the
    last heartbeat the leader recorded in NodeUnreachable / NodeLost; None if neither."""
    if seen is not None:
        return round(max(0.0, now - seen.last_seen), 3)
    if node.last_heartbeat:
        return round(max(0.0, now - node.last_heartbeat), 3)
    return None


def node_rows(st: state.ClusterState, now: float) -> list[dict[str, Any]]:
    """Every node: lifecycle, operator flags, GPUs by class and why any are excluded."""
    out = [_node_row(st, name, now) for name in sorted(st.nodes)]
    for name in sorted(set(st.quarantined) - set(st.nodes)):
        out.append(_unregistered_quarantined(st.quarantined[name]))
    out.sort(key=lambda row: row["name"])
    return out


def _node_row(st: state.ClusterState, name: str, now: float) -> dict[str, Any]:
    n = st.nodes[name]
    seen = st.seen.get(name)
    classes, gpus = _gpu_rows(n)
    lifecycle: str = n.liveness
    if n.draining:
        lifecycle += ",draining"
    if n.cordoned:
        lifecycle += ",cordoned"
    quarantine = st.quarantined.get(name)
    if quarantine is not None:
        lifecycle += ",quarantined"
    return {
        "name": name,
        "address": n.address,
        "state": lifecycle,
        "liveness": n.liveness,
        "cordoned": n.cordoned,
        "cordon_reason": n.cordon_reason,
        "draining": n.draining,
        "quarantined": quarantine is not None,
        "quarantine_reason": quarantine.reason if quarantine is not None else "",
        "quarantined_seq": quarantine.seq if quarantine is not None else None,
        "drain_since": n.drain_since if n.draining else None,
        "drain_grace_s": n.drain_grace_s if n.draining else None,
        "heartbeat_age_s": _heartbeat_age(n, seen, now),
        "last_seen": seen.last_seen if seen is not None else None,
        "registered_ts": n.registered_ts,
        "agent_version": n.agent_version,
        "fabrics": [{"name": f.name, "kind": f.kind, "hcas": list(f.hcas)} for f in n.fabrics],
        "gpu_classes": classes,
        "gpus": gpus,
        "replicas": sorted(set(n.holders.values())),
        "orphans": [o.replica_id for o in n.orphans],
    }


def _gpu_rows(n: state.NodeState) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """A node's GPUs counted per class (free, used, unhealthy, why excluded), and each GPU."""
    orphaned = {g: o.replica_id for o in n.orphans for g in o.gpus}
    classes: dict[str, dict[str, Any]] = {}
    gpus: list[dict[str, Any]] = []
    for index in sorted(n.gpus):
        g = n.gpus[index]
        c = classes.setdefault(
            g.gpu_class, {"total": 0, "free": 0, "used": 0, "unhealthy": 0, "excluded": []}
        )
        c["total"] += 1
        holder = n.holders.get(index)
        problems = list(g.health_problems)
        if holder is not None:
            c["used"] += 1
        elif index in orphaned:
            c["used"] += 1
            c["excluded"].append(f"GPU {index}: held by an unknown process ({orphaned[index]})")
        elif problems:
            c["unhealthy"] += 1
            c["excluded"].append(f"GPU {index}: {', '.join(problems)}")
        else:
            c["free"] += 1
        gpus.append(
            {
                "index": index,
                "class": g.gpu_class,
                "memory_mib": g.memory_mib,
                "nvlink_domain": g.nvlink_domain,
                "replica": holder,
                "problems": problems,
            }
        )
    return classes, gpus


def _unregistered_quarantined(q: state.Quarantine) -> dict[str, Any]:
    """A node that never registered but was quarantined for what it wrote."""
    return {
        "name": q.node,
        "address": "",
        "state": "unregistered,quarantined",
        "liveness": "unregistered",
        "cordoned": False,
        "cordon_reason": "",
        "draining": False,
        "quarantined": True,
        "quarantine_reason": q.reason,
        "quarantined_seq": q.seq,
        "drain_since": None,
        "drain_grace_s": None,
        "heartbeat_age_s": None,
        "last_seen": None,
        "registered_ts": 0.0,
        "agent_version": "",
        "fabrics": [],
        "gpu_classes": {},
        "gpus": [],
        "replicas": [],
        "orphans": [],
    }


def replica_rows(st: state.ClusterState, model: str | None = None) -> list[dict[str, Any]]:
    """Replicas (optionally of one model) with their shards, phases, errors and log tails."""
    out: list[dict[str, Any]] = []
    for rid in sorted(st.replicas):
        r = st.replicas[rid]
        if model is not None and r.model != model:
            continue
        ep = st.endpoints.get(rid)
        out.append(
            {
                "id": rid,
                "model": r.model,
                "phase": "retired:" + _phase_summary(r) if r.retired else _phase_summary(r),
                "generation": r.generation,
                "revision": r.revision,
                "gpu_class": r.gpu_class,
                "fabric": r.fabric,
                "retired": r.retired,
                "retired_reason": r.retired_reason,
                "replaces": r.replaces,
                "reason": r.reason,
                "failures": r.failures,
                "placed_seq": r.placed_seq,
                "endpoint": ep.url if ep is not None else None,
                "shards": [
                    {
                        "shard": s.shard,
                        "node": s.node,
                        "gpus": list(s.gpus),
                        "port": s.port,
                        "phase": s.phase,
                        "endpoint": s.endpoint,
                        "error": s.error,
                        "log_tail": list(s.log_tail),
                    }
                    for s in r.shards
                ],
            }
        )
    return out


def _plan(st: state.ClusterState, now: float) -> reconcile.Outcome:
    return reconcile.plan(
        st, now, epoch=st.epoch, basis_seq=st.last_seq, config=reconcile.ReconcileConfig()
    )


def unplaceable(st: state.ClusterState, now: float) -> dict[str, str]:
    """Model -> why its missing replicas cannot be placed now (the reconciler's own words)."""
    return dict(_plan(st, now).unplaceable)


def unplaceable_codes(st: state.ClusterState, now: float) -> dict[str, str]:
    """Model -> the code of that refusal (llmgw.core.refusals): a metrics label."""
    return dict(_plan(st, now).unplaceable_codes)


def model_rows(
    st: state.ClusterState, now: float, why: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Declared models: wanted, active and serving replicas, and why any cannot be placed
    (`why`: the leader's own last verdicts; by default computed here)."""
    why = unplaceable(st, now) if why is None else why
    out: list[dict[str, Any]] = []
    by_model = st.active_by_model()
    for name in sorted(st.models):
        m = st.models[name]
        p = m.profile
        active = by_model.get(name, [])
        out.append(
            {
                "name": name,
                "engine": p.engine,
                "revision": m.revision,
                "replicas_wanted": target_replicas(m),
                "autoscale": _scaling_view(m),
                "replicas_active": len(active),
                "replicas_serving": sum(1 for r in active if r.id in st.endpoints),
                "gpus_per_replica": p.gpus_per_replica,
                "nodes_per_replica": p.nodes,
                "gpu_class": p.gpu_class,
                "aliases": list(p.aliases),
                "unplaceable": why.get(name),
                "profile": msgspec.to_builtins(p),
            }
        )
    return out


def endpoint_rows(st: state.ClusterState) -> list[dict[str, Any]]:
    return [
        {"replica": e.replica_id, "model": e.model, "url": e.url, "node": e.node}
        for _, e in sorted(st.endpoints.items())
    ]


def prometheus_targets(
    st: state.ClusterState, control: str, name: str, routers: Mapping[str, str] | None = None
) -> list[dict[str, Any]]:
    """Prometheus `http_sd_configs` target groups: every engine with an endpoint (one group
    per shard that serves HTTP, on the dynamic port the leader chose), labelled with its
    model, replica, shard, node, GPU class and engine; every agent that serves /metrics,
    labelled with its node; every router in `routers` (name -> `host:port`, from their
    load reports); and this control plane (`control`, its admin `host:port`, named
    `name`). Engines' keys are never listed. An address that is not `host:port` (a node
    writes its own) is left out rather than handed to Prometheus."""
    groups: list[dict[str, Any]] = []
    for rid in sorted(st.replicas):
        r = st.replicas[rid]
        if r.retired:
            continue
        model = st.models.get(r.model)
        engine = model.profile.engine if model is not None else ""
        for s in r.shards:
            target = _host_port(s.endpoint)
            if target is None:
                continue
            groups.append(
                {
                    "targets": [target],
                    "labels": {
                        "job": "llmgw-engine",
                        "model": r.model,
                        "replica": rid,
                        "shard": str(s.shard),
                        "node": s.node,
                        "gpu_class": r.gpu_class,
                        "engine": engine,
                        "phase": s.phase,
                    },
                }
            )
    for node in sorted(st.nodes):
        n = st.nodes[node]
        if _is_host_port(n.metrics):
            labels = {"job": "llmgw-agent", "node": node, "liveness": n.liveness}
            groups.append({"targets": [n.metrics], "labels": labels})
    for router in sorted(routers or {}):
        where = (routers or {})[router]
        if _is_host_port(where):
            groups.append({"targets": [where], "labels": {"job": "llmgw-router", "router": router}})
    groups.append({"targets": [control], "labels": {"job": "llmgw-control", "control": name}})
    return groups


def _host_port(url: str) -> str | None:
    """`host:port` of an engine's `http://host:port[/...]` endpoint, or None if it has none."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("http", "https"):
        return None
    hostport = rest.split("/", 1)[0]
    return hostport if _is_host_port(hostport) else None


_HOST_PORT = re.compile(
    r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?):[0-9]{1,5}"
)


def _is_host_port(text: str) -> bool:
    """Whether `text` is `host:port` (a DNS name, IPv4 or bracketed IPv6; port 1-65535)."""
    found = _HOST_PORT.fullmatch(text)
    return found is not None and 0 < int(text.rpartition(":")[2]) < 65536


def _scaling_view(m: state.ModelState) -> dict[str, object] | None:
    """An autoscaled model's bounds, pin and measured start-up time (None: not autoscaled)."""
    scale = m.profile.autoscale
    if scale is None:
        return None
    return {
        "min": scale.min,
        "max": scale.max,
        "priority": scale.priority,
        "desired": m.desired,
        "pinned": m.pinned,
        "pinned_by": m.pinned_by,
        "scaled_ts": m.scaled_ts,
        "startup_s": m.startup_s,
    }

"""The fleet's state as metric samples: what the control plane exports at each scrape.

Computed from the folded state when Prometheus asks, never kept up to date per event,
so a follower exports exactly what the leader does for the same sequence, and a fleet
of a thousand nodes costs one pass over its state per scrape. Every family lists each
value of its closed labels (liveness, GPU state, phase) even at zero, so that an alert
on "no ready node" or "no serving replica" sees a 0 rather than a series gone missing.

Purely computational; `llmgw.control.metrics` turns these into Prometheus families.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import get_args

import msgspec

from llmgw.core import state
from llmgw.core.phases import PHASES, RANK
from llmgw.core.state.model import Liveness
from llmgw.core.state.scaling import target_replicas

LIVENESS: tuple[str, ...] = get_args(Liveness)
FLAGS = ("cordoned", "draining", "quarantined")
GPU_STATES = ("free", "used", "unhealthy")


Samples = list[tuple[tuple[str, ...], float]]
"""(label values, value) pairs of one family."""


class Family(msgspec.Struct, frozen=True):
    """One gauge family: its name, help, label names and (label values, value) samples."""

    name: str
    help: str
    labels: tuple[str, ...]
    samples: Samples


def families(st: state.ClusterState, unplaceable: Mapping[str, str]) -> list[Family]:
    """The fleet's gauges from `st`; `unplaceable` maps a model to its placement refusal
    code (llmgw.core.refusals), the leader's last verdicts. Pure."""
    return [
        *_nodes(st),
        *_gpus(st),
        *_replicas(st),
        Family(
            "llmgw_fleet_model_unplaceable",
            "1 for a model whose missing replicas cannot be placed, by refusal code.",
            ("model", "reason"),
            [((m, code), 1.0) for m, code in sorted(unplaceable.items()) if m in st.models],
        ),
    ]


def _nodes(st: state.ClusterState) -> list[Family]:
    by_liveness = Counter[str](n.liveness for n in st.nodes.values())
    flags = Counter[str]()
    per_node: Samples = []
    for name in sorted(st.nodes):
        n = st.nodes[name]
        flags.update(
            f
            for f, on in zip(FLAGS, (n.cordoned, n.draining, name in st.quarantined), strict=True)
            if on
        )
        per_node += [((name, live), float(n.liveness == live)) for live in LIVENESS]
    # A node quarantined for what it wrote before it ever registered counts too.
    flags["quarantined"] += sum(1 for q in st.quarantined if q not in st.nodes)
    return [
        Family(
            "llmgw_fleet_nodes",
            "Registered nodes by liveness.",
            ("liveness",),
            [((live,), float(by_liveness[live])) for live in LIVENESS],
        ),
        Family(
            "llmgw_fleet_nodes_flagged",
            "Nodes cordoned, draining or quarantined (a node may carry several flags).",
            ("flag",),
            [((f,), float(flags[f])) for f in FLAGS],
        ),
        Family(
            "llmgw_fleet_node_liveness",
            "1 for each node's liveness (ready, unreachable, lost), 0 for the others.",
            ("node", "liveness"),
            per_node,
        ),
    ]


def _gpus(st: state.ClusterState) -> list[Family]:
    counts = Counter[tuple[str, str]]()
    unhealthy: Samples = []
    for name in sorted(st.nodes):
        n = st.nodes[name]
        orphaned = {g for o in n.orphans for g in o.gpus}
        for index in sorted(n.gpus):
            g = n.gpus[index]
            if index in n.holders or index in orphaned:
                counts[g.gpu_class, "used"] += 1
            elif g.health_problems:
                counts[g.gpu_class, "unhealthy"] += 1
                unhealthy += [((name, str(index), p), 1.0) for p in sorted(g.health_problems)]
            else:
                counts[g.gpu_class, "free"] += 1
    classes = sorted({c for c, _ in counts})
    return [
        Family(
            "llmgw_fleet_gpus",
            "GPUs by class and state: free, used (by a replica or an unknown process), unhealthy.",
            ("gpu_class", "state"),
            [((c, s), float(counts[c, s])) for c in classes for s in GPU_STATES],
        ),
        Family(
            "llmgw_fleet_gpu_unhealthy",
            "1 for each problem of each unhealthy GPU not in use, with the problem as reported.",
            ("node", "gpu", "problem"),
            unhealthy,
        ),
    ]


def replica_phase(replica: state.ReplicaState) -> str:
    """One phase for a replica of several shards: "failed" if any shard failed, else its
    least advanced shard's (a replica serves once every shard does). Pure."""
    found = [s.phase for s in replica.shards]
    if "failed" in found:
        return "failed"
    return min(found, key=lambda p: RANK.get(p, 9), default="placed")


def _replicas(st: state.ClusterState) -> list[Family]:
    phases = Counter((r.model, replica_phase(r)) for r in st.replicas.values() if not r.retired)
    models = sorted(st.models)
    wanted: Samples = []
    active: Samples = []
    serving: Samples = []
    by_model = st.active_by_model()
    for name in models:
        live = by_model.get(name, [])
        wanted.append(((name,), float(target_replicas(st.models[name]))))
        active.append(((name,), float(len(live))))
        serving.append(((name,), float(sum(1 for r in live if r.id in st.endpoints))))
    known = sorted(set(models) | {m for m, _ in phases})
    return [
        Family(
            "llmgw_fleet_replicas",
            "Replicas not retired, by model and phase (a replica of several shards: failed "
            "if one failed, else its least advanced shard's).",
            ("model", "phase"),
            [((m, p), float(phases[m, p])) for m in known for p in PHASES],
        ),
        Family(
            "llmgw_fleet_model_replicas_desired",
            "Replicas each declared model wants: its replicas, its autoscaler's count, or its pin.",
            ("model",),
            wanted,
        ),
        Family(
            "llmgw_fleet_model_replicas_active",
            "Replicas of each model placed and not retired (starting, loading or serving).",
            ("model",),
            active,
        ),
        Family(
            "llmgw_fleet_model_replicas_serving",
            "Replicas of each model with an endpoint up: what routers send requests to.",
            ("model",),
            serving,
        ),
    ]

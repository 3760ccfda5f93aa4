"""Observe: liveness and GPU health seen in heartbeats, recorded as control events."""

from __future__ import annotations

from llmgw.core import events
from llmgw.core.reconcile.batch import Batch, Decision, IdFactory, ReconcileConfig
from llmgw.core.state import ClusterState


def observe(
    state: ClusterState,
    now: float,
    *,
    epoch: int,
    basis_seq: int,
    config: ReconcileConfig,
    observing_since: float = 0.0,
    ids: IdFactory | None = None,
) -> list[Decision]:
    """Liveness and GPU health changes seen in heartbeats, as decisions to record. Pure."""
    b = Batch(now, epoch, basis_seq, ids)
    for name in sorted(state.nodes):
        node = state.nodes[name]
        seen = state.seen.get(name)
        last = max(seen.last_seen if seen is not None else node.registered_ts, observing_since)
        if node.liveness == "ready":
            if now - last > config.unreachable_after_s:
                b.add(events.NodeUnreachable, node=name, last_heartbeat=last)
                continue
            # A quarantined node's GPU health is not recorded at its say-so: each change is
            # a durable event written for it (llmgw.control.folding.METERED), and a node
            # over its share of the log must not go on writing it through the leader.
            # Nothing is placed there meanwhile; after its release, what differs is recorded.
            if seen is not None and seen.health and name not in state.quarantined:
                changed = tuple(
                    h
                    for h in seen.health
                    if h.index in node.gpus and h.differs_from(node.gpus[h.index])
                )
                if changed:
                    b.add(events.GpuHealthChanged, node=name, gpus=changed)
        elif seen is not None and seen.seq > node.liveness_seq:
            b.add(events.NodeRecovered, node=name)
        elif node.liveness == "unreachable" and now - last > config.lost_after_s:
            b.add(events.NodeLost, node=name, last_heartbeat=last)
    return b.out

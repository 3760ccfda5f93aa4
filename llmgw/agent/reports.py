"""The events an agent publishes, built from what discovery and the supervisor know.

NodeRegistered (whole inventory plus running shards) on every connect and
reconnect, Heartbeat with GPU health, ShardStatus per transition. Purely
computational, no side effects: ids and timestamps are arguments, and the
agent service publishes the results.
"""

from __future__ import annotations

from collections.abc import Iterable

from llmgw.agent.shards import LIVE, ShardView, running_shard, status_event
from llmgw.core import events
from llmgw.core.inventory import Gpu, Inventory

__all__ = ["gpu_health", "heartbeat", "registered", "status_event"]


def gpu_health(gpus: Iterable[Gpu]) -> tuple[events.GpuHealth, ...]:
    return tuple(events.GpuHealth.of(g) for g in gpus)


def registered(
    *,
    node: str,
    address: str,
    inventory: Inventory,
    shards: Iterable[ShardView],
    agent_version: str,
    event_id: str,
    ts: float,
    metrics: str = "",
) -> events.NodeRegistered:
    """The node as it is now; only live shards are listed (stopped and failed ones are history)."""
    return events.NodeRegistered(
        id=event_id,
        ts=ts,
        node=node,
        address=address,
        gpus=inventory.gpus,
        fabrics=inventory.fabrics,
        hcas=inventory.hcas,
        shards=tuple(running_shard(v) for v in shards if v.phase in LIVE),
        agent_version=agent_version,
        metrics=metrics,
    )


def heartbeat(
    *, node: str, seq: int, gpus: Iterable[Gpu], event_id: str, ts: float
) -> events.Heartbeat:
    return events.Heartbeat(id=event_id, ts=ts, node=node, seq=seq, gpus=gpu_health(gpus))

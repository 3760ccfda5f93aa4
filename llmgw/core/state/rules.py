"""The checks and bookkeeping the fold's handlers share.

Every handler checks before it mutates; a check that fails raises `Reject`, which `apply`
turns into the reason it returns, so a refused event changes nothing.
"""

from __future__ import annotations

from llmgw.core import events
from llmgw.core.phases import RANK, TERMINAL
from llmgw.core.state.model import ClusterState, NodeState, OrphanShard, ReplicaState, ShardState


class Reject(Exception):
    """Raised by a handler before it mutates anything; becomes apply's return value."""


def node_of(state: ClusterState, name: str) -> NodeState:
    node = state.nodes.get(name)
    if node is None:
        raise Reject(f"node {name!r} never registered")
    return node


def same_orphan(orphan: OrphanShard, replica_id: str, generation: int, shard: int) -> bool:
    return (
        orphan.replica_id == replica_id
        and orphan.shard == shard
        and orphan.generation == generation
    )


def find_orphan(
    node: NodeState, replica_id: str, generation: int, shard: int
) -> tuple[int, OrphanShard] | None:
    for i, orphan in enumerate(node.orphans):
        if same_orphan(orphan, replica_id, generation, shard):
            return i, orphan
    return None


def misplaced(node: NodeState, replica: ReplicaState, shard: ShardState) -> str:
    """Why `shard` can no longer run where it was placed on `node`; empty when it can."""
    missing = [g for g in shard.gpus if g not in node.gpus]
    if missing:
        return f"GPU {', '.join(map(str, missing))} of {node.name} is no longer in its inventory"
    for g in shard.gpus:
        if node.gpus[g].gpu_class != replica.gpu_class:
            return (
                f"GPU {g} of {node.name} is now {node.gpus[g].gpu_class}, not {replica.gpu_class}"
            )
    if replica.fabric and not any(f.name == replica.fabric and f.hcas for f in node.fabrics):
        return f"{node.name} is no longer on fabric {replica.fabric}"
    return ""


def can_enter(shard: ShardState, phase: str, what: str) -> None:
    if shard.phase in TERMINAL:
        raise Reject(f"{what}: phase {phase} after {shard.phase} (a generation does not restart)")
    if RANK[phase] < RANK[shard.phase]:
        raise Reject(f"{what}: phase {phase} after {shard.phase} is out of order")


def shard_ended(state: ClusterState, replica: ReplicaState, shard: ShardState, ts: float) -> None:
    """A shard stopped or failed: a retired replica's GPUs are free again."""
    if replica.retired:
        release(state, replica, shard)


def release(state: ClusterState, replica: ReplicaState, shard: ShardState) -> None:
    if shard.released:
        return
    shard.released = True
    node = state.nodes.get(shard.node)
    if node is not None:
        for g in shard.gpus:
            if node.holders.get(g) == replica.id:
                del node.holders[g]
        for port in (shard.port, shard.port + 1):
            if node.ports.get(port) == replica.id:
                del node.ports[port]
    if all(s.released for s in replica.shards):
        del state.replicas[replica.id]
        state.endpoints.pop(replica.id, None)


def check_epoch(state: ClusterState, ev: events.ControlEvent) -> None:
    if ev.epoch < state.epoch:
        raise Reject(
            f"{events.tag_of(type(ev))} {ev.id!r} was decided in epoch {ev.epoch}, "
            f"but epoch {state.epoch} leads: a deposed leader's decision"
        )


def command_shard(state: ClusterState, ev: events.Command) -> tuple[ReplicaState, ShardState]:
    check_epoch(state, ev)
    replica = state.replicas.get(ev.replica_id)
    what = f"{events.tag_of(type(ev))} for shard {ev.shard} of replica {ev.replica_id!r}"
    if replica is None:
        raise Reject(f"{what}, which does not exist")
    if not 0 <= ev.shard < len(replica.shards) or replica.shards[ev.shard].node != ev.node:
        raise Reject(f"{what} sent to node {ev.node!r}, which does not run it")
    if ev.generation != replica.generation:
        raise Reject(f"{what}: generation {ev.generation}, the replica is at {replica.generation}")
    return replica, replica.shards[ev.shard]

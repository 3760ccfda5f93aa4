"""The fold of operators' intents, the leader's decisions and the commands it sent."""

from __future__ import annotations

from typing import Any

from llmgw.core import catalog, events
from llmgw.core.limits import MAX_PORT
from llmgw.core.phases import TERMINAL
from llmgw.core.profile import ModelProfile
from llmgw.core.state.model import (
    ClusterState,
    Endpoint,
    Liveness,
    ModelState,
    NodeState,
    OrphanShard,
    Quarantine,
    ReplicaState,
    ShardState,
)
from llmgw.core.state.rules import Reject, check_epoch, command_shard, find_orphan, node_of, release

# --- operator intents


def on_model_declared(state: ClusterState, ev: events.ModelDeclared, seq: int, at: float) -> None:
    _set_model(state, ev.profile, float(ev.ts), declared=True)


def on_model_changed(state: ClusterState, ev: events.ModelChanged, seq: int, at: float) -> None:
    _set_model(state, ev.profile, float(ev.ts), declared=False)


_OWNERS = "_owners_cache"
"""The attribute beside ClusterState's fields that holds (models dict, its size, index)."""


def _owners(state: ClusterState) -> dict[str, str]:
    """Every declared name and alias -> its model, kept beside the state (not a field: no
    snapshot or digest holds it) and rebuilt when the models are not the ones it indexed.

    A declaration checks its names against every other model's. Reading each other model
    for that made folding N declarations cost N² / 2 reads of their names (4,000 models
    took 5 s of every reader's CPU, and every later declaration a millisecond more); with
    the index, a declaration costs its own names."""
    cached = getattr(state, _OWNERS, None)
    if cached is not None and cached[0] is state.models and cached[1] == len(state.models):
        index: dict[str, str] = cached[2]
        return index
    index = catalog.owner_index(m.profile for m in state.models.values())
    setattr(state, _OWNERS, (state.models, len(state.models), index))
    return index


def _reindex(state: ClusterState, old: ModelProfile | None, new: ModelProfile | None) -> None:
    """Move a model's names in the index read by `_owners` just before `state.models`
    changed with them."""
    index: dict[str, str] = getattr(state, _OWNERS)[2]
    if old is not None:
        for name in catalog.names_of(old):
            index.pop(name, None)
    if new is not None:
        index.update(dict.fromkeys(catalog.names_of(new), new.name))
    setattr(state, _OWNERS, (state.models, len(state.models), index))


def _set_model(state: ClusterState, profile: ModelProfile, ts: float, *, declared: bool) -> None:
    current = state.models.get(profile.name)
    if current is None and not declared:
        raise Reject(f"model {profile.name!r} was never declared: declare it first")
    found = catalog.problems(profile, owners=_owners(state))
    if found:
        raise Reject(f"model {profile.name!r} refused: " + "; ".join(found))
    if current is None:
        state.models[profile.name] = ModelState(profile=profile, revision=1, changed_ts=ts)
        _reindex(state, None, profile)
        return
    if current.profile == profile:
        return
    _reindex(state, current.profile, profile)
    if catalog.launch_relevant(current.profile, profile):
        current.revision += 1
        current.changed_ts = ts
    current.profile = profile


def on_model_removed(state: ClusterState, ev: events.ModelRemoved, seq: int, at: float) -> None:
    if ev.name not in state.models:
        raise Reject(f"model {ev.name!r} is not declared")
    _owners(state)
    _reindex(state, state.models.pop(ev.name).profile, None)


def on_cordoned(state: ClusterState, ev: events.NodeCordoned, seq: int, at: float) -> None:
    node = node_of(state, ev.node)
    node.cordoned = True
    node.cordon_reason = ev.reason


def on_uncordoned(state: ClusterState, ev: events.NodeUncordoned, seq: int, at: float) -> None:
    node = node_of(state, ev.node)
    node.cordoned = False
    node.cordon_reason = ""
    node.draining = False


def on_drain_requested(
    state: ClusterState, ev: events.NodeDrainRequested, seq: int, at: float
) -> None:
    node = node_of(state, ev.node)
    if not ev.grace_s >= 0:
        raise Reject(f"drain of {ev.node!r}: grace_s {ev.grace_s} must be 0 or more seconds")
    if node.draining:
        return
    node.draining = True
    node.drain_since = float(ev.ts)
    node.drain_grace_s = float(ev.grace_s)


# --- control decisions


def on_replica_placed(state: ClusterState, ev: events.ReplicaPlaced, seq: int, at: float) -> None:
    check_epoch(state, ev)
    current = state.replicas.get(ev.replica_id)
    if current is not None:
        _restarted(state, current, ev)
        return
    model = state.models.get(ev.model)
    if model is None:
        raise Reject(
            f"replica {ev.replica_id!r} placed for model {ev.model!r}, which is not declared"
        )
    if not ev.shards:
        raise Reject(f"replica {ev.replica_id!r} has no shards")
    if sorted(s.shard for s in ev.shards) != list(range(len(ev.shards))):
        raise Reject(f"replica {ev.replica_id!r}: shards must be numbered 0..{len(ev.shards) - 1}")
    classes = _check_assignments(state, ev)
    if len(classes) > 1:
        raise Reject(f"replica {ev.replica_id!r} mixes GPU classes {sorted(classes)}")
    nodes = {sa.node for sa in ev.shards}
    if len(nodes) > 1:
        for name in sorted(nodes):
            if not any(f.name == ev.fabric and f.hcas for f in state.nodes[name].fabrics):
                raise Reject(
                    f"replica {ev.replica_id!r} spans nodes but {name!r} is not on fabric "
                    f"{ev.fabric!r}"
                )
    shards = [
        ShardState(
            shard=sa.shard, node=sa.node, gpus=tuple(sa.gpus), port=sa.port, since=float(ev.ts)
        )
        for sa in sorted(ev.shards, key=lambda s: s.shard)
    ]
    replica = ReplicaState(
        id=ev.replica_id,
        model=ev.model,
        generation=ev.generation,
        shards=shards,
        gpu_class=classes.pop(),
        fabric=ev.fabric if len(nodes) > 1 else "",
        replaces=ev.replaces,
        reason=ev.reason,
        placed_ts=float(ev.ts),
        placed_seq=seq,
        revision=model.revision,
    )
    state.replicas[ev.replica_id] = replica
    for shard in shards:
        node = state.nodes[shard.node]
        for g in shard.gpus:
            node.holders[g] = replica.id
        if shard.port:
            node.ports[shard.port] = replica.id
            node.ports[shard.port + 1] = replica.id


def _check_assignments(state: ClusterState, ev: events.ReplicaPlaced) -> set[str]:
    """Raise Reject unless every shard's node, GPUs and ports are free for the replica;
    the GPU classes the shards use."""
    classes: set[str] = set()
    used: set[tuple[str, int]] = set()
    ports: set[tuple[str, int]] = set()
    for sa in sorted(ev.shards, key=lambda s: s.shard):
        node = state.nodes.get(sa.node)
        if node is None:
            raise Reject(
                f"replica {ev.replica_id!r} placed on node {sa.node!r}, which never registered"
            )
        if not sa.gpus:
            raise Reject(f"replica {ev.replica_id!r}: shard {sa.shard} has no GPUs")
        for g in sa.gpus:
            classes.add(_free_gpu(ev, sa, node, g, used))
            used.add((sa.node, g))
        if sa.port >= MAX_PORT:
            raise Reject(
                f"replica {ev.replica_id!r}: port {sa.port} of {sa.node!r} leaves no port "
                "after it (a shard uses two)"
            )
        for port in (sa.port, sa.port + 1):
            if sa.port and (port in node.ports or (sa.node, port) in ports):
                raise Reject(
                    f"replica {ev.replica_id!r}: port {port} of {sa.node!r} is already in use"
                )
            ports.add((sa.node, port))
    return classes


def _free_gpu(
    ev: events.ReplicaPlaced,
    sa: events.ShardAssignment,
    node: NodeState,
    g: int,
    used: set[tuple[str, int]],
) -> str:
    """GPU `g`'s class, after checking nothing else holds it; raises Reject."""
    gpu = node.gpus.get(g)
    if gpu is None:
        raise Reject(f"replica {ev.replica_id!r}: node {sa.node!r} has no GPU {g}")
    if (sa.node, g) in used:
        raise Reject(f"replica {ev.replica_id!r} uses GPU {g} of {sa.node!r} twice")
    holder = node.holders.get(g)
    if holder is not None:
        raise Reject(
            f"replica {ev.replica_id!r} placed on GPU {g} of {sa.node!r}, which is held "
            f"by replica {holder!r}"
        )
    for orphan in node.orphans:
        if g in orphan.gpus:
            raise Reject(
                f"replica {ev.replica_id!r} placed on GPU {g} of {sa.node!r}, which an "
                f"unknown process ({orphan.replica_id!r}) still uses"
            )
    return gpu.gpu_class


def _restarted(state: ClusterState, replica: ReplicaState, ev: events.ReplicaPlaced) -> None:
    """A new generation of an existing replica: the same placement, engines started afresh."""
    if ev.generation == replica.generation:
        return  # redelivery
    if ev.generation < replica.generation:
        raise Reject(
            f"replica {replica.id!r}: generation {ev.generation} is older than {replica.generation}"
        )
    if replica.retired:
        raise Reject(f"replica {replica.id!r} is retired and cannot restart")
    layout = sorted((s.shard, s.node, tuple(s.gpus), s.port) for s in ev.shards)
    if layout != [(s.shard, s.node, s.gpus, s.port) for s in replica.shards]:
        raise Reject(
            f"replica {replica.id!r}: generation {ev.generation} moves its shards; a move is a "
            "new replica"
        )
    replica.generation = ev.generation
    replica.reason = ev.reason
    for shard in replica.shards:
        shard.phase = "placed"
        shard.since = float(ev.ts)
        shard.endpoint = ""
        shard.api_key = ""
        shard.started = False
        shard.drain_sent_at = None
        shard.stop_sent = False


def on_replica_retired(state: ClusterState, ev: events.ReplicaRetired, seq: int, at: float) -> None:
    check_epoch(state, ev)
    replica = state.replicas.get(ev.replica_id)
    if replica is None:
        raise Reject(f"retired replica {ev.replica_id!r}, which does not exist")
    if replica.retired:
        return
    replica.retired = True
    replica.retired_reason = ev.reason
    replica.retired_ts = float(ev.ts)
    for shard in list(replica.shards):
        node = state.nodes.get(shard.node)
        # Nothing runs for a shard that ended, or that no agent was ever told to
        # start. A lost node's shard is released too, but its engine may well still
        # run there: it stays an orphan of that node (see `_orphan`).
        lost = node is not None and node.liveness == "lost"
        if node is not None and lost and shard.started and not shard.released:
            _orphan(node, replica, shard)
        if shard.phase in TERMINAL or (shard.phase == "placed" and not shard.started) or lost:
            release(state, replica, shard)
            if replica.id not in state.replicas:
                return


def _orphan(node: NodeState, replica: ReplicaState, shard: ShardState) -> None:
    """Remember that `shard`'s engine may still run on lost `node`, as an orphan.

    A lost node is often only cut off (a partition, a stalled agent) and comes back
    by heartbeat alone, with no registration report to say what runs. Without this,
    the GPUs of its retired replicas looked free while their engines still held
    them: the next replica placed there was refused by the agent, in a restart loop.
    As an orphan, placement avoids its GPUs, the reconciler stops it once the node
    is reachable again, and its `stopped` status (or the node's next registration)
    clears it.
    """
    if any(o.replica_id == replica.id and o.shard == shard.shard for o in node.orphans):
        return
    node.orphans.append(
        OrphanShard(
            replica_id=replica.id,
            generation=replica.generation,
            shard=shard.shard,
            gpus=tuple(shard.gpus),
        )
    )


def _liveness(state: ClusterState, ev: Any, new: Liveness, seq: int) -> NodeState:
    check_epoch(state, ev)
    node = node_of(state, ev.node)
    node.liveness = new
    node.liveness_seq = seq
    return node


def on_unreachable(state: ClusterState, ev: events.NodeUnreachable, seq: int, at: float) -> None:
    node = node_of(state, ev.node)
    if node.liveness != "ready":
        return
    _liveness(state, ev, "unreachable", seq).last_heartbeat = float(ev.last_heartbeat)


def on_lost(state: ClusterState, ev: events.NodeLost, seq: int, at: float) -> None:
    node = node_of(state, ev.node)
    if node.liveness == "lost":
        return
    check_epoch(state, ev)
    _liveness(state, ev, "lost", seq).last_heartbeat = float(ev.last_heartbeat)
    for rid in sorted(set(node.holders.values())):
        replica = state.replicas.get(rid)
        if replica is None:
            continue
        for shard in replica.shards:
            if shard.node != ev.node or shard.released:
                continue
            running = shard.started and shard.phase not in TERMINAL
            if shard.phase not in TERMINAL:
                shard.phase = "failed"
                shard.error = f"node {ev.node} lost"
                shard.since = float(ev.ts)
            if replica.retired:
                if running:
                    _orphan(node, replica, shard)
                release(state, replica, shard)
                if rid not in state.replicas:
                    break


def on_recovered(state: ClusterState, ev: events.NodeRecovered, seq: int, at: float) -> None:
    node = node_of(state, ev.node)
    if node.liveness == "ready":
        return
    _liveness(state, ev, "ready", seq)


def on_gpu_health(state: ClusterState, ev: events.GpuHealthChanged, seq: int, at: float) -> None:
    check_epoch(state, ev)
    node = node_of(state, ev.node)
    for h in ev.gpus:
        if h.index not in node.gpus:
            raise Reject(f"node {ev.node!r} has no GPU {h.index}")
    for h in ev.gpus:
        node.gpus[h.index] = h.applied_to(node.gpus[h.index])


def on_quarantined(state: ClusterState, ev: events.NodeQuarantined, seq: int, at: float) -> None:
    check_epoch(state, ev)
    if ev.node in state.quarantined:
        return  # already: the first quarantine's sequence stands
    state.quarantined[ev.node] = Quarantine(
        node=ev.node, reason=ev.reason, seq=seq, ts=float(ev.ts)
    )


def on_released(state: ClusterState, ev: events.NodeReleased, seq: int, at: float) -> None:
    check_epoch(state, ev)
    if state.quarantined.pop(ev.node, None) is None:
        raise Reject(f"node {ev.node!r} released, but it is not quarantined")


def on_endpoint_up(state: ClusterState, ev: events.EndpointUp, seq: int, at: float) -> None:
    check_epoch(state, ev)
    replica = state.replicas.get(ev.replica_id)
    if replica is None or replica.retired:
        raise Reject(f"endpoint up for replica {ev.replica_id!r}, which is not active")
    state.endpoints[ev.replica_id] = Endpoint(
        replica_id=ev.replica_id, model=ev.model, url=ev.url, node=ev.node, api_key=ev.api_key
    )


def on_endpoint_down(state: ClusterState, ev: events.EndpointDown, seq: int, at: float) -> None:
    check_epoch(state, ev)
    state.endpoints.pop(ev.replica_id, None)


def on_leader(state: ClusterState, ev: events.LeaderElected, seq: int, at: float) -> None:
    if ev.epoch <= state.epoch:
        raise Reject(
            f"leader {ev.leader!r} claims epoch {ev.epoch}, not newer than the current "
            f"{state.epoch}"
        )
    state.epoch = ev.epoch
    state.leader = ev.leader


# --- commands (in the same log, so the fold knows what was already asked)


def on_start(state: ClusterState, ev: events.StartShard, seq: int, at: float) -> None:
    _replica, shard = command_shard(state, ev)
    shard.started = True


def on_drain(state: ClusterState, ev: events.DrainShard, seq: int, at: float) -> None:
    _replica, shard = command_shard(state, ev)
    if shard.drain_sent_at is None:
        shard.drain_sent_at = float(ev.ts)


def on_stop(state: ClusterState, ev: events.StopShard, seq: int, at: float) -> None:
    replica = state.replicas.get(ev.replica_id)
    live = (
        replica is not None
        and ev.generation == replica.generation
        and 0 <= ev.shard < len(replica.shards)
        and not replica.shards[ev.shard].released
    )
    if not live:
        # An orphan: a replica the log does not know, an older generation of one (what
        # an agent reported still running), or a shard released while its node was lost.
        check_epoch(state, ev)
        node = node_of(state, ev.node)
        found = find_orphan(node, ev.replica_id, ev.generation, ev.shard)
        if found is not None:
            orphan = found[1]
            orphan.stop_sent = True
            orphan.stop_sent_at = float(ev.ts)
            orphan.stops += 1
            return
        if replica is None:
            raise Reject(
                f"stop for shard {ev.shard} of replica {ev.replica_id!r}, which does not exist"
            )
    replica, shard = command_shard(state, ev)
    shard.stop_sent = True
    if replica.retired and shard.phase == "placed" and not shard.started:
        release(state, replica, shard)

"""The fold of what agents report: registrations, heartbeats, shard status."""

from __future__ import annotations

from llmgw.core import events
from llmgw.core.inventory import Gpu
from llmgw.core.phases import RUNNING, TERMINAL
from llmgw.core.state import scaling
from llmgw.core.state.model import (
    ClusterState,
    NodeState,
    OrphanShard,
    ReplicaState,
    Seen,
    ShardState,
)
from llmgw.core.state.rules import (
    Reject,
    can_enter,
    find_orphan,
    misplaced,
    same_orphan,
    shard_ended,
)


def on_registered(state: ClusterState, ev: events.NodeRegistered, seq: int, at: float) -> None:
    """A node's inventory and the shards its agent runs: checked whole, then folded."""
    gpus = _inventory(ev)
    old = state.nodes.get(ev.node)
    reported, orphans = _running(state, ev, old)
    # Validated; now mutate.
    if old is None:
        node = NodeState(name=ev.node, address=ev.address, gpus=gpus)
        state.nodes[ev.node] = node
    else:
        node = old
        node.address = ev.address
        node.gpus = gpus
    node.fabrics = ev.fabrics
    node.hcas = ev.hcas
    node.agent_version = ev.agent_version
    node.metrics = ev.metrics
    node.registered_ts = float(ev.ts)
    node.liveness = "ready"
    node.liveness_seq = seq
    node.orphans = orphans
    state.seen[ev.node] = Seen(last_seen=at, seq=seq)
    # The report is authoritative about what runs: a shard we believed running
    # that the agent no longer has died with the agent (or was never started).
    for rid in sorted(set(node.holders.values())):
        replica = state.replicas[rid]
        for shard in replica.shards:
            if shard.node == ev.node and not shard.released:
                _reregistered(state, node, replica, shard, reported, float(ev.ts))


def _inventory(ev: events.NodeRegistered) -> dict[int, Gpu]:
    gpus: dict[int, Gpu] = {}
    for gpu in ev.gpus:
        if gpu.index in gpus:
            raise Reject(f"node {ev.node!r} lists GPU {gpu.index} twice")
        gpus[gpu.index] = gpu
    return gpus


def _running(
    state: ClusterState, ev: events.NodeRegistered, old: NodeState | None
) -> tuple[dict[tuple[str, int], events.RunningShard], list[OrphanShard]]:
    """The registration's running shards: those of a current generation the log placed
    there, by (replica, shard), and the others as orphans to stop. Raises Reject."""
    reported: dict[tuple[str, int], events.RunningShard] = {}
    orphans: list[OrphanShard] = []
    claimed: dict[int, str] = {}
    for rs in ev.shards:
        for g in rs.gpus:
            if g in claimed and claimed[g] != rs.replica_id:
                raise Reject(
                    f"node {ev.node!r} reports GPU {g} in use by both {claimed[g]!r} and "
                    f"{rs.replica_id!r}"
                )
            claimed[g] = rs.replica_id
        if _placed_here(state, ev, rs):
            reported[(rs.replica_id, rs.shard)] = rs
        else:
            # Unknown replica, or an older generation: a process to stop.
            orphans.append(_orphan(ev, old, rs))
    return reported, orphans


def _placed_here(state: ClusterState, ev: events.NodeRegistered, rs: events.RunningShard) -> bool:
    """True when `rs` is the current generation of a shard placed on this node; raises
    Reject when it claims a known shard the log placed elsewhere or on other GPUs."""
    replica = state.replicas.get(rs.replica_id)
    if replica is None or not 0 <= rs.shard < len(replica.shards):
        return False
    shard = replica.shards[rs.shard]
    if shard.node != ev.node:
        raise Reject(
            f"node {ev.node!r} claims shard {rs.shard} of replica {rs.replica_id!r}, "
            f"which is assigned to node {shard.node!r}"
        )
    if tuple(rs.gpus) != tuple(shard.gpus):
        raise Reject(
            f"node {ev.node!r} claims GPUs {list(rs.gpus)} for shard {rs.shard} of "
            f"replica {rs.replica_id!r}, which holds GPUs {list(shard.gpus)}"
        )
    return rs.generation == replica.generation


def _orphan(
    ev: events.NodeRegistered, old: NodeState | None, rs: events.RunningShard
) -> OrphanShard:
    if old is not None:
        for g in rs.gpus:
            holder = old.holders.get(g)
            if holder is not None and holder != rs.replica_id:
                raise Reject(
                    f"node {ev.node!r} claims GPU {g} for replica {rs.replica_id!r}, but "
                    f"GPU {g} is held by replica {holder!r}"
                )
    orphan = OrphanShard(
        replica_id=rs.replica_id, generation=rs.generation, shard=rs.shard, gpus=rs.gpus
    )
    if old is not None:
        # The same orphan reported again keeps its stop history: an agent that
        # re-registers does not reset the reconciler's backoff.
        for known in old.orphans:
            if same_orphan(known, rs.replica_id, rs.generation, rs.shard):
                orphan.stop_sent = known.stop_sent
                orphan.stop_sent_at = known.stop_sent_at
                orphan.stops = known.stops
                break
    return orphan


def _reregistered(
    state: ClusterState,
    node: NodeState,
    replica: ReplicaState,
    shard: ShardState,
    reported: dict[tuple[str, int], events.RunningShard],
    ts: float,
) -> None:
    """One shard the log placed on a node that registered again, at the registration's `ts`."""
    misfit = misplaced(node, replica, shard)
    if misfit:
        # The hardware under the shard changed (a GPU fell off the bus, a
        # fabric was relabelled): the shard cannot run as placed.
        if shard.phase not in TERMINAL:
            shard.phase = "failed"
            shard.error = misfit
            shard.since = ts
            if not replica.retired:
                replica.failures += 1
                replica.failed_ts = ts
        shard_ended(state, replica, shard, ts)
        return
    report = reported.get((replica.id, shard.shard))
    if report is not None:
        # A generation that ended stays ended (the reconciler restarts it
        # as the next generation); a report never resurrects it.
        if report.phase != shard.phase and shard.phase not in TERMINAL:
            shard.phase = report.phase
            shard.since = ts
        if report.endpoint:
            shard.endpoint = report.endpoint
        if report.phase in TERMINAL:
            shard_ended(state, replica, shard, ts)
    elif shard.phase in RUNNING:
        if replica.retired:
            shard.phase = "stopped"
        else:
            shard.phase = "failed"
            shard.error = "not running when its agent registered again"
            replica.failures += 1
            replica.failed_ts = ts
        shard.since = ts
        shard_ended(state, replica, shard, ts)


def on_heartbeat(state: ClusterState, ev: events.Heartbeat, seq: int, at: float) -> None:
    node = state.nodes.get(ev.node)
    if node is None:
        raise Reject(f"heartbeat from node {ev.node!r}, which never registered")
    health = _known_once(ev.gpus, node)
    seen = state.seen.get(ev.node)
    if seen is None:
        state.seen[ev.node] = Seen(last_seen=float(at), seq=seq, health=health or None)
    else:
        seen.last_seen = float(at)
        seen.seq = seq
        if health:
            seen.health = health


def _known_once(
    health: tuple[events.GpuHealth, ...], node: NodeState
) -> tuple[events.GpuHealth, ...]:
    """The heartbeat's report of each GPU the node registered, the first one of each."""
    if all(h.index in node.gpus for h in health) and len({h.index for h in health}) == len(health):
        return health
    # A GPU the inventory lacks (fallen off the bus since registration) is dropped, not
    # refused: the heartbeat still proves life, and the next registration updates the
    # inventory. A GPU listed twice, two ways, is kept once: the leader would otherwise
    # record each report in turn as a change, at every pass, for ever.
    out: dict[int, events.GpuHealth] = {}
    for h in health:
        if h.index in node.gpus:
            out.setdefault(h.index, h)
    return tuple(out.values())


def on_shard_status(state: ClusterState, ev: events.ShardStatus, seq: int, at: float) -> None:
    node = state.nodes.get(ev.node)
    if node is None:
        raise Reject(f"shard status from node {ev.node!r}, which never registered")
    what = f"shard {ev.shard} of replica {ev.replica_id!r} (generation {ev.generation})"
    replica = state.replicas.get(ev.replica_id)
    if _orphan_status(node, replica, ev):
        return
    if replica is None:
        raise Reject(f"status for {what}, which was never placed")
    if not 0 <= ev.shard < len(replica.shards):
        raise Reject(f"status for {what}: replica {ev.replica_id!r} has no shard {ev.shard}")
    shard = replica.shards[ev.shard]
    if shard.node != ev.node:
        raise Reject(f"node {ev.node!r} reports {what}, which is assigned to node {shard.node!r}")
    if ev.generation < replica.generation:
        raise Reject(f"stale status for {what}: the replica is at generation {replica.generation}")
    if ev.generation > replica.generation:
        raise Reject(f"status for {what}: generation {ev.generation} was never placed")
    if ev.phase == shard.phase:
        return  # redelivery
    can_enter(shard, ev.phase, what)
    shard.phase = ev.phase
    shard.since = float(ev.ts)
    if ev.endpoint:
        shard.endpoint = ev.endpoint
    if ev.api_key:
        shard.api_key = ev.api_key
    if ev.phase == "failed":
        shard.error = ev.error or "failed"
        shard.log_tail = ev.log_tail
        if not replica.retired and not shard.stop_sent:
            replica.failures += 1
            replica.failed_ts = float(ev.ts)
    elif ev.phase == "serving":
        replica.failures = 0
        shard.error = ""
        shard.log_tail = ()
        scaling.note_serving(state, replica, float(ev.ts))
    elif ev.error:
        shard.error = ev.error
    if ev.phase in TERMINAL:
        shard_ended(state, replica, shard, float(ev.ts))


def _orphan_status(node: NodeState, replica: ReplicaState | None, ev: events.ShardStatus) -> bool:
    """True when `ev` is the status of one of the node's orphans (an orphan that ended is
    forgotten); False when it is not an orphan's, to be checked as a shard's."""
    # An orphan's status: a replica the log does not know, or a shard of one that was
    # released while its node was lost (the rest of a multi-node replica lives on).
    released_here = (
        replica is not None
        and 0 <= ev.shard < len(replica.shards)
        and replica.shards[ev.shard].released
        and replica.shards[ev.shard].node == ev.node
    )
    if replica is None or released_here:
        for i, orphan in enumerate(node.orphans):
            if orphan.replica_id == ev.replica_id and orphan.shard == ev.shard:
                if ev.phase in TERMINAL:
                    del node.orphans[i]
                return True
        return False
    if ev.generation < replica.generation:
        # An older generation of a live replica that its agent reported still running.
        found = find_orphan(node, ev.replica_id, ev.generation, ev.shard)
        if found is not None:
            if ev.phase in TERMINAL:
                del node.orphans[found[0]]
            return True
    return False

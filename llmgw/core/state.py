"""Cluster state, and the fold that builds it from the log.

`ClusterState` is what the control plane knows: nodes with their inventory,
liveness and operator flags, the GPUs each replica holds, declared models,
replicas and their shards' phases, endpoints and the leader epoch. It changes
only through `apply(state, event, seq)`, called for every record of the log in
order — by the control service (leader and followers), by `llmgw ctl replay`,
and by tests. The reconciler (`llmgw.core.reconcile`) and placement read it.

The fold is pure and deterministic (no I/O, no clock) and mutates `state` in
place for speed. It never raises: an event that contradicts the state (shard
status for a replica never placed, phases out of order, a node claiming GPUs
held by another, an event for a node that never registered) is refused, leaves
the state untouched, and `apply` returns the reason so the shell logs it with
the sequence number.

Durable and volatile. Heartbeats expire from the log (per-message TTL), so a
replay never sees them. Everything a heartbeat carries therefore lands only in
`state.seen`, which is volatile: kept in snapshots, excluded from `digest`.
The reconciler turns what it observes there into recorded control events
(NodeUnreachable, NodeLost, NodeRecovered, GpuHealthChanged), and the durable
state takes liveness and GPU health only from those. That is what lets a
replay of the log reach the leader's digest and reproduce its decisions.

Quarantine. From a node's NodeQuarantined until its NodeReleased, the fold refuses that
node's registrations and shard reports (`ignored_by_quarantine`) and keeps its heartbeats;
placement gives it nothing. The rule depends only on the order of the log, so every
reader agrees, and the leader may delete the refused messages without changing any fold
(llmgw.control.quota, docs/security.md).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any, Literal

import msgspec

from llmgw.core import catalog, events
from llmgw.core.inventory import Fabric, Gpu, Hca
from llmgw.core.limits import MAX_PORT
from llmgw.core.profile import ModelProfile

Liveness = Literal["ready", "unreachable", "lost"]
Phase = Literal["placed", "starting", "loading", "serving", "draining", "stopped", "failed"]

# Forward order of a shard's phases. A status may skip ahead (an agent can
# coalesce starting and loading) but never go back within one generation:
# "loading" after "serving" is a stale or forged report.
_RANK: dict[str, int] = {
    "placed": 0,
    "starting": 1,
    "loading": 2,
    "serving": 3,
    "draining": 4,
    "stopped": 5,
    "failed": 5,
}
TERMINAL = frozenset({"stopped", "failed"})
RUNNING = frozenset({"starting", "loading", "serving", "draining"})

SNAPSHOT_FORMAT = 1

# The state's Structs are declared gc=False: they never form reference cycles,
# and leaving tens of thousands of them out of the cyclic collector keeps its
# pauses out of the fold's and the reconciler's latency.


class ShardState(msgspec.Struct, kw_only=True, gc=False):
    """One shard of a replica: a node, GPUs on it, a port, and where its engine is."""

    shard: int
    node: str
    gpus: tuple[int, ...]
    port: int = 0
    phase: Phase = "placed"
    since: float = 0.0
    """Producer time of the last phase change."""
    endpoint: str = ""
    api_key: str = ""
    """The key its engine requires (shard 0), from its serving status."""
    error: str = ""
    log_tail: tuple[str, ...] = ()
    started: bool = False
    """A StartShard for the current generation is in the log."""
    drain_sent_at: float | None = None
    stop_sent: bool = False
    released: bool = False
    """Its GPUs and port are free again (a retired replica's shard that stopped)."""


class ReplicaState(msgspec.Struct, kw_only=True, gc=False):
    id: str
    model: str
    generation: int
    shards: list[ShardState]
    gpu_class: str = ""
    fabric: str = ""
    replaces: str = ""
    reason: str = ""
    placed_ts: float = 0.0
    placed_seq: int = 0
    revision: int = 0
    """The model's revision it runs; older than the model's: replaced by a rolling move."""
    retired: bool = False
    retired_reason: str = ""
    retired_ts: float = 0.0
    failures: int = 0
    """Failures since it last served; sets the restart backoff."""
    failed_ts: float = 0.0


class ModelState(msgspec.Struct, kw_only=True, gc=False):
    profile: ModelProfile
    revision: int = 1
    """Bumped when a change needs new engines (not for replicas/aliases/deadlines)."""
    changed_ts: float = 0.0


class OrphanShard(msgspec.Struct, kw_only=True, gc=False):
    """A shard an agent reported running that belongs to no replica the log knows."""

    replica_id: str
    generation: int
    shard: int
    gpus: tuple[int, ...]
    stop_sent: bool = False
    stop_sent_at: float = 0.0
    """Producer time of the last StopShard for it: the next one waits out a backoff."""
    stops: int = 0
    """StopShards sent for it so far (the reconciler doubles the wait after each)."""


class NodeState(msgspec.Struct, kw_only=True, gc=False):
    name: str
    address: str
    gpus: dict[int, Gpu]
    fabrics: tuple[Fabric, ...] = ()
    hcas: tuple[Hca, ...] = ()
    agent_version: str = ""
    registered_ts: float = 0.0
    liveness: Liveness = "ready"
    liveness_seq: int = 0
    """Sequence of the event that last set liveness: a later heartbeat means recovered."""
    last_heartbeat: float = 0.0
    """As recorded by the leader's NodeUnreachable / NodeLost."""
    cordoned: bool = False
    cordon_reason: str = ""
    draining: bool = False
    drain_since: float = 0.0
    drain_grace_s: float = 0.0
    holders: dict[int, str] = {}
    """GPU index -> id of the replica whose shard holds it."""
    ports: dict[int, str] = {}
    """Port -> id of the replica whose shard uses it."""
    orphans: list[OrphanShard] = []


class Endpoint(msgspec.Struct, kw_only=True, gc=False):
    replica_id: str
    model: str
    url: str
    node: str = ""
    api_key: str = ""


class Seen(msgspec.Struct, kw_only=True, gc=False):
    """Volatile: the latest heartbeat of a node (not in the digest; see module docstring)."""

    last_seen: float
    seq: int
    health: tuple[events.GpuHealth, ...] | None = None


class Quarantine(msgspec.Struct, kw_only=True, gc=False):
    """A node whose log traffic exceeded its budget (see NodeQuarantined)."""

    node: str
    reason: str = ""
    seq: int = 0
    """Sequence of the NodeQuarantined event: the node's later events are ignored."""
    ts: float = 0.0


class ClusterState(msgspec.Struct, kw_only=True):
    nodes: dict[str, NodeState] = {}
    models: dict[str, ModelState] = {}
    replicas: dict[str, ReplicaState] = {}
    endpoints: dict[str, Endpoint] = {}
    epoch: int = 0
    leader: str = ""
    quarantined: dict[str, Quarantine] = {}
    """Node -> its quarantine; a node may be quarantined before it ever registered."""
    # Not part of the digest:
    last_seq: int = 0
    seen: dict[str, Seen] = {}

    def active_replicas(self, model: str | None = None) -> list[ReplicaState]:
        return [
            r
            for r in self.replicas.values()
            if not r.retired and (model is None or r.model == model)
        ]


class _Snapshot(msgspec.Struct, kw_only=True):
    format: int
    state: ClusterState


_digest_encoder = msgspec.msgpack.Encoder()
_snapshot_encoder = msgspec.msgpack.Encoder()
_snapshot_decoder = msgspec.msgpack.Decoder(_Snapshot)


def _canonical(struct: msgspec.Struct) -> list[Any]:
    """A struct's fields with every mapping as key-sorted pairs: independent of insertion order."""
    return [
        sorted(value.items()) if isinstance(value, dict) else value
        for value in msgspec.structs.astuple(struct)
    ]


def digest(state: ClusterState) -> str:
    """sha256 of the durable state's canonical encoding: equal iff the logs folded agree.

    The volatile part (`seen`: heartbeats) and `last_seq` are left out, so a
    replay of the log after heartbeats expired reaches the leader's digest.
    """
    durable = [
        [_canonical(state.nodes[k]) for k in sorted(state.nodes)],
        [(k, state.models[k]) for k in sorted(state.models)],
        [(k, state.replicas[k]) for k in sorted(state.replicas)],
        [(k, state.endpoints[k]) for k in sorted(state.endpoints)],
        state.epoch,
        state.leader,
    ]
    if state.quarantined:
        # Only when there is one: the digest of every log without quarantines is unchanged.
        durable.append([(k, state.quarantined[k]) for k in sorted(state.quarantined)])
    return hashlib.sha256(_digest_encoder.encode(durable)).hexdigest()


def encode_snapshot(state: ClusterState) -> bytes:
    """The whole state (volatile part included) as bytes; store with `state.last_seq`."""
    return _snapshot_encoder.encode(_Snapshot(format=SNAPSHOT_FORMAT, state=state))


def decode_snapshot(data: bytes | bytearray | memoryview) -> ClusterState:
    """Inverse of encode_snapshot; raises ValueError on bytes that are not a snapshot."""
    try:
        snap = _snapshot_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"not an llmgw state snapshot: {exc}") from None
    if snap.format != SNAPSHOT_FORMAT:
        raise ValueError(
            f"snapshot format {snap.format}, this llmgw reads {SNAPSHOT_FORMAT}: "
            "fold the log from the start instead (delete the snapshot)"
        )
    return snap.state


def fold(
    records: Iterable[tuple[int, events.Event]], state: ClusterState | None = None
) -> tuple[ClusterState, list[tuple[int, str]]]:
    """Fold (seq, event) pairs into a state; returns it and the (seq, reason) rejections."""
    st = state if state is not None else ClusterState()
    rejected: list[tuple[int, str]] = []
    for seq, event in records:
        reason = apply(st, event, seq)
        if reason is not None:
            rejected.append((seq, reason))
    return st, rejected


# --------------------------------------------------------------------------- the fold


class _Reject(Exception):
    """Raised by a handler before it mutates anything; becomes apply's return value."""


Handler = Callable[[ClusterState, Any, int, float], None]


def apply(
    state: ClusterState, event: events.Event, seq: int, at: float | None = None
) -> str | None:
    """Fold one event read at stream sequence `seq`; None when applied, else why it was refused.

    `at` is the log's own timestamp of the record (the server's clock); it only
    dates heartbeats in the volatile part and defaults to the event's `ts`.
    Purely computational; never raises. Handlers check everything before they
    mutate, so a refused event changes nothing. Times are stored as floats even
    when an in-process event carries an int, so a state and its snapshot digest
    alike (events decoded from the log always carry floats).
    """
    if seq and seq <= state.last_seq:
        return f"sequence {seq} was already folded (state is at {state.last_seq})"
    handler = _HANDLERS.get(type(event))
    q = None
    if state.quarantined and isinstance(event, QUARANTINABLE):
        q = state.quarantined.get(event.node)
    if q is not None:
        reason: str | None = (
            f"node {q.node!r} is quarantined since seq {q.seq} ({q.reason}): "
            f"its {events.tag_of(type(event))} events are not folded"
        )
    elif handler is None:
        reason = f"{type(event).__name__} is not an event the fold knows"
    else:
        try:
            handler(state, event, seq, event.ts if at is None else at)
            reason = None
        except _Reject as exc:
            reason = str(exc)
        except Exception as exc:  # the fold must survive any event; say what broke
            reason = f"internal error folding {type(event).__name__}: {exc!r}"
    if seq:
        state.last_seq = seq
    return reason


QUARANTINABLE = (events.NodeRegistered, events.ShardStatus)
"""What a quarantined node's events the fold ignores: all but heartbeats (liveness)."""


def ignored_by_quarantine(state: ClusterState, event: events.Event) -> bool:
    """True when `event` is a quarantined node's registration or shard status: the fold
    refuses it, and the leader may delete it from the log, since no fold ever uses it."""
    return isinstance(event, QUARANTINABLE) and event.node in state.quarantined


def _node(state: ClusterState, name: str) -> NodeState:
    node = state.nodes.get(name)
    if node is None:
        raise _Reject(f"node {name!r} never registered")
    return node


# --- node events


def _registered(state: ClusterState, ev: events.NodeRegistered, seq: int, at: float) -> None:
    gpus: dict[int, Gpu] = {}
    for gpu in ev.gpus:
        if gpu.index in gpus:
            raise _Reject(f"node {ev.node!r} lists GPU {gpu.index} twice")
        gpus[gpu.index] = gpu
    old = state.nodes.get(ev.node)
    reported: dict[tuple[str, int], events.RunningShard] = {}
    orphans: list[OrphanShard] = []
    claimed: dict[int, str] = {}
    for rs in ev.shards:
        for g in rs.gpus:
            if g in claimed and claimed[g] != rs.replica_id:
                raise _Reject(
                    f"node {ev.node!r} reports GPU {g} in use by both {claimed[g]!r} and "
                    f"{rs.replica_id!r}"
                )
            claimed[g] = rs.replica_id
        replica = state.replicas.get(rs.replica_id)
        if replica is not None and 0 <= rs.shard < len(replica.shards):
            shard = replica.shards[rs.shard]
            if shard.node != ev.node:
                raise _Reject(
                    f"node {ev.node!r} claims shard {rs.shard} of replica {rs.replica_id!r}, "
                    f"which is assigned to node {shard.node!r}"
                )
            if tuple(rs.gpus) != tuple(shard.gpus):
                raise _Reject(
                    f"node {ev.node!r} claims GPUs {list(rs.gpus)} for shard {rs.shard} of "
                    f"replica {rs.replica_id!r}, which holds GPUs {list(shard.gpus)}"
                )
            if rs.generation == replica.generation:
                reported[(rs.replica_id, rs.shard)] = rs
                continue
        # Unknown replica, or an older generation: a process to stop.
        if old is not None:
            for g in rs.gpus:
                holder = old.holders.get(g)
                if holder is not None and holder != rs.replica_id:
                    raise _Reject(
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
                if _same_orphan(known, rs.replica_id, rs.generation, rs.shard):
                    orphan.stop_sent = known.stop_sent
                    orphan.stop_sent_at = known.stop_sent_at
                    orphan.stops = known.stops
                    break
        orphans.append(orphan)
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
            if shard.node != ev.node or shard.released:
                continue
            misfit = misplaced(node, replica, shard)
            if misfit:
                # The hardware under the shard changed (a GPU fell off the bus, a
                # fabric was relabelled): the shard cannot run as placed.
                if shard.phase not in TERMINAL:
                    shard.phase = "failed"
                    shard.error = misfit
                    shard.since = float(ev.ts)
                    if not replica.retired:
                        replica.failures += 1
                        replica.failed_ts = float(ev.ts)
                _shard_ended(state, replica, shard, float(ev.ts))
                continue
            report = reported.get((rid, shard.shard))
            if report is not None:
                # A generation that ended stays ended (the reconciler restarts it
                # as the next generation); a report never resurrects it.
                if report.phase != shard.phase and shard.phase not in TERMINAL:
                    shard.phase = report.phase
                    shard.since = float(ev.ts)
                if report.endpoint:
                    shard.endpoint = report.endpoint
                if report.phase in TERMINAL:
                    _shard_ended(state, replica, shard, float(ev.ts))
            elif shard.phase in RUNNING:
                if replica.retired:
                    shard.phase = "stopped"
                else:
                    shard.phase = "failed"
                    shard.error = "not running when its agent registered again"
                    replica.failures += 1
                    replica.failed_ts = float(ev.ts)
                shard.since = float(ev.ts)
                _shard_ended(state, replica, shard, float(ev.ts))


def _same_orphan(orphan: OrphanShard, replica_id: str, generation: int, shard: int) -> bool:
    return (
        orphan.replica_id == replica_id
        and orphan.shard == shard
        and orphan.generation == generation
    )


def _find_orphan(
    node: NodeState, replica_id: str, generation: int, shard: int
) -> tuple[int, OrphanShard] | None:
    for i, orphan in enumerate(node.orphans):
        if _same_orphan(orphan, replica_id, generation, shard):
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


def _heartbeat(state: ClusterState, ev: events.Heartbeat, seq: int, at: float) -> None:
    node = state.nodes.get(ev.node)
    if node is None:
        raise _Reject(f"heartbeat from node {ev.node!r}, which never registered")
    health = ev.gpus
    if health and any(h.index not in node.gpus for h in health):
        # Still proof of life: refusing it would let a GPU that fell off the bus
        # since registration turn the whole node unreachable. The agent's next
        # registration brings the inventory up to date.
        health = tuple(h for h in health if h.index in node.gpus)
    seen = state.seen.get(ev.node)
    if seen is None:
        state.seen[ev.node] = Seen(last_seen=float(at), seq=seq, health=health or None)
    else:
        seen.last_seen = float(at)
        seen.seq = seq
        if health:
            seen.health = health


def _can_enter(shard: ShardState, phase: str, what: str) -> None:
    if shard.phase in TERMINAL:
        raise _Reject(f"{what}: phase {phase} after {shard.phase} (a generation does not restart)")
    if _RANK[phase] < _RANK[shard.phase]:
        raise _Reject(f"{what}: phase {phase} after {shard.phase} is out of order")


def _shard_status(state: ClusterState, ev: events.ShardStatus, seq: int, at: float) -> None:
    node = state.nodes.get(ev.node)
    if node is None:
        raise _Reject(f"shard status from node {ev.node!r}, which never registered")
    what = f"shard {ev.shard} of replica {ev.replica_id!r} (generation {ev.generation})"
    replica = state.replicas.get(ev.replica_id)
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
                return
        if replica is None:
            raise _Reject(f"status for {what}, which was never placed")
    elif ev.generation < replica.generation:
        # An older generation of a live replica that its agent reported still running.
        found = _find_orphan(node, ev.replica_id, ev.generation, ev.shard)
        if found is not None:
            if ev.phase in TERMINAL:
                del node.orphans[found[0]]
            return
    if not 0 <= ev.shard < len(replica.shards):
        raise _Reject(f"status for {what}: replica {ev.replica_id!r} has no shard {ev.shard}")
    shard = replica.shards[ev.shard]
    if shard.node != ev.node:
        raise _Reject(f"node {ev.node!r} reports {what}, which is assigned to node {shard.node!r}")
    if ev.generation < replica.generation:
        raise _Reject(f"stale status for {what}: the replica is at generation {replica.generation}")
    if ev.generation > replica.generation:
        raise _Reject(f"status for {what}: generation {ev.generation} was never placed")
    if ev.phase == shard.phase:
        return  # redelivery
    _can_enter(shard, ev.phase, what)
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
    elif ev.error:
        shard.error = ev.error
    if ev.phase in TERMINAL:
        _shard_ended(state, replica, shard, float(ev.ts))


def _shard_ended(state: ClusterState, replica: ReplicaState, shard: ShardState, ts: float) -> None:
    """A shard stopped or failed: a retired replica's GPUs are free again."""
    if replica.retired:
        _release(state, replica, shard)


def _release(state: ClusterState, replica: ReplicaState, shard: ShardState) -> None:
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


# --- operator intents


def _model_declared(state: ClusterState, ev: events.ModelDeclared, seq: int, at: float) -> None:
    _set_model(state, ev.profile, float(ev.ts), declared=True)


def _model_changed(state: ClusterState, ev: events.ModelChanged, seq: int, at: float) -> None:
    _set_model(state, ev.profile, float(ev.ts), declared=False)


def _set_model(state: ClusterState, profile: ModelProfile, ts: float, *, declared: bool) -> None:
    current = state.models.get(profile.name)
    if current is None and not declared:
        raise _Reject(f"model {profile.name!r} was never declared: declare it first")
    others = (m.profile for name, m in state.models.items() if name != profile.name)
    found = catalog.problems(profile, others)
    if found:
        raise _Reject(f"model {profile.name!r} refused: " + "; ".join(found))
    if current is None:
        state.models[profile.name] = ModelState(profile=profile, revision=1, changed_ts=ts)
        return
    if current.profile == profile:
        return
    if catalog.launch_relevant(current.profile, profile):
        current.revision += 1
        current.changed_ts = ts
    current.profile = profile


def _model_removed(state: ClusterState, ev: events.ModelRemoved, seq: int, at: float) -> None:
    if ev.name not in state.models:
        raise _Reject(f"model {ev.name!r} is not declared")
    del state.models[ev.name]


def _cordoned(state: ClusterState, ev: events.NodeCordoned, seq: int, at: float) -> None:
    node = _node(state, ev.node)
    node.cordoned = True
    node.cordon_reason = ev.reason


def _uncordoned(state: ClusterState, ev: events.NodeUncordoned, seq: int, at: float) -> None:
    node = _node(state, ev.node)
    node.cordoned = False
    node.cordon_reason = ""
    node.draining = False


def _drain_requested(
    state: ClusterState, ev: events.NodeDrainRequested, seq: int, at: float
) -> None:
    node = _node(state, ev.node)
    if not ev.grace_s >= 0:
        raise _Reject(f"drain of {ev.node!r}: grace_s {ev.grace_s} must be 0 or more seconds")
    if node.draining:
        return
    node.draining = True
    node.drain_since = float(ev.ts)
    node.drain_grace_s = float(ev.grace_s)


# --- control decisions


def _check_epoch(state: ClusterState, ev: events.ControlEvent) -> None:
    if ev.epoch < state.epoch:
        raise _Reject(
            f"{events.tag_of(type(ev))} {ev.id!r} was decided in epoch {ev.epoch}, "
            f"but epoch {state.epoch} leads: a deposed leader's decision"
        )


def _replica_placed(state: ClusterState, ev: events.ReplicaPlaced, seq: int, at: float) -> None:
    _check_epoch(state, ev)
    current = state.replicas.get(ev.replica_id)
    if current is not None:
        _restarted(state, current, ev)
        return
    model = state.models.get(ev.model)
    if model is None:
        raise _Reject(
            f"replica {ev.replica_id!r} placed for model {ev.model!r}, which is not declared"
        )
    if not ev.shards:
        raise _Reject(f"replica {ev.replica_id!r} has no shards")
    if sorted(s.shard for s in ev.shards) != list(range(len(ev.shards))):
        raise _Reject(f"replica {ev.replica_id!r}: shards must be numbered 0..{len(ev.shards) - 1}")
    classes: set[str] = set()
    used: set[tuple[str, int]] = set()
    ports: set[tuple[str, int]] = set()
    for sa in sorted(ev.shards, key=lambda s: s.shard):
        node = state.nodes.get(sa.node)
        if node is None:
            raise _Reject(
                f"replica {ev.replica_id!r} placed on node {sa.node!r}, which never registered"
            )
        if not sa.gpus:
            raise _Reject(f"replica {ev.replica_id!r}: shard {sa.shard} has no GPUs")
        for g in sa.gpus:
            gpu = node.gpus.get(g)
            if gpu is None:
                raise _Reject(f"replica {ev.replica_id!r}: node {sa.node!r} has no GPU {g}")
            if (sa.node, g) in used:
                raise _Reject(f"replica {ev.replica_id!r} uses GPU {g} of {sa.node!r} twice")
            holder = node.holders.get(g)
            if holder is not None:
                raise _Reject(
                    f"replica {ev.replica_id!r} placed on GPU {g} of {sa.node!r}, which is held "
                    f"by replica {holder!r}"
                )
            for orphan in node.orphans:
                if g in orphan.gpus:
                    raise _Reject(
                        f"replica {ev.replica_id!r} placed on GPU {g} of {sa.node!r}, which an "
                        f"unknown process ({orphan.replica_id!r}) still uses"
                    )
            used.add((sa.node, g))
            classes.add(gpu.gpu_class)
        if sa.port >= MAX_PORT:
            raise _Reject(
                f"replica {ev.replica_id!r}: port {sa.port} of {sa.node!r} leaves no port "
                "after it (a shard uses two)"
            )
        for port in (sa.port, sa.port + 1):
            if sa.port and (port in node.ports or (sa.node, port) in ports):
                raise _Reject(
                    f"replica {ev.replica_id!r}: port {port} of {sa.node!r} is already in use"
                )
            ports.add((sa.node, port))
    if len(classes) > 1:
        raise _Reject(f"replica {ev.replica_id!r} mixes GPU classes {sorted(classes)}")
    nodes = {sa.node for sa in ev.shards}
    if len(nodes) > 1:
        for name in sorted(nodes):
            if not any(f.name == ev.fabric and f.hcas for f in state.nodes[name].fabrics):
                raise _Reject(
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


def _restarted(state: ClusterState, replica: ReplicaState, ev: events.ReplicaPlaced) -> None:
    """A new generation of an existing replica: the same placement, engines started afresh."""
    if ev.generation == replica.generation:
        return  # redelivery
    if ev.generation < replica.generation:
        raise _Reject(
            f"replica {replica.id!r}: generation {ev.generation} is older than {replica.generation}"
        )
    if replica.retired:
        raise _Reject(f"replica {replica.id!r} is retired and cannot restart")
    layout = sorted((s.shard, s.node, tuple(s.gpus), s.port) for s in ev.shards)
    if layout != [(s.shard, s.node, s.gpus, s.port) for s in replica.shards]:
        raise _Reject(
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


def _replica_retired(state: ClusterState, ev: events.ReplicaRetired, seq: int, at: float) -> None:
    _check_epoch(state, ev)
    replica = state.replicas.get(ev.replica_id)
    if replica is None:
        raise _Reject(f"retired replica {ev.replica_id!r}, which does not exist")
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
            _release(state, replica, shard)
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
    _check_epoch(state, ev)
    node = _node(state, ev.node)
    node.liveness = new
    node.liveness_seq = seq
    return node


def _unreachable(state: ClusterState, ev: events.NodeUnreachable, seq: int, at: float) -> None:
    node = _node(state, ev.node)
    if node.liveness != "ready":
        return
    _liveness(state, ev, "unreachable", seq).last_heartbeat = float(ev.last_heartbeat)


def _lost(state: ClusterState, ev: events.NodeLost, seq: int, at: float) -> None:
    node = _node(state, ev.node)
    if node.liveness == "lost":
        return
    _check_epoch(state, ev)
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
                _release(state, replica, shard)
                if rid not in state.replicas:
                    break


def _recovered(state: ClusterState, ev: events.NodeRecovered, seq: int, at: float) -> None:
    node = _node(state, ev.node)
    if node.liveness == "ready":
        return
    _liveness(state, ev, "ready", seq)


def _gpu_health(state: ClusterState, ev: events.GpuHealthChanged, seq: int, at: float) -> None:
    _check_epoch(state, ev)
    node = _node(state, ev.node)
    for h in ev.gpus:
        if h.index not in node.gpus:
            raise _Reject(f"node {ev.node!r} has no GPU {h.index}")
    for h in ev.gpus:
        node.gpus[h.index] = h.applied_to(node.gpus[h.index])


def _quarantined(state: ClusterState, ev: events.NodeQuarantined, seq: int, at: float) -> None:
    _check_epoch(state, ev)
    if ev.node in state.quarantined:
        return  # already: the first quarantine's sequence stands
    state.quarantined[ev.node] = Quarantine(
        node=ev.node, reason=ev.reason, seq=seq, ts=float(ev.ts)
    )


def _released(state: ClusterState, ev: events.NodeReleased, seq: int, at: float) -> None:
    _check_epoch(state, ev)
    if state.quarantined.pop(ev.node, None) is None:
        raise _Reject(f"node {ev.node!r} released, but it is not quarantined")


def _endpoint_up(state: ClusterState, ev: events.EndpointUp, seq: int, at: float) -> None:
    _check_epoch(state, ev)
    replica = state.replicas.get(ev.replica_id)
    if replica is None or replica.retired:
        raise _Reject(f"endpoint up for replica {ev.replica_id!r}, which is not active")
    state.endpoints[ev.replica_id] = Endpoint(
        replica_id=ev.replica_id, model=ev.model, url=ev.url, node=ev.node, api_key=ev.api_key
    )


def _endpoint_down(state: ClusterState, ev: events.EndpointDown, seq: int, at: float) -> None:
    _check_epoch(state, ev)
    state.endpoints.pop(ev.replica_id, None)


def _leader(state: ClusterState, ev: events.LeaderElected, seq: int, at: float) -> None:
    if ev.epoch <= state.epoch:
        raise _Reject(
            f"leader {ev.leader!r} claims epoch {ev.epoch}, not newer than the current "
            f"{state.epoch}"
        )
    state.epoch = ev.epoch
    state.leader = ev.leader


# --- commands (in the same log, so the fold knows what was already asked)


def _command_shard(state: ClusterState, ev: events.Command) -> tuple[ReplicaState, ShardState]:
    _check_epoch(state, ev)
    replica = state.replicas.get(ev.replica_id)
    what = f"{events.tag_of(type(ev))} for shard {ev.shard} of replica {ev.replica_id!r}"
    if replica is None:
        raise _Reject(f"{what}, which does not exist")
    if not 0 <= ev.shard < len(replica.shards) or replica.shards[ev.shard].node != ev.node:
        raise _Reject(f"{what} sent to node {ev.node!r}, which does not run it")
    if ev.generation != replica.generation:
        raise _Reject(f"{what}: generation {ev.generation}, the replica is at {replica.generation}")
    return replica, replica.shards[ev.shard]


def _start(state: ClusterState, ev: events.StartShard, seq: int, at: float) -> None:
    _replica, shard = _command_shard(state, ev)
    shard.started = True


def _drain(state: ClusterState, ev: events.DrainShard, seq: int, at: float) -> None:
    _replica, shard = _command_shard(state, ev)
    if shard.drain_sent_at is None:
        shard.drain_sent_at = float(ev.ts)


def _stop(state: ClusterState, ev: events.StopShard, seq: int, at: float) -> None:
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
        _check_epoch(state, ev)
        node = _node(state, ev.node)
        found = _find_orphan(node, ev.replica_id, ev.generation, ev.shard)
        if found is not None:
            orphan = found[1]
            orphan.stop_sent = True
            orphan.stop_sent_at = float(ev.ts)
            orphan.stops += 1
            return
        if replica is None:
            raise _Reject(
                f"stop for shard {ev.shard} of replica {ev.replica_id!r}, which does not exist"
            )
    replica, shard = _command_shard(state, ev)
    shard.stop_sent = True
    if replica.retired and shard.phase == "placed" and not shard.started:
        _release(state, replica, shard)


_HANDLERS: dict[type, Handler] = {
    events.NodeRegistered: _registered,
    events.Heartbeat: _heartbeat,
    events.ShardStatus: _shard_status,
    events.ModelDeclared: _model_declared,
    events.ModelChanged: _model_changed,
    events.ModelRemoved: _model_removed,
    events.NodeCordoned: _cordoned,
    events.NodeUncordoned: _uncordoned,
    events.NodeDrainRequested: _drain_requested,
    events.ReplicaPlaced: _replica_placed,
    events.ReplicaRetired: _replica_retired,
    events.NodeUnreachable: _unreachable,
    events.NodeLost: _lost,
    events.NodeRecovered: _recovered,
    events.GpuHealthChanged: _gpu_health,
    events.NodeQuarantined: _quarantined,
    events.NodeReleased: _released,
    events.EndpointUp: _endpoint_up,
    events.EndpointDown: _endpoint_down,
    events.LeaderElected: _leader,
    # What the leader verified: for readers to check signatures once, no state.
    events.LogAttested: lambda state, event, seq, at: None,
    events.StartShard: _start,
    events.StopShard: _stop,
    events.DrainShard: _drain,
}

"""Cluster state, and the fold that builds it from the log.

The package: `model` (the Structs), `fold` (`apply`, `fold_records`), the handlers of
`nodes` and `decisions` with the checks they share in `rules`, and `snapshot` (the
snapshot codec and the digest). Which handler folds which event is the core's vocabulary
(`llmgw.core.vocabulary`).

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

from llmgw.core.phases import RANK, RUNNING, TERMINAL, Phase
from llmgw.core.state.fold import QUARANTINABLE, apply, fold_records, ignored_by_quarantine
from llmgw.core.state.model import (
    ClusterState,
    Endpoint,
    KeyState,
    Liveness,
    ModelState,
    NodeState,
    OrphanShard,
    Quarantine,
    ReplicaState,
    Seen,
    ShardState,
)
from llmgw.core.state.rules import misplaced
from llmgw.core.state.snapshot import SNAPSHOT_FORMAT, decode_snapshot, digest, encode_snapshot

__all__ = [
    "QUARANTINABLE",
    "RANK",
    "RUNNING",
    "SNAPSHOT_FORMAT",
    "TERMINAL",
    "ClusterState",
    "Endpoint",
    "KeyState",
    "Liveness",
    "ModelState",
    "NodeState",
    "OrphanShard",
    "Phase",
    "Quarantine",
    "ReplicaState",
    "Seen",
    "ShardState",
    "apply",
    "decode_snapshot",
    "digest",
    "encode_snapshot",
    "fold_records",
    "ignored_by_quarantine",
    "misplaced",
]

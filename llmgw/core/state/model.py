"""The folded state's model: nodes, replicas and their shards, models, endpoints, leader.

What the fold (`llmgw.core.state.fold`) builds and the reconciler and placement read. The
Structs hold data only; every change to them is a handler of the fold.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from llmgw.core import events
from llmgw.core.inventory import Fabric, Gpu, Hca
from llmgw.core.phases import Phase
from llmgw.core.profile import ModelProfile
from llmgw.core.tenancy import KeySettings

Liveness = Literal["ready", "unreachable", "lost"]
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
    desired: int | None = None
    """An autoscaled model's count, as its last ScaleDecided set it (None: `replicas`)."""
    pinned: int | None = None
    """An operator's ScalePinned count, until ScaleReleased: the autoscaler waits."""
    pinned_by: str = ""
    scaled_ts: float = 0.0
    """When the autoscaler last moved it."""
    startup_s: float = 0.0
    """Its replicas' start-up time (placed to serving), a moving average over the log."""


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
    metrics: str = ""
    """`host:port` of the agent's /metrics, as its last registration said."""
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


class KeyState(msgspec.Struct, kw_only=True, gc=False):
    """A tenant's API key as the log holds it: settings and digests, never the secret."""

    settings: KeySettings
    sha256: str
    previous_sha256: str = ""
    """The secret before the last rotation, valid until `previous_until`."""
    previous_until: float = 0.0
    created_ts: float = 0.0
    created_by: str = ""
    changed_ts: float = 0.0
    changed_by: str = ""


class ClusterState(msgspec.Struct, kw_only=True, dict=True):
    """The fold's result. (`dict=True`: the fold keeps derived indexes beside the fields,
    outside snapshots, the digest and equality: llmgw.core.state.decisions.)"""

    nodes: dict[str, NodeState] = {}
    models: dict[str, ModelState] = {}
    replicas: dict[str, ReplicaState] = {}
    endpoints: dict[str, Endpoint] = {}
    epoch: int = 0
    leader: str = ""
    quarantined: dict[str, Quarantine] = {}
    """Node -> its quarantine; a node may be quarantined before it ever registered."""
    keys: dict[str, KeyState] = {}
    """Tenants' API keys by name (llmgw.core.tenancy): what every router admits by."""
    # Not part of the digest:
    last_seq: int = 0
    seen: dict[str, Seen] = {}

    def active_by_model(self) -> dict[str, list[ReplicaState]]:
        """Active replicas grouped by model, in one read of them: a view of every model
        that asked `active_replicas(model)` for each read them all once per model."""
        out: dict[str, list[ReplicaState]] = {}
        for r in self.replicas.values():
            if not r.retired:
                out.setdefault(r.model, []).append(r)
        return out

    def active_replicas(self, model: str | None = None) -> list[ReplicaState]:
        return [
            r
            for r in self.replicas.values()
            if not r.retired and (model is None or r.model == model)
        ]

"""The vocabulary of the llmgw log: every event and command, as one tagged union.

Each message in the stream `llmgw-events` is one of these Structs encoded as
JSON, so `nats stream view` shows it readably. The `type` tag selects the class,
`v` is its schema version, `id` is unique (sent as `Nats-Msg-Id` so JetStream
drops duplicates) and `ts` is the producer's clock in UNIX seconds, UTC.

Versioning: a class's current version is the default of its `v` field. When a
field changes incompatibly, bump the default, and register an upcaster in
`UPCASTERS` that rewrites the raw mapping of version N into version N+1.
`decode` applies the chain before validation, so a log written years ago still
folds with today's code; tests/fixtures/events holds stored old versions.

Pure: no I/O, no clock, no randomness. Producers pass `id` and `ts` in.

The Structs live here; `codec` (encode, decode, upcasters) and `owners` (each event's
subject, and whether a record is on it) are re-exported, so `events.decode` and
`events.subject_of` are what callers use.
"""

from __future__ import annotations

from typing import Annotated, TypeAlias

import msgspec

from llmgw.core.attestation import DIGEST_BYTES, MAX_PER_ATTESTATION
from llmgw.core.autoscale import MAX_REPLICAS, Observation
from llmgw.core.inventory import Fabric, Gpu, Hca
from llmgw.core.limits import (
    MAX_GPUS,
    MAX_LIST,
    MAX_SHARDS,
    Counter,
    EngineKey,
    GpuIndex,
    GpuIndices,
    LogTail,
    MemoryMib,
    Name,
    Pid,
    Port,
    Seconds,
    ShardIndex,
    Text,
    Time,
    Version,
)
from llmgw.core.phases import SHARD_PHASES as SHARD_PHASES
from llmgw.core.phases import ShardPhase as ShardPhase
from llmgw.core.profile import LaunchSpec, ModelProfile
from llmgw.core.tenancy import MAX_OVERLAP_S, Digest, KeySettings

# Base64 of MAX_PER_ATTESTATION digests of DIGEST_BYTES, with room for padding.
_MAX_DIGESTS_B64 = (MAX_PER_ATTESTATION * DIGEST_BYTES + 2) // 3 * 4 + 4


class Event(msgspec.Struct, tag_field="type", kw_only=True, frozen=True):
    """Fields every event carries."""

    id: Name
    ts: Time
    v: Version = 1


# --------------------------------------------------------------------------- nested data


class RunningShard(msgspec.Struct, frozen=True, kw_only=True):
    """A shard an agent already runs when it (re-)registers: what survives an agent restart."""

    replica_id: Name
    generation: Counter
    shard: ShardIndex
    gpus: GpuIndices
    phase: ShardPhase
    endpoint: Text = ""


class GpuHealth(msgspec.Struct, frozen=True, kw_only=True):
    """Health flags of one GPU, refreshed with every heartbeat (the same as `Gpu`'s)."""

    index: GpuIndex
    ecc_uncorrected: Counter = 0
    foreign_memory_mib: MemoryMib = 0
    remap_pending: bool = False
    remap_failed: bool = False

    @classmethod
    def of(cls, gpu: Gpu) -> GpuHealth:
        return cls(
            index=gpu.index,
            ecc_uncorrected=gpu.ecc_uncorrected,
            foreign_memory_mib=gpu.foreign_memory_mib,
            remap_pending=gpu.remap_pending,
            remap_failed=gpu.remap_failed,
        )

    def differs_from(self, gpu: Gpu) -> bool:
        """Whether any flag disagrees with `gpu`'s: one place, so no flag is compared in
        the fold and forgotten in the reconciler."""
        return self != GpuHealth.of(gpu)

    def applied_to(self, gpu: Gpu) -> Gpu:
        return msgspec.structs.replace(
            gpu,
            ecc_uncorrected=self.ecc_uncorrected,
            foreign_memory_mib=self.foreign_memory_mib,
            remap_pending=self.remap_pending,
            remap_failed=self.remap_failed,
        )


class ShardAssignment(msgspec.Struct, frozen=True, kw_only=True):
    """Where one shard of a replica runs: a node and GPU indices on it."""

    shard: ShardIndex
    node: Name
    gpus: GpuIndices
    port: Port = 0


# --------------------------------------------------------------------------- node events


class NodeEvent(Event, kw_only=True, frozen=True):
    node: Name


class NodeRegistered(NodeEvent, tag="node.registered", kw_only=True, frozen=True):
    """An agent (re)connected: its whole inventory and the shards it already runs."""

    address: Name
    """Host name or IP at which this node's engines are reachable."""
    gpus: Annotated[tuple[Gpu, ...], msgspec.Meta(max_length=MAX_GPUS)] = ()
    fabrics: Annotated[tuple[Fabric, ...], msgspec.Meta(max_length=MAX_LIST)] = ()
    hcas: Annotated[tuple[Hca, ...], msgspec.Meta(max_length=MAX_LIST)] = ()
    shards: Annotated[tuple[RunningShard, ...], msgspec.Meta(max_length=MAX_SHARDS)] = ()
    agent_version: Name = ""
    metrics: Name = ""
    """`host:port` of the agent's own /metrics (its admin listener), for the control
    plane's Prometheus service discovery; empty when the agent serves none."""


class Heartbeat(NodeEvent, tag="node.heartbeat", kw_only=True, frozen=True):
    """The node is alive. Published with a per-message TTL so the log does not grow with them."""

    seq: Counter = 0
    """Counts up from 1 per agent run, so a gap says heartbeats were lost."""
    gpus: Annotated[tuple[GpuHealth, ...], msgspec.Meta(max_length=MAX_GPUS)] = ()


class ShardStatus(NodeEvent, tag="node.shard", kw_only=True, frozen=True):
    """A shard changed phase on this node (v2: `log_tail` replaced v1's single `log` string)."""

    v: Version = 2
    replica_id: Name
    generation: Counter
    shard: ShardIndex = 0
    phase: ShardPhase
    endpoint: Text = ""
    """`http://host:port` once the engine answers; empty before."""
    error: Text = ""
    log_tail: LogTail = ()
    """The engine's last output lines, shipped with `failed`: the only diagnosis of a bad load."""
    pid: Pid | None = None
    api_key: EngineKey = ""
    """The key the engine of shard 0 requires (`Authorization: Bearer`), reported with
    serving: routers present it; NATS lets no other node read this subject."""


# --------------------------------------------------------------------------- operator intents


class OperatorEvent(Event, kw_only=True, frozen=True):
    operator: Name
    """The identity (certificate CN) of the operator who asked for it."""


class ModelDeclared(OperatorEvent, tag="operator.model_declared", kw_only=True, frozen=True):
    profile: ModelProfile


class ModelChanged(OperatorEvent, tag="operator.model_changed", kw_only=True, frozen=True):
    profile: ModelProfile


class ModelRemoved(OperatorEvent, tag="operator.model_removed", kw_only=True, frozen=True):
    name: Name


class NodeCordoned(OperatorEvent, tag="operator.node_cordoned", kw_only=True, frozen=True):
    node: Name
    reason: Text = ""


class NodeUncordoned(OperatorEvent, tag="operator.node_uncordoned", kw_only=True, frozen=True):
    node: Name


class NodeDrainRequested(
    OperatorEvent, tag="operator.node_drain_requested", kw_only=True, frozen=True
):
    node: Name
    grace_s: Seconds = 600.0
    """After this, the node's replicas stop even when no replacement serves yet."""
    reason: Text = ""


class ScalePinned(OperatorEvent, tag="operator.scale_pinned", kw_only=True, frozen=True):
    """Hold an autoscaled model at `replicas` until a ScaleReleased (the autoscaler waits)."""

    model: Name
    replicas: Annotated[int, msgspec.Meta(ge=0, le=MAX_REPLICAS)]
    reason: Text = ""


class ScaleReleased(OperatorEvent, tag="operator.scale_released", kw_only=True, frozen=True):
    """Give a pinned model back to its autoscaler."""

    model: Name


class KeyCreated(OperatorEvent, tag="operator.key_created", kw_only=True, frozen=True):
    """A tenant's API key: its settings and the SHA-256 of its secret (never the secret)."""

    key: KeySettings
    sha256: Digest


class KeyChanged(OperatorEvent, tag="operator.key_changed", kw_only=True, frozen=True):
    """A key's new settings (the whole of them); its secret stays."""

    key: KeySettings


class KeyRotated(OperatorEvent, tag="operator.key_rotated", kw_only=True, frozen=True):
    """A key's new secret; the old one stays valid `overlap_s` after `ts`, then not."""

    name: Name
    sha256: Digest
    overlap_s: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_OVERLAP_S)] = 0.0


class KeyRevoked(OperatorEvent, tag="operator.key_revoked", kw_only=True, frozen=True):
    """The key is refused from now on, on every router."""

    name: Name
    reason: Text = ""


# --------------------------------------------------------------------------- control decisions


class ControlEvent(Event, kw_only=True, frozen=True):
    epoch: Counter = 0
    """Leader epoch that decided it: a deposed leader's decisions carry an older one."""
    basis_seq: Counter = 0
    """The last stream sequence folded into the state this decision was computed from."""


class ReplicaPlaced(ControlEvent, tag="control.replica_placed", kw_only=True, frozen=True):
    replica_id: Name
    model: Name
    generation: Counter = 1
    shards: Annotated[tuple[ShardAssignment, ...], msgspec.Meta(max_length=MAX_SHARDS)]
    replaces: Name = ""
    """Replica id this one replaces (drain or lost node); empty for a new replica."""
    reason: Text = ""
    fabric: Name = ""
    """Multi-node: the RDMA fabric its nodes share (NCCL_IB_HCA lists its HCAs); else empty."""


class ReplicaRetired(ControlEvent, tag="control.replica_retired", kw_only=True, frozen=True):
    replica_id: Name
    reason: Text = ""


class NodeUnreachable(ControlEvent, tag="control.node_unreachable", kw_only=True, frozen=True):
    node: Name
    last_heartbeat: Time


class NodeLost(ControlEvent, tag="control.node_lost", kw_only=True, frozen=True):
    node: Name
    last_heartbeat: Time


class NodeRecovered(ControlEvent, tag="control.node_recovered", kw_only=True, frozen=True):
    node: Name


class GpuHealthChanged(ControlEvent, tag="control.gpu_health_changed", kw_only=True, frozen=True):
    """The leader saw a node's GPU health change in its heartbeats, and records it.

    Heartbeats expire from the log, so placement must not depend on them directly:
    this recorded observation is what the fold (and a replay) takes GPU health from.
    """

    node: Name
    gpus: Annotated[tuple[GpuHealth, ...], msgspec.Meta(max_length=MAX_GPUS)]
    """The new health of each GPU that changed; GPUs not listed keep theirs."""


class NodeQuarantined(ControlEvent, tag="control.node_quarantined", kw_only=True, frozen=True):
    """The leader measured more log traffic from a node than its budget allows.

    From this event on, until a NodeReleased, every fold ignores the node's
    `registered` and `shard` events (refused with a reason, like any refused event),
    keeps its heartbeats for liveness, and places nothing on it; the leader deletes
    the ignored messages from the stream. The counts say what was measured.
    """

    node: Name
    reason: Text = ""
    since_seq: Counter = 0
    """The first sequence of the node's messages in the window that exceeded the budget."""
    messages: Counter = 0
    bytes: Counter = 0
    window_s: Seconds = 0.0


class NodeReleased(ControlEvent, tag="control.node_released", kw_only=True, frozen=True):
    """The node's traffic stayed under its budget for a window: its events fold again."""

    node: Name
    reason: Text = ""


class ScaleDecided(ControlEvent, tag="control.scale_decided", kw_only=True, frozen=True):
    """The autoscaler moved a model's replica count, on what it observed (recorded here, so a
    replay decides the same: llmgw.core.autoscale.verify_decision)."""

    model: Name
    from_replicas: Annotated[int, msgspec.Meta(ge=0, le=MAX_REPLICAS)]
    to_replicas: Annotated[int, msgspec.Meta(ge=0, le=MAX_REPLICAS)]
    reason: Text = ""
    observation: Observation


class EndpointUp(ControlEvent, tag="control.endpoint_up", kw_only=True, frozen=True):
    replica_id: Name
    model: Name
    url: Text
    node: Name = ""
    api_key: EngineKey = ""
    """What routers send the engine as `Authorization: Bearer`; empty for an engine
    started without one."""


class EndpointDown(ControlEvent, tag="control.endpoint_down", kw_only=True, frozen=True):
    replica_id: Name
    model: Name
    url: Text
    reason: Text = ""


class LeaderElected(ControlEvent, tag="control.leader_elected", kw_only=True, frozen=True):
    leader: Name
    """Instance name of the control plane that now decides."""
    reconcile: Annotated[dict[Name, Seconds], msgspec.Meta(max_length=MAX_LIST)] = {}
    """The reconcile timings this leader decides with (its config's `reconcile` section,
    every setting): they change decisions, so re-running the reconciler over the log
    (`llmgw ctl replay --verify`) takes them from here. Empty in logs from before it was
    recorded."""


class LogAttested(ControlEvent, tag="control.log_attested", kw_only=True, frozen=True):
    """What the leader checked of the log, so that readers verify each event once
    (llmgw.core.attestation): of the sequences first_seq..last_seq, those in `accepted`
    (inclusive runs) passed its signature check, with these digests (base64, 16 bytes each,
    in sequence order), and those in `refused` did not; the others (heartbeats) it does not
    vouch for. Changes no state."""

    first_seq: Counter
    last_seq: Counter
    accepted: Annotated[
        tuple[tuple[Counter, Counter], ...], msgspec.Meta(max_length=MAX_PER_ATTESTATION)
    ] = ()
    digests: Annotated[str, msgspec.Meta(max_length=_MAX_DIGESTS_B64)] = ""
    refused: Annotated[
        tuple[tuple[Counter, Counter], ...], msgspec.Meta(max_length=MAX_PER_ATTESTATION)
    ] = ()
    """Inclusive runs of the sequences it refused (readers refuse them too)."""
    payload_accepted: Annotated[
        tuple[tuple[Counter, Counter], ...], msgspec.Meta(max_length=MAX_PER_ATTESTATION)
    ] = ()
    payload_digests: Annotated[str, msgspec.Meta(max_length=_MAX_DIGESTS_B64)] = ""
    """What leaders write now in place of `accepted` and `digests`: the same, each digest
    of the subject and payload alone (llmgw.core.attestation, scheme 2). `accepted` and
    `digests` (scheme 1, which digested the id and signature too) are in attestations
    written before; in their own fields, so a reader from before confirms nothing by the
    new ones and checks signatures, where it would have refused every message."""


# --------------------------------------------------------------------------- commands


class Command(ControlEvent, kw_only=True, frozen=True):
    """Sent by the leader on `llmgw.cmd.<node>`; agents apply it idempotently by generation."""

    node: Name
    replica_id: Name
    generation: Counter
    shard: ShardIndex = 0


class StartShard(Command, tag="cmd.start_shard", kw_only=True, frozen=True):
    launch: LaunchSpec


class StopShard(Command, tag="cmd.stop_shard", kw_only=True, frozen=True):
    grace_s: Seconds = 30.0
    reason: Text = ""


class DrainShard(Command, tag="cmd.drain_shard", kw_only=True, frozen=True):
    """Stop taking new requests, finish those in flight; a StopShard follows."""

    grace_s: Seconds = 600.0


AnyEvent: TypeAlias = (
    NodeRegistered
    | Heartbeat
    | ShardStatus
    | ModelDeclared
    | ModelChanged
    | ModelRemoved
    | NodeCordoned
    | NodeUncordoned
    | NodeDrainRequested
    | ScalePinned
    | ScaleReleased
    | KeyCreated
    | KeyChanged
    | KeyRotated
    | KeyRevoked
    | ReplicaPlaced
    | ReplicaRetired
    | NodeUnreachable
    | NodeLost
    | NodeRecovered
    | GpuHealthChanged
    | NodeQuarantined
    | NodeReleased
    | ScaleDecided
    | EndpointUp
    | EndpointDown
    | LeaderElected
    | LogAttested
    | StartShard
    | StopShard
    | DrainShard
)

EVENT_TYPES: tuple[type[Event], ...] = AnyEvent.__args__


def tag_of(cls: type[Event]) -> str:
    tag = cls.__struct_config__.tag
    assert isinstance(tag, str)
    return tag


BY_TAG: dict[str, type[Event]] = {tag_of(cls): cls for cls in EVENT_TYPES}


def current_version(cls: type[Event]) -> int:
    """The version a class writes today: the default of its `v` field."""
    (field,) = (f for f in msgspec.structs.fields(cls) if f.name == "v")
    assert isinstance(field.default, int)
    return field.default


# Where events go and how they are encoded read the Structs above, so those modules are
# imported after them (importing either first still runs this module to here first).
from llmgw.core.events.codec import UPCASTERS as UPCASTERS  # noqa: E402
from llmgw.core.events.codec import DecodeError as DecodeError  # noqa: E402
from llmgw.core.events.codec import Upcaster as Upcaster  # noqa: E402
from llmgw.core.events.codec import decode as decode  # noqa: E402
from llmgw.core.events.codec import encode as encode  # noqa: E402
from llmgw.core.events.codec import upcaster as upcaster  # noqa: E402
from llmgw.core.events.owners import CONTROL_OPERATOR_KINDS as CONTROL_OPERATOR_KINDS  # noqa: E402
from llmgw.core.events.owners import published_where_owned as published_where_owned  # noqa: E402
from llmgw.core.events.owners import subject_of as subject_of  # noqa: E402

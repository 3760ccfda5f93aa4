"""The core's vocabulary: every event type of the log, registered once.

Each entry names an event type, the fold handler that applies it to a `ClusterState`, its
category (who writes it and why) and whether routers follow it. Everything else that
lists event types derives from `VOCABULARY`: the fold's handler table, the reconciler's
decisions and observations, the router feed's relevant types. `AnyEvent`
(llmgw.core.events) stays a static union, since msgspec decodes it and mypy checks it;
tests/unit/test_vocabulary.py checks that it and every derived list agree with this one.

Adding an event type: its Struct and its place in `AnyEvent`, its handler in
llmgw.core.state, and one entry here (docs/design.md, "The core's vocabulary").
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmgw.core import events
from llmgw.core.state import decisions, keys, nodes, scaling
from llmgw.core.state.model import ClusterState

Handler = Callable[[ClusterState, Any, int, float], None]
"""(state, event, seq, at): fold one event; raises `Reject` before mutating to refuse it."""


class Category(enum.Enum):
    REPORT = "report"
    """What an agent reports about its node (NodeEvent)."""
    OPERATOR = "operator"
    """What an operator asks for (OperatorEvent)."""
    OBSERVATION = "observation"
    """What the leader records having seen: liveness, GPU health, log traffic, signatures."""
    DECISION = "decision"
    """What the leader's planner decides, commands to agents included."""
    LEADERSHIP = "leadership"
    """Who leads, in which epoch."""


@dataclass(frozen=True, slots=True)
class Entry:
    type: type[events.Event]
    handler: Handler
    category: Category
    routed: bool = False
    """Routers re-derive their catalog and endpoint table after one of these."""
    reconciled: bool = False
    """`reconcile` returns it. Every decision is; an observation is when the reconciler
    makes it from heartbeats (a node's liveness and GPU health), not when another part
    of the leader does (quarantine, attestation)."""


def _no_state(state: ClusterState, event: Any, seq: int, at: float) -> None:
    """What the leader verified: for readers to check signatures once, no state."""


# Short names for the categories, so that each entry below reads as one line.
R, OP, OBS, D, L = (
    Category.REPORT,
    Category.OPERATOR,
    Category.OBSERVATION,
    Category.DECISION,
    Category.LEADERSHIP,
)

VOCABULARY: tuple[Entry, ...] = (
    Entry(events.NodeRegistered, nodes.on_registered, R),
    Entry(events.Heartbeat, nodes.on_heartbeat, R),
    Entry(events.ShardStatus, nodes.on_shard_status, R, routed=True),
    Entry(events.ModelDeclared, decisions.on_model_declared, OP, routed=True),
    Entry(events.ModelChanged, decisions.on_model_changed, OP, routed=True),
    Entry(events.ModelRemoved, decisions.on_model_removed, OP, routed=True),
    Entry(events.NodeCordoned, decisions.on_cordoned, OP),
    Entry(events.NodeUncordoned, decisions.on_uncordoned, OP, routed=True),
    Entry(events.NodeDrainRequested, decisions.on_drain_requested, OP, routed=True),
    Entry(events.ScalePinned, scaling.on_scale_pinned, OP),
    Entry(events.ScaleReleased, scaling.on_scale_released, OP),
    # Tenants' keys (llmgw.core.tenancy): routers admit by them.
    Entry(events.KeyCreated, keys.on_key_created, OP, routed=True),
    Entry(events.KeyChanged, keys.on_key_changed, OP, routed=True),
    Entry(events.KeyRotated, keys.on_key_rotated, OP, routed=True),
    Entry(events.KeyRevoked, keys.on_key_revoked, OP, routed=True),
    Entry(events.ReplicaPlaced, decisions.on_replica_placed, D, reconciled=True),
    Entry(events.ReplicaRetired, decisions.on_replica_retired, D, routed=True, reconciled=True),
    Entry(events.NodeUnreachable, decisions.on_unreachable, OBS, reconciled=True),
    Entry(events.NodeLost, decisions.on_lost, OBS, routed=True, reconciled=True),
    Entry(events.NodeRecovered, decisions.on_recovered, OBS, reconciled=True),
    Entry(events.GpuHealthChanged, decisions.on_gpu_health, OBS, reconciled=True),
    # The leader's measurements of log traffic (llmgw.control.quota), not planning:
    Entry(events.NodeQuarantined, decisions.on_quarantined, OBS),
    Entry(events.NodeReleased, decisions.on_released, OBS),
    # The autoscaler's, with the observation it decided on (llmgw.core.autoscale): a
    # replay recomputes it from that observation, not from the state alone.
    Entry(events.ScaleDecided, scaling.on_scale_decided, OBS),
    Entry(events.EndpointUp, decisions.on_endpoint_up, D, routed=True, reconciled=True),
    Entry(events.EndpointDown, decisions.on_endpoint_down, D, routed=True, reconciled=True),
    Entry(events.LeaderElected, decisions.on_leader, L),
    # What the leader's reader checked (llmgw.core.attestation), not planning:
    Entry(events.LogAttested, _no_state, OBS),
    Entry(events.StartShard, decisions.on_start, D, reconciled=True),
    Entry(events.StopShard, decisions.on_stop, D, routed=True, reconciled=True),
    Entry(events.DrainShard, decisions.on_drain, D, routed=True, reconciled=True),
)

BY_TYPE: dict[type[events.Event], Entry] = {e.type: e for e in VOCABULARY}
HANDLERS: dict[type, Handler] = {e.type: e.handler for e in VOCABULARY}
"""The fold's dispatch table."""
DECISIONS: tuple[type[events.ControlEvent], ...] = tuple(
    e.type for e in VOCABULARY if e.reconciled and issubclass(e.type, events.ControlEvent)
)
"""What `reconcile` returns (`llmgw.core.reconcile.Decision` is their union)."""
OBSERVATIONS: tuple[type[events.ControlEvent], ...] = tuple(
    e.type
    for e in VOCABULARY
    if e.category is Category.OBSERVATION and issubclass(e.type, events.ControlEvent)
)
"""Control events that record what the leader saw rather than what it planned."""
ROUTED: tuple[type[events.Event], ...] = tuple(e.type for e in VOCABULARY if e.routed)
"""Events after which a router's catalog or endpoint table may need to change; the rest
(heartbeats above all) it folds without looking at its tables."""


def of_category(category: Category) -> tuple[type[events.Event], ...]:
    return tuple(e.type for e in VOCABULARY if e.category is category)

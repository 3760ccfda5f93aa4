"""The reconciler: from folded state and the time, the decisions that move the fleet.

The package: `observation` (what heartbeats show), `planner` (what to do about the
durable state), `launch` (what a node needs to start a shard), `verification` (replaying
a log's decisions) and `batch` (a pass's configuration and decisions).

`reconcile(state, now, epoch=..., basis_seq=...)` returns control events and
commands (llmgw/core/events/) for the control service's leader to publish;
the leader then folds them back from the log like everyone else (docs/design.md,
invariant 1) and reconciles again only once it has. It:

- observes liveness and GPU health from heartbeats (the volatile part of the
  state) and records what changed: NodeUnreachable, NodeLost, NodeRecovered,
  GpuHealthChanged. A pass that observes something returns only those; the
  next pass plans on the state they produced;
- otherwise plans, from the durable state alone: places missing replicas and
  retires surplus ones, replaces the replicas of lost nodes, restarts failed
  replicas with exponential backoff, drains as a rolling move (replacement
  placed and serving before the original is drained, then stopped; the drain
  grace bounds it), stops what nobody should run, and publishes endpoint up /
  down as replicas start or stop serving.

Because planning reads only the durable state (what the log holds forever)
and `now`, and every replica id is derived from (epoch, basis_seq, index),
re-running `plan` on the state folded up to a recorded batch's basis_seq, at
its `ts`, reproduces that batch exactly, up to the events' own ids. `verify`
does that over a whole log: it is `llmgw ctl replay --verify`'s engine.
Heartbeat-driven observations cannot be recomputed once heartbeats expire;
they are recorded facts.

Event ids. Each decision's base id is `{epoch}-{basis_seq}-{index}`; the
caller's `ids` function turns it into the id written (the control service
appends 128 random bits). JetStream drops any message whose Nats-Msg-Id it
has seen inside the duplicate window, from whichever writer: with predictable
ids, another identity could publish them first and have the leader's decisions
dropped as duplicates. `verify` therefore compares decisions without their ids.

Purely computational: no I/O, no clock, no randomness.
"""

from __future__ import annotations

from llmgw.core.reconcile.batch import (
    OBSERVATIONS,
    Decision,
    IdFactory,
    Outcome,
    ReconcileConfig,
)
from llmgw.core.reconcile.launch import launch_spec
from llmgw.core.reconcile.observation import observe
from llmgw.core.reconcile.planner import backoff, orphan_backoff, plan
from llmgw.core.reconcile.verification import VerifyReport, verify
from llmgw.core.state import ClusterState

__all__ = [
    "OBSERVATIONS",
    "Decision",
    "IdFactory",
    "Outcome",
    "ReconcileConfig",
    "VerifyReport",
    "backoff",
    "launch_spec",
    "observe",
    "orphan_backoff",
    "plan",
    "reconcile",
    "reconcile_detail",
    "verify",
]


def reconcile(
    state: ClusterState,
    now: float,
    *,
    epoch: int = 0,
    basis_seq: int | None = None,
    config: ReconcileConfig | None = None,
    observing_since: float = 0.0,
    ids: IdFactory | None = None,
) -> list[Decision]:
    """The decisions to publish now; empty when the fleet is as it should be. Pure.

    `basis_seq` defaults to `state.last_seq`. `observing_since` is when this
    process began seeing heartbeats: a leader that just started from a replay
    (heartbeats expired from the log) gives nodes that long before calling
    them unreachable. `ids` maps each decision's base id to the id it is written
    with (see the module docstring); by default the base id itself.
    """
    return reconcile_detail(
        state,
        now,
        epoch=epoch,
        basis_seq=basis_seq,
        config=config,
        observing_since=observing_since,
        ids=ids,
    ).decisions


def reconcile_detail(
    state: ClusterState,
    now: float,
    *,
    epoch: int = 0,
    basis_seq: int | None = None,
    config: ReconcileConfig | None = None,
    observing_since: float = 0.0,
    ids: IdFactory | None = None,
) -> Outcome:
    """`reconcile`, plus why missing replicas could not be placed (for metrics and logs)."""
    cfg = config or ReconcileConfig()
    basis = state.last_seq if basis_seq is None else basis_seq
    seen = observe(
        state,
        now,
        epoch=epoch,
        basis_seq=basis,
        config=cfg,
        observing_since=observing_since,
        ids=ids,
    )
    if seen:
        return Outcome(decisions=seen)
    return plan(state, now, epoch=epoch, basis_seq=basis, config=cfg, ids=ids)

"""What the console's page shows, as JSON-ready data. Purely computational.

The fleet at a point of the log is the same rows `llmgw ctl nodes / models / replicas`
print (llmgw.core.views), so the page and the terminal never disagree; an event is a
row naming what it touched, so the page can filter the list by node, model, replica
and type and link each event to them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from llmgw import bus
from llmgw.core import events, state, views
from llmgw.ctl import eventlines, history, operations
from llmgw.ctl.changes import Change


def fleet(
    st: state.ClusterState, now: float, *, at: float | None, live: bool, why: dict[str, str] | None
) -> dict[str, Any]:
    """The fleet as folded in `st`: nodes with their GPUs, models, replicas."""
    return {
        "seq": st.last_seq,
        "time": at,
        "live": live,
        "epoch": st.epoch,
        "leader": st.leader,
        "nodes": views.node_rows(st, now),
        "models": views.model_rows(st, now, why=why),
        "replicas": views.replica_rows(st),
    }


def bounds(b: history.Bounds) -> dict[str, Any]:
    return msgspec.to_builtins(b)  # type: ignore[no-any-return]


_PHASES: dict[type[events.Event], str] = {
    events.NodeRegistered: "registered",
    events.NodeUnreachable: "unreachable",
    events.NodeLost: "lost",
    events.NodeCordoned: "cordoned",
    events.NodeUncordoned: "uncordoned",
    events.NodeDrainRequested: "draining",
    events.ReplicaPlaced: "placed",
    events.ReplicaRetired: "retired",
    events.EndpointUp: "up",
    events.EndpointDown: "down",
}
"""The phase a timeline strip shows for an event that changes a node or replica."""


def phase_of(ev: events.Event) -> str:
    """A shard's phase, a node's or replica's lifecycle step, or "" for other events."""
    if isinstance(ev, events.ShardStatus):
        return ev.phase
    return _PHASES.get(type(ev), "")


def event_row(rec: bus.Record) -> dict[str, Any]:
    """One record of the log as the event list shows it."""
    ev = rec.event
    return {
        "phase": phase_of(ev),
        "seq": rec.seq,
        "time": rec.time,
        "type": events.tag_of(type(ev)),
        "family": eventlines.family(ev),
        "summary": eventlines.summary(ev),
        "nodes": sorted(eventlines.nodes_of(ev, rec.subject)),
        "replicas": sorted(eventlines.replicas_of(ev)),
        "model": eventlines.model_of(ev),
    }


def matching(
    rows: Iterable[dict[str, Any]],
    *,
    node: str = "",
    model: str = "",
    replica: str = "",
    type_filter: str = "",
) -> list[dict[str, Any]]:
    """The rows that touch `node`, `model` and `replica` and are of `type_filter` (each
    filter empty: any)."""
    return [
        r
        for r in rows
        if (not node or node in r["nodes"])
        and (not model or r["model"] == model)
        and (not replica or replica in r["replicas"])
        and (not type_filter or eventlines.matches_tag(r["type"], type_filter))
    ]


def diff(a: history.Rebuilt, b: history.Rebuilt, found: list[Change]) -> dict[str, Any]:
    """What changed between two points, as `llmgw ctl replay --diff` says it."""
    return {
        "from": {"seq": a.target_seq, "time": a.at},
        "to": {"seq": b.target_seq, "time": b.at},
        "changes": [{**msgspec.to_builtins(c), "text": c.render()} for c in found],
    }


def drain_moves(st: state.ClusterState, node: str, now: float) -> list[dict[str, Any]]:
    """What a drain of `node` (a registered node) would move where (`drain --dry-run`)."""
    return [
        {**msgspec.to_builtins(m), "text": m.render()} for m in operations.drain_plan(st, node, now)
    ]

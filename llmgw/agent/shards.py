"""A shard as the agent reports it: the view the supervisor keeps of each engine, and
the events that carry it (ShardStatus on every transition, RunningShard in
NodeRegistered). Purely computational, no side effects.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec

from llmgw.core import events, limits, phases
from llmgw.core.phases import ShardPhase

LIVE = phases.RUNNING
"""Phases in which the shard's process exists (or is being started)."""


class ShardView(msgspec.Struct, frozen=True, kw_only=True):
    """One shard as the agent reports it: the data of a ShardStatus."""

    replica_id: str
    generation: int
    shard: int
    phase: ShardPhase
    endpoint: str = ""
    error: str = ""
    log_tail: tuple[str, ...] = ()
    pid: int | None = None
    gpus: tuple[int, ...] = ()
    adopted: bool = False
    api_key: str = ""
    """The engine's API key, reported only with its endpoint (serving, draining)."""
    model: str = ""
    """The model name the engine serves."""
    kv_events: str = ""
    """Where the engine publishes its KV events (node-local ZMQ), and its replay socket;
    empty for an engine that publishes none. Not part of any event."""
    kv_replay: str = ""


OnChange = Callable[[ShardView], Awaitable[None]]


def status_event(view: ShardView, *, node: str, event_id: str, ts: float) -> events.ShardStatus:
    """The ShardStatus event of a view. Purely computational, no side effects."""
    return events.ShardStatus(
        id=event_id,
        ts=ts,
        node=node,
        replica_id=view.replica_id,
        generation=view.generation,
        shard=view.shard,
        phase=view.phase,
        endpoint=view.endpoint,
        # Readers refuse an event beyond the log's bounds: a failure is reported cut, never
        # lost to an over-long message.
        error=view.error if len(view.error) <= limits.MAX_TEXT else view.error[: limits.MAX_TEXT],
        log_tail=view.log_tail,
        pid=view.pid,
        api_key=view.api_key,
    )


def running_shard(view: ShardView) -> events.RunningShard:
    """What NodeRegistered says about a shard this agent already runs."""
    return events.RunningShard(
        replica_id=view.replica_id,
        generation=view.generation,
        shard=view.shard,
        gpus=view.gpus,
        phase=view.phase,
        endpoint=view.endpoint,
    )

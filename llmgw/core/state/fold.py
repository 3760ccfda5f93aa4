"""The fold: `apply` one event of the log to a state; `fold_records` a run of them.

Which handler folds which event type is the core's vocabulary (`llmgw.core.vocabulary`),
read at call time: the vocabulary imports the handlers, so this module cannot import it
by name at load time.
"""

from __future__ import annotations

from collections.abc import Iterable

from llmgw.core import events, vocabulary
from llmgw.core.state.model import ClusterState
from llmgw.core.state.rules import Reject


def fold_records(
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
    handler = vocabulary.HANDLERS.get(type(event))
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
        except Reject as exc:
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

"""Where each event is published, and whether a record is on the subject its writer owns.

Readers refuse an event found on any subject but its own, so the server's per-identity
write permissions decide who can write each kind of event (docs/security.md).
"""

from __future__ import annotations

from llmgw.core import subjects
from llmgw.core.events import Command, ControlEvent, Event, NodeEvent, OperatorEvent, tag_of


def subject_of(event: Event) -> str:
    """The subject an event is published on; raises SubjectTokenError for unsafe ids."""
    tag = tag_of(type(event))
    family, _, kind = tag.partition(".")
    match event:
        case Command():
            return subjects.command(event.node)
        case NodeEvent():
            return subjects.node_event(event.node, kind.removeprefix("node_"))
        case OperatorEvent():
            return subjects.operator_event(event.operator, kind)
        case ControlEvent():
            return subjects.control_event(kind)
    raise TypeError(f"{type(event).__name__} ({family}) has no subject")


# Expected subject by (event class, node token): replays check every record, and the
# number of distinct keys is bounded by nodes x event types.
_SUBJECT_CACHE: dict[tuple[type[Event], str], str] = {}


_BY_OPERATOR, _BY_NODE, _BY_CONTROL = 0, 1, 2
# Which of those writes each event class: asked of every record of a replay, where
# isinstance against unions costs more than a dictionary lookup.
_OWNER_KINDS: dict[type[Event], int] = {}


def _owner_kind(cls: type[Event]) -> int:
    if issubclass(cls, OperatorEvent):
        return _BY_OPERATOR
    if issubclass(cls, NodeEvent | Command):
        return _BY_NODE
    return _BY_CONTROL


def published_where_owned(event: Event, subject: str) -> bool:
    """True when `event` is on the subject its writer owns (what `subject_of` gives).

    NATS checks which subjects an identity may write, not what a message says: a node
    could put a control decision, or another node's heartbeat, on its own subject.
    Readers refuse any event found on a subject other than its own, so the server's
    per-identity permissions decide who can write each kind of event.
    """
    cls = type(event)
    kind = _OWNER_KINDS.get(cls)
    if kind is None:
        kind = _OWNER_KINDS[cls] = _owner_kind(cls)
    if kind == _BY_OPERATOR:
        return _operator_event_owned(event, subject)  # type: ignore[arg-type]
    key = (cls, event.node if kind == _BY_NODE else "")  # type: ignore[attr-defined]
    expected = _SUBJECT_CACHE.get(key)
    if expected is None:
        try:
            expected = subject_of(event)
        except subjects.SubjectTokenError:
            return False
        if len(_SUBJECT_CACHE) < 200_000:
            _SUBJECT_CACHE[key] = expected
    return expected == subject


# Operator events a control plane writes itself: the models of its config file.
CONTROL_OPERATOR_KINDS = frozenset({"model_declared", "model_changed", "model_removed"})


def _operator_event_owned(event: OperatorEvent, subject: str) -> bool:
    """An operator event names its author in its subject (`llmgw.events.operator.<operator>.
    <kind>`, or `...operator.control.<instance>.<kind>` for a control plane's models), and the
    server lets each identity write only under its own name: the event's `operator` must be
    that name. The form without an author (`llmgw.events.operator.<kind>`) is what logs held
    before; no identity may write it any more, so it can only come from such a log."""
    author = subjects.operator_author(subject)
    if author is None:
        return False
    writer, name, kind = author
    if kind != tag_of(type(event)).partition(".")[2]:
        return False
    if writer == "control":
        return name == event.operator and kind in CONTROL_OPERATOR_KINDS
    return writer == "" or name == event.operator

"""The core's vocabulary agrees with itself: every event type of the log is folded,
belongs to exactly one writer, and every control event is a decision the planner
makes, an observation the leader records, or leadership; the router follows only known
types. Adding an event type without its place in each list fails here, not in a
replay months later."""

from __future__ import annotations

import typing

from llmgw.core import events, reconcile, state
from llmgw.router import feed

TYPES = set(events.EVENT_TYPES)
WRITERS = (events.NodeEvent, events.OperatorEvent, events.ControlEvent)
# Control events that are neither planned nor observed: who leads, and nothing else.
LEADERSHIP = {events.LeaderElected}


def test_every_event_type_is_folded_and_nothing_else() -> None:
    assert set(state._HANDLERS) == TYPES


def test_every_event_type_has_exactly_one_writer() -> None:
    for cls in TYPES:
        assert [w.__name__ for w in WRITERS if issubclass(cls, w)] != [], cls
        assert sum(issubclass(cls, w) for w in WRITERS) == 1, cls


def test_every_control_event_is_a_decision_an_observation_or_leadership() -> None:
    decisions = set(typing.get_args(reconcile.Decision))
    observations = set(reconcile.OBSERVATIONS)
    control = {cls for cls in TYPES if issubclass(cls, events.ControlEvent)}
    # A node's health is both: observed, and decided on in the same pass.
    assert decisions | observations | LEADERSHIP == control
    assert decisions <= TYPES
    assert observations <= TYPES


def test_the_router_follows_only_known_types_and_every_endpoint_change() -> None:
    relevant = set(feed._RELEVANT)
    assert relevant <= TYPES
    # What adds, removes or marks an endpoint or a model must reach the router's tables.
    assert {
        events.EndpointUp,
        events.EndpointDown,
        events.ModelDeclared,
        events.ModelChanged,
        events.ModelRemoved,
        events.NodeDrainRequested,
        events.DrainShard,
    } <= relevant


def test_tags_are_unique_and_name_their_writer() -> None:
    tags = [events.tag_of(cls) for cls in TYPES]
    assert len(set(tags)) == len(tags)
    prefix = {events.NodeEvent: "node.", events.OperatorEvent: "operator."}
    for cls in TYPES:
        tag = events.tag_of(cls)
        if issubclass(cls, events.Command):
            assert tag.startswith("cmd."), tag
        elif issubclass(cls, events.ControlEvent):
            assert tag.startswith("control."), tag
        else:
            (want,) = [p for w, p in prefix.items() if issubclass(cls, w)]
            assert tag.startswith(want), tag

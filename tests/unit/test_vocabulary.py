"""The core's vocabulary agrees with itself: every event type of the log is registered once
(llmgw.core.vocabulary) with a fold handler and a category, belongs to exactly one writer,
and the lists derived from the registry (the fold's handlers, the reconciler's decisions
and observations, the router's relevant types) are the registry's. Adding an event type
without its place fails here, not in a replay months later."""

from __future__ import annotations

import typing

from llmgw.core import events, reconcile, state, vocabulary
from llmgw.core.vocabulary import Category
from llmgw.router import feed

TYPES = set(events.EVENT_TYPES)
WRITERS = (events.NodeEvent, events.OperatorEvent, events.ControlEvent)
# The writer each category's events must be published by.
WRITER_OF = {
    Category.REPORT: events.NodeEvent,
    Category.OPERATOR: events.OperatorEvent,
    Category.OBSERVATION: events.ControlEvent,
    Category.DECISION: events.ControlEvent,
    Category.LEADERSHIP: events.ControlEvent,
}


def test_every_event_type_is_registered_once_with_a_handler_and_a_category() -> None:
    registered = [e.type for e in vocabulary.VOCABULARY]
    assert len(registered) == len(set(registered)), "an event type is registered twice"
    assert set(registered) == TYPES
    for entry in vocabulary.VOCABULARY:
        assert callable(entry.handler), entry.type
        assert isinstance(entry.category, Category), entry.type


def test_the_fold_dispatches_through_the_registry() -> None:
    assert set(vocabulary.HANDLERS) == TYPES
    assert all(vocabulary.HANDLERS[e.type] is e.handler for e in vocabulary.VOCABULARY)


def test_every_event_type_has_exactly_one_writer_and_it_matches_its_category() -> None:
    for cls in TYPES:
        assert sum(issubclass(cls, w) for w in WRITERS) == 1, cls
        assert issubclass(cls, WRITER_OF[vocabulary.BY_TYPE[cls].category]), cls


def test_commands_are_decisions() -> None:
    for cls in TYPES:
        if issubclass(cls, events.Command):
            assert vocabulary.BY_TYPE[cls].category is Category.DECISION, cls


def test_the_reconcilers_decision_union_is_the_registrys() -> None:
    # `Decision` stays a static union for typing; it must list what the registry says.
    assert set(typing.get_args(reconcile.Decision)) == set(vocabulary.DECISIONS)
    assert set(reconcile.OBSERVATIONS) == set(vocabulary.of_category(Category.OBSERVATION))
    # Every decision is reconciled; an observation may be (a node's health is observed,
    # and decided on, in the same pass), nothing else is.
    for entry in vocabulary.VOCABULARY:
        if entry.category is Category.DECISION:
            assert entry.reconciled, entry.type
        elif entry.category is not Category.OBSERVATION:
            assert not entry.reconciled, entry.type


def test_the_router_follows_the_registrys_types_and_every_endpoint_change() -> None:
    assert set(feed._RELEVANT) == set(vocabulary.ROUTED)
    # What adds, removes or marks an endpoint or a model must reach the router's tables.
    assert {
        events.EndpointUp,
        events.EndpointDown,
        events.ModelDeclared,
        events.ModelChanged,
        events.ModelRemoved,
        events.NodeDrainRequested,
        events.DrainShard,
    } <= set(vocabulary.ROUTED)


def test_an_unregistered_type_is_refused_by_the_fold() -> None:
    class Stray(events.ControlEvent, tag="control.stray", kw_only=True, frozen=True):
        pass

    st = state.ClusterState()
    reason = state.apply(st, Stray(id="x", ts=1.0, epoch=0), 1)
    assert reason == "Stray is not an event the fold knows"


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

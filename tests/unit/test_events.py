"""The event vocabulary: round trips, subjects, versioning and hostile bytes."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.core import events, subjects

from .strategies import any_event, event_strategy

FIXTURES = Path(__file__).parent.parent / "fixtures" / "events"


@pytest.mark.parametrize("cls", events.EVENT_TYPES, ids=lambda c: c.__name__)
@given(data=st.data())
def test_every_event_type_round_trips_through_json(
    cls: type[events.Event], data: st.DataObject
) -> None:
    event = data.draw(event_strategy(cls))
    decoded = events.decode(events.encode(event))
    assert decoded == event
    assert type(decoded) is cls


@given(st.binary(max_size=300))
def test_any_bytes_decode_to_an_event_or_a_clean_rejection(raw: bytes) -> None:
    try:
        result = events.decode(raw)
    except events.DecodeError:
        return
    assert isinstance(result, events.EVENT_TYPES)


@given(
    st.dictionaries(
        st.sampled_from(["type", "v", "id", "ts", "node", "phase", "log", "replica_id", "x"]),
        st.one_of(
            st.sampled_from(list(events.BY_TAG)),
            st.integers(-3, 5),
            st.text(max_size=5),
            st.none(),
            st.booleans(),
            st.lists(st.integers(), max_size=2),
        ),
    )
)
def test_json_objects_of_the_wrong_shape_are_rejected_cleanly(raw: dict[str, object]) -> None:
    try:
        result = events.decode(msgspec.json.encode(raw))
    except events.DecodeError:
        return
    assert isinstance(result, events.EVENT_TYPES)


def test_a_stored_v1_shard_status_decodes_with_current_code() -> None:
    raw = (FIXTURES / "shard-status-v1.json").read_bytes()
    event = events.decode(raw)
    assert isinstance(event, events.ShardStatus)
    assert event.v == events.current_version(events.ShardStatus) == 2
    assert event.log_tail == ("INFO loading weights", "RuntimeError: CUDA out of memory")
    assert event.error == "engine exited with status 1 while loading"
    assert event.generation == 3


def test_a_version_from_the_future_is_refused_with_a_hint() -> None:
    raw = (FIXTURES / "shard-status-v1.json").read_bytes().replace(b'"v":1', b'"v":9')
    with pytest.raises(events.DecodeError, match="upgrade llmgw"):
        events.decode(raw)


def test_an_unknown_type_is_refused() -> None:
    with pytest.raises(events.DecodeError, match="unknown event type"):
        events.decode(b'{"type":"node.exploded","id":"a","ts":1}')


def test_unknown_extra_fields_are_ignored_for_forward_compatibility() -> None:
    raw = b'{"type":"node.heartbeat","id":"a","ts":1.5,"node":"n1","added_later":[1,2]}'
    assert events.decode(raw) == events.Heartbeat(id="a", ts=1.5, node="n1")


@given(any_event)
def test_every_event_has_a_subject_in_its_writers_namespace(event: events.Event) -> None:
    subject = events.subject_of(event)
    tag = events.tag_of(type(event))
    if isinstance(event, events.Command):
        assert subject == f"llmgw.cmd.{event.node}"
    elif isinstance(event, events.NodeEvent):
        assert subject.startswith(f"llmgw.events.node.{event.node}.")
    elif isinstance(event, events.OperatorEvent):
        assert subject == f"llmgw.events.operator.{event.operator}." + tag.split(".", 1)[1]
        assert events.published_where_owned(event, subject)
        assert not events.published_where_owned(event, subject.replace(".operator.", ".operator.x"))
    else:
        assert subject == "llmgw.events.control." + tag.split(".", 1)[1]
    assert subjects.node_of(subject) == getattr(event, "node", None) or not isinstance(
        event, events.NodeEvent | events.Command
    )


@pytest.mark.parametrize(
    "bad", ["", "a.b", "node*", "all>", "gpu node", "tab\tnode", "nl\n", "x" * 200, "ü"]
)
def test_identifiers_that_could_inject_a_subject_token_are_refused(bad: str) -> None:
    with pytest.raises(subjects.SubjectTokenError, match="cannot be used in a NATS subject"):
        subjects.node_event(bad, "heartbeat")
    with pytest.raises(subjects.SubjectTokenError):
        subjects.command(bad)
    with pytest.raises(subjects.SubjectTokenError):
        events.subject_of(events.Heartbeat(id="i", ts=0, node=bad))


def test_subject_builders() -> None:
    assert subjects.node_event("gpu-07", "heartbeat") == "llmgw.events.node.gpu-07.heartbeat"
    assert subjects.node_events("gpu-07") == "llmgw.events.node.gpu-07.>"
    assert subjects.command("gpu-07") == "llmgw.cmd.gpu-07"
    assert (
        subjects.operator_event("alice", "node_cordoned")
        == "llmgw.events.operator.alice.node_cordoned"
    )
    assert (
        subjects.control_operator_event("control-1", "model_declared")
        == "llmgw.events.operator.control.control-1.model_declared"
    )
    assert subjects.operator_author("llmgw.events.operator.alice.node_cordoned") == (
        "operator",
        "alice",
        "node_cordoned",
    )
    assert subjects.operator_author("llmgw.events.operator.control.c1.model_declared") == (
        "control",
        "c1",
        "model_declared",
    )
    assert subjects.operator_author("llmgw.events.operator.node_cordoned") == (
        "",
        "",
        "node_cordoned",
    )
    assert subjects.operator_author("llmgw.events.control.leader_elected") is None
    assert subjects.control_event("replica_placed") == "llmgw.events.control.replica_placed"
    assert subjects.node_of("llmgw.cmd.gpu-07") == "gpu-07"
    assert subjects.node_of("llmgw.events.control.replica_placed") is None


@given(any_event, any_event)
def test_an_event_is_trusted_only_on_its_own_subject(a: events.Event, b: events.Event) -> None:
    assert events.published_where_owned(a, events.subject_of(a))
    other = events.subject_of(b)
    assert events.published_where_owned(a, other) == (other == events.subject_of(a))


def test_a_node_cannot_vouch_for_another_node_or_for_the_control_plane() -> None:
    beat = events.Heartbeat(id="h", ts=1, node="node-b")
    assert not events.published_where_owned(beat, "llmgw.events.node.node-a.heartbeat")
    retired = events.ReplicaRetired(id="x", ts=1, replica_id="r1")
    assert not events.published_where_owned(retired, "llmgw.events.node.node-a.heartbeat")
    assert events.published_where_owned(retired, "llmgw.events.control.replica_retired")


def test_an_operator_event_is_trusted_only_under_its_own_kind_and_author() -> None:
    cordon = events.NodeCordoned(id="c", ts=1, operator="c1", node="gpu-1")
    assert events.published_where_owned(cordon, "llmgw.events.operator.c1.node_cordoned")
    # Another kind's subject is not this event's, though the same operator may write both.
    assert not events.published_where_owned(cordon, "llmgw.events.operator.c1.node_uncordoned")
    # A control plane writes only its config file's models under its own name: a cordon
    # in its namespace is nobody's, on a model's subject or on a cordon's.
    for kind in ("model_declared", "node_cordoned"):
        subject = f"llmgw.events.operator.control.c1.{kind}"
        assert not events.published_where_owned(cordon, subject)
    removed = events.ModelRemoved(id="m", ts=1, operator="c1", name="llama")
    assert events.published_where_owned(removed, "llmgw.events.operator.control.c1.model_removed")
    # Nor may one control plane name another as the author of its models.
    assert not events.published_where_owned(
        removed, "llmgw.events.operator.control.c2.model_removed"
    )
    # The shared subject without an author is what older logs hold: still read.
    assert events.published_where_owned(cordon, "llmgw.events.operator.node_cordoned")


@pytest.mark.parametrize("node", ["", "a.b", "gpu*", "x" * 200])
def test_an_event_whose_ids_make_no_subject_is_trusted_on_none(node: str) -> None:
    # Names are bounded only in length at decode: a node's id that no subject can hold
    # must make the event untrusted wherever it was found, its writer's own subject too.
    raw = msgspec.json.encode({"type": "node.heartbeat", "id": "h", "ts": 1.0, "node": node})
    beat = events.decode(raw)
    for subject in ("llmgw.events.node.a.heartbeat", f"llmgw.events.node.{node}.heartbeat"):
        assert not events.published_where_owned(beat, subject)

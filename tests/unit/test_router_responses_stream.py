"""`IndexedResponses`: llama-server's Responses events given their indices and numbers.

The events here have the shapes llama.cpp b11434's tools/server/server-task.cpp writes:
items named only by `item_id`, a reasoning item, a message with one text part, function
calls, and the `response.created`/`response.in_progress` pair it repeats with every chunk
of an answer whose first token was part of a character.
"""

from __future__ import annotations

import json
from typing import Any

import hypothesis.strategies as st
from hypothesis import given

from llmgw.router import relay, responses_stream
from llmgw.router.responses_stream import IndexedResponses

RESP = {"id": "resp_1", "object": "response", "status": "in_progress"}
PART_TYPES = {
    "response.content_part.added", "response.content_part.done", "response.output_text.delta",
    "response.output_text.done", "response.reasoning_text.delta",
}  # fmt: skip


def sse(data: dict[str, Any]) -> bytes:
    return f"event: {data['type']}\ndata: {json.dumps(data)}\n\n".encode()


def opening() -> list[dict[str, Any]]:
    return [{"type": "response.created", "response": RESP},
            {"type": "response.in_progress", "response": RESP}]  # fmt: skip


def reasoning(rid: str, deltas: list[str]) -> list[dict[str, Any]]:
    item = {"id": rid, "summary": [], "type": "reasoning", "content": [],
            "encrypted_content": "", "status": "in_progress"}  # fmt: skip
    return [{"type": "response.output_item.added", "item": item}] + [
        {"type": "response.reasoning_text.delta", "delta": d, "item_id": rid} for d in deltas
    ]


def message(mid: str, deltas: list[str]) -> list[dict[str, Any]]:
    item = {"content": [], "id": mid, "role": "assistant", "status": "in_progress",
            "type": "message"}  # fmt: skip
    return [
        {"type": "response.output_item.added", "item": item},
        {"type": "response.content_part.added", "item_id": mid,
         "part": {"type": "output_text", "text": ""}},
    ] + [{"type": "response.output_text.delta", "item_id": mid, "delta": d}
         for d in deltas]  # fmt: skip


def call(cid: str, deltas: list[str]) -> list[dict[str, Any]]:
    item = {"id": f"fc_{cid}", "arguments": "", "call_id": f"call_{cid}", "name": "f",
            "type": "function_call", "status": "in_progress"}  # fmt: skip
    return [{"type": "response.output_item.added", "item": item}] + [
        {"type": "response.function_call_arguments.delta", "delta": d, "item_id": f"fc_{cid}"}
        for d in deltas
    ]


def done(item_id: str, kind: str) -> dict[str, Any]:
    return {"type": "response.output_item.done",
            "item": {"id": item_id, "type": kind, "status": "completed"}}  # fmt: skip


def run(events: list[bytes], cuts: list[int]) -> list[bytes]:
    """The events through one rewriter, fed as runs of whole events cut at `cuts`."""
    rewrite = IndexedResponses()
    out: list[bytes] = []
    start = 0
    for cut in [*sorted(cuts), len(events)]:
        got = rewrite(b"".join(events[start:cut]))
        out.extend(e + b"\n\n" for e in got.split(b"\n\n") if e)
        start = max(start, cut)
    return out


def data_of(event: bytes) -> dict[str, Any]:
    line = next(x for x in event.split(b"\n") if x.startswith(b"data: "))
    parsed: dict[str, Any] = json.loads(line[6:])
    return parsed


def test_a_stream_with_reasoning_text_and_two_calls_gets_each_items_index() -> None:
    events = (
        opening() + reasoning("rs_1", ["so", "..."]) + message("msg_1", ["Hel", "lo"])
        + call("a", ['{"x":', "1}"]) + call("b", ["{}"])
        + [done("rs_1", "reasoning"),
           {"type": "response.output_text.done", "item_id": "msg_1", "text": "Hello"},
           done("msg_1", "message"), done("fc_a", "function_call"),
           done("fc_b", "function_call"),
           {"type": "response.completed", "response": {**RESP, "status": "completed"}}]
    )  # fmt: skip
    out = [data_of(e) for e in run([sse(e) for e in events], [3, 9])]
    assert [e["sequence_number"] for e in out] == list(range(len(events)))
    index = {"rs_1": 0, "msg_1": 1, "fc_a": 2, "fc_b": 3}
    for e in out:
        item = e.get("item_id") or (e.get("item") or {}).get("id")
        assert e.get("output_index") == (index[item] if item else None), e
        assert e.get("content_index") == (0 if e["type"] in PART_TYPES else None), e


def test_a_repeated_created_and_its_in_progress_are_dropped() -> None:
    # What llama-server sends when its first token is part of a character.
    events = opening() + message("m", ["😊"]) + opening() + [
        {"type": "response.output_text.delta", "item_id": "m", "delta": "!"}
    ] + opening() + [{"type": "response.completed", "response": RESP}]  # fmt: skip
    out = [data_of(e) for e in run([sse(e) for e in events], [])]
    assert [e["type"] for e in out] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.completed",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in out] == list(range(7))


def test_an_in_progress_that_does_not_follow_a_repeated_created_is_kept() -> None:
    # llama-server's prompt progress is a response.in_progress of its own.
    progress = {"type": "response.in_progress", "response": RESP, "prompt_progress": {"n": 1}}
    events = [*opening(), progress, *message("m", ["a"])]
    out = [data_of(e) for e in run([sse(e) for e in events], [])]
    assert [e["type"] for e in out].count("response.in_progress") == 2


def test_what_is_not_one_json_event_passes_unchanged() -> None:
    odd = [b": keep-alive\n\n", b"event: x\ndata: [DONE]\n\n", b"data: {\"no\": \"type\"}\n\n",
           b"data: [1, 2]\n\n", b"event: only a name\n\n", b"xdata: {\"type\": \"a\"}\n\n",
           b"data: {\"type\": \"response.output_text.delta\", \"delta\": \"\\u00e9\"\n\n",
           ]  # fmt: skip
    assert IndexedResponses()(b"".join(odd)) == b"".join(odd)


def test_an_event_nested_too_deeply_to_decode_passes_unchanged() -> None:
    """msgspec raises RecursionError, not DecodeError, past its depth: an engine's event
    nested that deep broke the stream as a bug of the router's, logged with its traceback."""
    deep = b"[" * 100_000 + b"]" * 100_000
    event = b'event: response.output_text.delta\ndata: {"type":"x","delta":' + deep + b"}\n\n"
    assert IndexedResponses()(event) == event


def test_a_stream_naming_endless_items_indexes_no_more_than_the_bound() -> None:
    rewrite = IndexedResponses()
    n = responses_stream.MAX_ITEMS + 5
    out = rewrite(b"".join(sse(e) for i in range(n) for e in message(f"m{i}", [])[:1]))
    got = [data_of(e + b"\n\n") for e in out.split(b"\n\n") if e]
    assert [e.get("output_index") for e in got] == [
        *range(responses_stream.MAX_ITEMS), *[None] * 5]  # fmt: skip
    assert len(rewrite._items) == responses_stream.MAX_ITEMS
    assert got[-1]["sequence_number"] == n - 1  # still numbered


def test_only_llama_servers_responses_streams_are_rewritten() -> None:
    assert isinstance(responses_stream.repair("responses", "llamacpp"), IndexedResponses)
    for kind, engine in [("responses", "vllm"), ("responses", "sglang"),
                         ("chat", "llamacpp"), ("messages", "llamacpp")]:  # fmt: skip
        assert responses_stream.repair(kind, engine) is None
    assert "repair" in relay.EngineStream.__slots__


ITEM_KINDS = st.sampled_from(["reasoning", "message", "call"])
TEXT = st.text(max_size=6)


@st.composite
def streams(draw: st.DrawFn) -> tuple[list[dict[str, Any]], int]:
    """A llama-server Responses stream, with repeated openings: its events and how many
    repeats it holds."""
    events = opening()
    repeats = 0
    for n in range(draw(st.integers(0, 4))):
        kind = draw(ITEM_KINDS)
        deltas = draw(st.lists(TEXT, max_size=4))
        make = {"reasoning": reasoning, "message": message, "call": call}[kind]
        events += make(f"{kind}_{n}", deltas)
        if draw(st.booleans()):
            events += opening()
            repeats += 1
    return events, repeats


def repeated(events: list[dict[str, Any]], i: int) -> bool:
    """Whether event i repeats the stream's opening (a created, or the in_progress after)."""
    kind, before = events[i]["type"], events[i - 1]["type"] if i else ""
    return i >= 2 and (
        kind == "response.created"
        or (kind == "response.in_progress" and before == "response.created")
    )


@given(streams(), st.lists(st.integers(0, 40), max_size=5), st.booleans())
def test_each_event_is_relayed_with_only_its_indices_and_number_added(
    drawn: tuple[list[dict[str, Any]], int], cuts: list[int], give_some: bool
) -> None:
    events, repeats = drawn
    if give_some:  # an engine that sends some indices itself keeps them
        for e in events[2::3]:
            e.setdefault("output_index", 99)
            e["sequence_number"] = -1
    out = run([sse(e) for e in events], cuts)
    assert len(out) == len(events) - 2 * repeats
    kept = iter(e for i, e in enumerate(events) if not repeated(events, i))
    seen: dict[str, int] = {}
    for n, event in enumerate(out):
        got, sent = data_of(event), next(kept)
        assert event.startswith(f"event: {sent['type']}\n".encode())
        assert {k: got[k] for k in sent} == sent  # nothing the engine sent changed
        assert set(got) - set(sent) <= {"output_index", "content_index", "sequence_number"}
        assert got["sequence_number"] == sent.get("sequence_number", n)
        item = sent.get("item_id") or (sent.get("item") or {}).get("id")
        if item is not None and "output_index" not in sent:
            assert got["output_index"] == seen.setdefault(item, len(seen))
    assert run(out, []) == out  # a stream made whole is left as it is


@given(st.binary(max_size=300), st.lists(st.binary(max_size=40), max_size=4))
def test_no_bytes_make_it_raise_and_non_events_survive(noise: bytes, more: list[bytes]) -> None:
    rewrite = IndexedResponses()
    for chunk in [noise, *more]:
        out = rewrite(chunk)
        if b"data: " not in chunk:
            assert out == chunk

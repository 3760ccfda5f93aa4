"""The relay's looks into SSE bytes: role-only openers and usage chunks."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from llmgw.router import sse

OPENER = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'
OPENER_BARE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}'
OPENER_SPACED = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}'
TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}'
TOKEN_NULL_USAGE = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}],"usage":null}'
DONE = b"data: [DONE]"
MESSAGE_START = (
    b'event: message_start\ndata: {"type":"message_start","message":{"role":"assistant",'
    b'"content":[]}}'
)
BLOCK_START = b'event: content_block_start\ndata: {"type":"content_block_start","index":0}'
RESPONSE_CREATED = b'event:response.created\ndata: {"type":"response.created"}'
TEXT_DELTA = b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0}'


def usage_event(prompt: int, completion: int, *, choices: bool, spaced: bool) -> bytes:
    obj = {
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}] if choices else [],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion},
    }
    text = json.dumps(obj) if spaced else json.dumps(obj, separators=(",", ":"))
    return b"data: " + text.encode()


def reference_only_openers(data: bytes) -> bool:
    """The plain definition: split into events, every non-empty one only sets the role or
    is named as an opening event."""
    if not data.endswith(b"\n\n"):
        return False
    return all(
        not event
        or (
            b'"role"' in event
            and (b'"content":""' in event or b'"content": ""' in event or b'"content"' not in event)
        )
        or (event.startswith(b"event:") and event.split(b"\n")[0][6:].strip() in sse.OPENING_EVENTS)
        for event in data.split(b"\n\n")
    )


events = st.sampled_from(
    [OPENER, OPENER_BARE, OPENER_SPACED, TOKEN, TOKEN_NULL_USAGE, DONE, b"", b": ping",
     MESSAGE_START, BLOCK_START, RESPONSE_CREATED, TEXT_DELTA, b"event: ping"]
)  # fmt: skip


@given(st.lists(events, max_size=8), st.sampled_from([b"\n\n", b"\n", b""]))
def test_only_openers_matches_its_definition(parts: list[bytes], end: bytes) -> None:
    data = b"\n\n".join(parts) + end
    assert sse.only_openers(data) == reference_only_openers(data)


def test_only_openers_cases() -> None:
    assert sse.only_openers(OPENER + b"\n\n")
    assert sse.only_openers(OPENER + b"\n\n" + OPENER_BARE + b"\n\n")
    assert sse.only_openers(OPENER_SPACED + b"\n\n")
    assert not sse.only_openers(OPENER + b"\n\n" + TOKEN + b"\n\n")
    assert not sse.only_openers(OPENER)  # not a whole event yet
    assert not sse.only_openers(TOKEN + b"\n\n")
    # The Messages and Responses APIs' opening events, by name.
    assert sse.only_openers(MESSAGE_START + b"\n\n" + BLOCK_START + b"\n\n")
    assert sse.only_openers(RESPONSE_CREATED + b"\n\n")
    assert not sse.only_openers(MESSAGE_START + b"\n\n" + TEXT_DELTA + b"\n\n")


def _named(name: bytes) -> bytes:
    return b'event: %s\ndata: {"type":"%s","sequence_number":0}' % (name, name)


def test_every_api_s_first_token_ends_the_openers() -> None:
    """The reference definition above reads `OPENING_EVENTS` itself: what must never be in
    it, each API's first token (held with the openers, it would wait out the first-token
    deadline, and the request move on after the client could have had it), listed here."""
    opening = (b"response.created", b"response.in_progress", b"response.output_item.added",
               b"response.content_part.added")  # fmt: skip
    openers = [_named(n) for n in opening]
    assert sse.only_openers(b"".join(e + b"\n\n" for e in openers))
    assert sse.only_openers(MESSAGE_START + b"\n\n" + BLOCK_START + b"\n\n" + b"event: ping\n\n")
    firsts = [
        b"response.output_text.delta", b"response.function_call_arguments.delta",
        b"response.reasoning_text.delta", b"response.refusal.delta", b"response.completed",
        b"response.output_item.done", b"content_block_delta", b"message_delta", b"error",
    ]  # fmt: skip
    for name in firsts:
        assert not sse.only_openers(b"".join(e + b"\n\n" for e in [*openers, _named(name)]))
    assert not sse.only_openers(OPENER + b"\n\n" + TOKEN + b"\n\n")


def test_usage_is_counted_and_the_requested_chunk_dropped() -> None:
    usage = usage_event(20, 16, choices=False, spaced=False)
    stream = b"".join(e + b"\n\n" for e in (OPENER, TOKEN, usage, DONE))
    at = stream.find(sse.USAGE_KEY)
    kept, found = sse.take_usage(stream, at, drop=False)
    assert kept == stream
    assert [(u.prompt_tokens, u.completion_tokens) for u in found] == [(20, 16)]
    dropped, found = sse.take_usage(stream, at, drop=True)
    assert dropped == b"".join(e + b"\n\n" for e in (OPENER, TOKEN, DONE))
    assert len(found) == 1


def test_usage_with_choices_and_spaced_json_is_counted_not_dropped() -> None:
    usage = usage_event(3, 4, choices=True, spaced=True)
    stream = TOKEN_NULL_USAGE + b"\n\n" + usage + b"\n\n" + DONE + b"\n\n"
    out, found = sse.take_usage(stream, stream.find(sse.USAGE_KEY), drop=True)
    assert out == stream
    assert [(u.prompt_tokens, u.completion_tokens) for u in found] == [(3, 4)]


def test_usage_is_read_only_from_an_events_data_line() -> None:
    """A comment, or a line of another field, that holds `data: {..."usage"...}` midway
    is no usage: it is neither counted nor dropped."""
    usage = usage_event(5, 6, choices=False, spaced=False)
    for event in (b": " + usage, b"id: " + usage):
        stream = TOKEN + b"\n\n" + event + b"\n\n" + DONE + b"\n\n"
        out, found = sse.take_usage(stream, stream.find(sse.USAGE_KEY), drop=True)
        assert (out, found) == (stream, [])


def test_an_event_naming_usage_twice_is_counted_once() -> None:
    """An event whose JSON has a second "usage" key (nested in another object) is one
    event: its usage counted once, not per key."""
    event = (b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":8},'
             b'"metadata":{"usage":{"note":"x"}}}')  # fmt: skip
    stream = TOKEN + b"\n\n" + event + b"\n\n" + DONE + b"\n\n"
    out, found = sse.take_usage(stream, stream.find(sse.USAGE_KEY), drop=True)
    assert [(u.prompt_tokens, u.completion_tokens) for u in found] == [(7, 8)]
    assert out == TOKEN + b"\n\n" + DONE + b"\n\n"


def test_usage_is_counted_whatever_the_blanks_around_its_colon() -> None:
    """JSON writers that space their colons (`"usage" : {`) still have the usage counted."""
    event = b'data: {"choices" : [], "usage" :  {"prompt_tokens" : 2, "completion_tokens" : 3}}'
    stream = event + b"\n\n" + DONE + b"\n\n"
    out, found = sse.take_usage(stream, stream.find(sse.USAGE_KEY), drop=True)
    assert [(u.prompt_tokens, u.completion_tokens) for u in found] == [(2, 3)]
    assert out == DONE + b"\n\n"


@given(
    st.lists(
        st.one_of(
            events,
            st.builds(
                usage_event,
                st.integers(0, 10**6),
                st.integers(0, 10**6),
                choices=st.booleans(),
                spaced=st.booleans(),
            ),
        ),
        max_size=8,
    ),
    st.booleans(),
)
def test_take_usage_finds_every_usage_and_drops_exactly_the_usage_only_events(
    parts: list[bytes], drop: bool
) -> None:
    stream = b"".join(p + b"\n\n" for p in parts)
    at = stream.find(sse.USAGE_KEY)
    out, found = sse.take_usage(stream, at, drop=drop) if at >= 0 else (stream, [])
    expected_usage = []
    kept = []
    for p in parts:
        body = json.loads(p[6:]) if p.startswith(b"data: {") else {}
        usage = body.get("usage")
        if usage is not None:
            expected_usage.append((usage["prompt_tokens"], usage["completion_tokens"]))
            if drop and not body["choices"]:
                continue
        kept.append(p)
    assert [(u.prompt_tokens, u.completion_tokens) for u in found] == expected_usage
    assert out == b"".join(p + b"\n\n" for p in kept)


class Copied(bytes):
    """Bytes that count what is copied out of them (slices, concatenations), and stay
    `Copied` through both."""

    total = 0

    def __getitem__(self, key: Any) -> Any:
        got = super().__getitem__(key)
        if not isinstance(key, slice):
            return got
        Copied.total += len(got)
        return Copied(got)

    def __add__(self, other: bytes) -> Copied:  # type: ignore[override]
        joined = super().__add__(other)
        Copied.total += len(joined)
        return Copied(joined)


def test_dropping_many_usage_chunks_copies_the_bytes_a_few_times_not_once_per_chunk() -> None:
    """An engine may send a read's worth of usage-only events (a megabyte of them when the
    client reads slowly): each dropped one must not copy the rest of the read again."""
    usage = usage_event(1, 1, choices=False, spaced=False) + b"\n\n"
    stream = Copied(b"".join([TOKEN + b"\n\n", usage * 2000, DONE + b"\n\n"]))
    Copied.total = 0
    out, found = sse.take_usage(stream, stream.find(sse.USAGE_KEY), drop=True)
    assert len(found) == 2000
    assert out == TOKEN + b"\n\n" + DONE + b"\n\n"
    assert Copied.total <= 4 * len(stream)


def test_a_stream_is_complete_when_it_ends_as_its_api_or_with_done() -> None:
    stop = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    assert sse.complete(stop, "messages")
    assert not sse.complete(TEXT_DELTA + b"\n\n", "messages")
    assert not sse.complete(TOKEN + b"\n\n", "chat")
    assert sse.complete(TOKEN + b"\n\n" + DONE + b"\n\n", "chat")
    # vLLM ends its Messages stream with [DONE] after message_stop, in the same read or the
    # next: taken for a stream cut short, it was ended with an error event the anthropic
    # SDK raises after the whole message.
    assert sse.complete(stop + DONE + b"\n\n", "messages")
    assert sse.complete(DONE + b"\n\n", "messages")


MESSAGE_STOP = b'event: message_stop\ndata: {"type":"message_stop"}'
RESPONSE_ENDS = [
    b'event: response.%s\ndata: {"type":"response.%s","response":{}}' % (end, end)
    for end in (b"completed", b"incomplete", b"failed")
]
# A model's text naming a stream's last event: JSON leaves it as it is, a line of its own
# only in the event's name.
SAYS_STOP = (
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"text_delta","text":"event: message_stop"}}'
)
SAYS_COMPLETED = (
    b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
    b'"delta":"\\"type\\":\\"response.completed\\" event: response.completed"}'
)
stream_events = st.sampled_from(
    [TOKEN, TEXT_DELTA, MESSAGE_START, RESPONSE_CREATED, MESSAGE_STOP, *RESPONSE_ENDS,
     SAYS_STOP, SAYS_COMPLETED, b": ping"]
)  # fmt: skip
LAST_EVENTS = {"messages": [MESSAGE_STOP], "responses": RESPONSE_ENDS}


@given(st.lists(stream_events, min_size=1, max_size=6),
       st.sampled_from(["chat", "completions", "messages", "responses"]))  # fmt: skip
def test_a_stream_is_complete_only_when_its_last_event_ends_it(
    parts: list[bytes], kind: str
) -> None:
    """A stream cut after an event that is not its API's last is incomplete (the client
    gets an error event, the endpoint a failure), whatever came before it, and whatever
    the model wrote: a Messages stream cut right after a text delta saying
    "event: message_stop" was taken for a whole one."""
    tail = b"".join(p + b"\n\n" for p in parts)
    assert sse.complete(tail, kind) == (parts[-1] in LAST_EVENTS.get(kind, []))
    assert sse.complete(tail + DONE + b"\n\n", kind)


@given(st.lists(events, max_size=6), st.lists(events, max_size=6),
       st.sampled_from([b"\n\n", b"\n", b""]), st.sampled_from([b"", b"\n", b"\n\n"]))  # fmt: skip
def test_held_openers_need_not_be_looked_at_again(
    held: list[bytes], more: list[bytes], end: bytes, lead: bytes
) -> None:
    """What the relay relies on to look at each read once (`EngineStream._first_token`):
    after bytes that are only openers, the whole is only openers when the rest is."""
    first = b"\n\n".join(held) + b"\n\n"
    data = lead + b"\n\n".join(more) + end
    if sse.only_openers(first) and data:
        assert sse.only_openers(first + data) == sse.only_openers(data)


def _client_reads(stream: bytes) -> list[tuple[str, bytes]]:
    """(event name, data) of each event, as the SSE specification has a client read them:
    lines end at CRLF, LF or CR; `data:` lines are joined with LF; a blank line ends one."""
    out: list[tuple[str, bytes]] = []
    name, data = "", []
    for line in stream.splitlines():
        if not line:
            if data:
                out.append((name, b"\n".join(data)))
            name, data = "", []
        elif line.startswith(b"data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(b" ") else value)
        elif line.startswith(b"event:"):
            name = line[6:].strip().decode()
    return out


@given(st.binary(max_size=300))
def test_a_payload_is_one_event_whatever_its_line_breaks(payload: bytes) -> None:
    # An engine's pretty-printed body relayed as an event: its blank lines ended the event
    # early, and the SDK read half a JSON document.
    from llmgw.router import requests

    want = b"\n".join(payload.splitlines())
    assert _client_reads(requests.data_event(payload)) == [("", want)]
    assert _client_reads(requests.error_event("messages", payload)) == [("error", want)]
    doc = {"error": {"message": "bad\nrequest", "type": "invalid_request_error"}}
    pretty = json.dumps(doc, indent=2).replace("\n", "\r\n").encode() + b"\n\n"
    ((_, data),) = _client_reads(requests.error_event("chat", pretty))
    assert json.loads(data) == doc


ERROR = b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error"}}'
COMMENT = b": keep-alive"
named_events = st.sampled_from([MESSAGE_START, BLOCK_START, TEXT_DELTA, ERROR, COMMENT, TOKEN])


def reference_first_name(data: bytes) -> bytes | None:
    """The plain definition: the `event:` name of the first event that is not a comment."""
    for event in data.split(b"\n\n"):
        if not event or event.startswith(b":"):
            continue
        head = event.split(b"\n", 1)[0]
        return head[6:].strip() if head.startswith(b"event:") else None
    return None


@given(st.lists(named_events, max_size=6), st.text(max_size=40), st.integers(0, 10**6))
def test_a_messages_stream_always_opens_with_its_message_and_keeps_every_byte(
    parts: list[bytes], model: str, chars: int
) -> None:
    data = b"\n\n".join(parts) + b"\n\n" if parts else b""
    out = sse.with_message_start(data, "r-1", model, chars)
    assert out.endswith(data)  # nothing the engine sent is lost or changed
    added = out[: len(out) - len(data)]
    first = reference_first_name(data)
    if first in (None, b"message_start", b"error"):
        assert added == b""  # the engine's own opening (or its error) is left as it is
        return
    assert sse.with_message_start(out, "r-1", model, chars) == out  # written once
    name, payload = added.removesuffix(b"\n\n").split(b"\n")
    assert name == b"event: message_start"
    doc = json.loads(payload.removeprefix(b"data: "))
    message = doc["message"]
    assert (doc["type"], message["type"], message["role"]) == (
        "message_start",
        "message",
        "assistant",
    )
    assert (message["model"], message["id"], message["content"]) == (model, "msg_r-1", [])
    assert message["usage"] == {"input_tokens": chars // 4, "output_tokens": 0}
    # The usage the router counts from it: the estimate it wrote, the prompt's alone.
    _, usages = sse.take_usage(added, added.find(sse.USAGE_KEY), drop=False)
    assert [(u.prompt_tokens, u.completion_tokens) for u in usages] == [(chars // 4, 0)]


def test_the_message_start_is_written_where_llama_server_leaves_it_out() -> None:
    # Recorded from llama-server b11434 ("Answer with an emoji.", greedy): its first token
    # was part of the emoji, and the stream began at content_block_start.
    engine = (
        b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
        b'"content_block":{"type":"text","text":""}}\n\n'
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":"\xf0\x9f\x8c\x9f"}}\n\n'
    )
    out = sse.with_message_start(engine, "abc", "smol", 27)
    assert out.startswith(b"event: message_start\ndata: {")
    assert out.endswith(b"\n\n" + engine)
    assert sse.with_message_start(MESSAGE_START + b"\n\n" + engine, "abc", "smol", 27) == (
        MESSAGE_START + b"\n\n" + engine)  # fmt: skip
    assert sse.with_message_start(COMMENT + b"\n\n" + ERROR + b"\n\n", "abc", "m", 9) == (
        COMMENT + b"\n\n" + ERROR + b"\n\n")  # fmt: skip

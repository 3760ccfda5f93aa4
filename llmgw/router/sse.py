"""What the relay looks at in an engine's SSE bytes, as pure functions over bytes.

The router relays a stream as raw bytes, whole events at a time (`events_end` finds
where they end). It looks into them for little: whether the first bytes are nothing but
the stream's opening (the chat stream's role-only chunk, the Messages and Responses APIs'
opening events: held back, so the first-token deadline still covers the wait), whether a
Messages stream's first token came without its `message_start` (`with_message_start`),
the usage chunk, counted for metrics and token limits and dropped when the router asked
for it on the client's behalf, and whether the last bytes end the stream (`complete`).
Each looks at as few bytes as it can: a fast engine's first read holds the whole answer.
Used by `llmgw.router.relay`.
"""

from __future__ import annotations

import msgspec

from llmgw.router import requests

USAGE_KEY = b'"usage"'
DONE = b"data: [DONE]\n\n"
# The last event of a whole stream, per API: OpenAI's chat and completions end with
# [DONE]; the Responses API with its response's final state; Anthropic's with message_stop,
# named on a line of its own (a model's text may say "event: message_stop" too, but JSON
# leaves no line break in it).
_ENDS: dict[str, tuple[bytes, ...]] = {
    "responses": (b'"type":"response.completed"', b'"type":"response.incomplete"',
                  b'"type":"response.failed"'),
    "messages": (b"\nevent: message_stop",),
}  # fmt: skip


def complete(tail: bytes, kind: str) -> bool:
    """Whether `tail` (the last bytes relayed) ends a whole stream of API `kind`."""
    if tail.endswith(DONE):
        # The chat stream's end ends any: vLLM sends it after a Messages stream's
        # message_stop (and after the error event of one that failed).
        return True
    ends = _ENDS.get(kind)
    if ends is None:
        return False
    last = tail.rstrip(b"\n").rfind(b"\n\n")
    final = b"\n" + (tail[last + 2 :] if last >= 0 else tail)  # each line after a \n
    return any(e in final for e in ends)


def events_end(before: bytes, data: bytes) -> int:
    """Where the whole events in `data` end (after its last blank line, which may begin
    with `before`, the last byte of what came before it); -1 when there is none."""
    cut = data.rfind(b"\n\n")
    if cut >= 0:
        return cut + 2
    return 1 if before == b"\n" and data[:1] == b"\n" else -1


_BLANK = b" \t\r\n"
OPENING_EVENTS = frozenset({
    b"message_start", b"content_block_start", b"ping",
    b"response.created", b"response.in_progress", b"response.output_item.added",
    b"response.content_part.added",
})  # fmt: skip
"""The named events that open a Messages or Responses stream before any token: the
message or response begun, a content block or part about to fill, Anthropic's ping."""


def only_openers(data: bytes) -> bool:
    """Whether `data` is whole SSE events that each only open the answer: a chat chunk that
    only announces the assistant's role, or an opening event of the Messages or Responses
    API (`OPENING_EVENTS`).

    Stops at the first event that is not one.
    """
    if not data.endswith(b"\n\n"):
        return False
    pos = 0
    n = len(data)
    while pos < n:
        end = data.find(b"\n\n", pos)
        if end < 0:  # "\n\n\n": the last "\n\n" overlapped; the rest is one event
            end = n
        if end > pos and not (
            (
                data.find(b'"role"', pos, end) >= 0
                and (
                    data.find(b'"content":""', pos, end) >= 0
                    or data.find(b'"content": ""', pos, end) >= 0  # Python's json.dumps
                    or data.find(b'"content"', pos, end) < 0
                )
            )
            or _opening_event(data, pos, end)
        ):
            return False
        pos = end + 2
    return True


def _opening_event(data: bytes, pos: int, end: int) -> bool:
    """Whether the event at data[pos:end] is named one of `OPENING_EVENTS`."""
    if not data.startswith(b"event:", pos):
        return False
    line = data.find(b"\n", pos, end)
    return data[pos + 6 : line if line >= 0 else end].strip() in OPENING_EVENTS


def _usage_is_object(data: bytes, at: int) -> bool:
    """Whether the `"usage"` key at `at` has an object value (not null: OpenAI sends
    `"usage":null` in every chunk of a stream that asked for usage)."""
    rest = data[at + len(USAGE_KEY) : at + len(USAGE_KEY) + 16].lstrip(_BLANK)
    return rest[:1] == b":" and rest[1:].lstrip(_BLANK)[:1] == b"{"


def take_usage(out: bytes, at: int, *, drop: bool) -> tuple[bytes, list[requests.Usage]]:
    """The usage of every event in `out` that carries one, and `out` without the
    usage-only events (no choices) when `drop`.

    `at` is the first `"usage"` in `out` (the caller has looked for it already). Only
    the events around each `"usage"` are decoded; the rest stay bytes.
    """
    found: list[requests.Usage] = []
    # What is kept, in pieces joined once at the end: cutting each dropped event out of
    # `out` at once would copy the rest of `out` per event (a megabyte of usage-only events
    # held the loop for a second).
    kept: list[bytes] = []
    kept_from = 0
    while at >= 0:
        before = out.rfind(b"\n\n", 0, at)
        # (Never before kept_from: the last dropped event's "\n\n" lies before `at`.)
        start = before + 2 if before >= 0 else 0
        end = out.find(b"\n\n", at)
        end = len(out) if end < 0 else end + 2
        if _usage_is_object(out, at):
            event = out[start:end].rstrip(b"\n")
            # The data line, after an `event:` line where the API names its events.
            line = event.find(b"data: {")
            if line == 0 or (line > 0 and event[line - 1 : line] == b"\n"):
                u = requests.usage_of(event[line + 6 :])
                if u is not None and u.usage is not None:
                    found.append(u.usage)
                    if drop and not u.choices:
                        kept.append(out[kept_from:start])
                        kept_from = end
        at = out.find(USAGE_KEY, end)
    if kept:
        kept.append(out[kept_from:])
        out = b"".join(kept)
    return out, found


def _first_event_name(data: bytes) -> bytes | None:
    """The `event:` name of the first event in `data` that is not a comment (None: that
    event names none, or there is no such event)."""
    pos, n = 0, len(data)
    while pos < n:
        end = data.find(b"\n\n", pos)
        if end < 0:
            end = n
        if data.startswith(b"event:", pos):
            line = data.find(b"\n", pos, end)
            return data[pos + 6 : line if line >= 0 else end].strip()
        if end > pos and not data.startswith(b":", pos):
            return None  # a data-only event: not the router's to judge
        pos = end + 2
    return None


def with_message_start(data: bytes, message_id: str, model: str, prompt_chars: int) -> bytes:
    """A Messages stream's first bytes `data` (whole events), opened by a `message_start`.

    llama-server (b11434) sends its `message_start` only with the answer's first token and
    leaves it out when that token is part of a character (an emoji, most CJK text in a small
    vocabulary), so the stream begins at `content_block_start`; Anthropic's SDKs then fail
    the request. The router writes the missing event itself: the message's prompt tokens are
    estimated as a cut stream's are (`requests.estimated_usage`), since the engine never
    says them, and the key is charged that estimate. A stream that opens with its
    `message_start`, or with an error, is returned as it is.
    """
    if _first_event_name(data) in (None, b"message_start", b"error"):
        return data
    usage = requests.estimated_usage((0, 0), prompt_chars, 0)
    message: dict[str, object] = {
        "id": f"msg_{message_id}", "type": "message", "role": "assistant", "content": [],
        "model": model, "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": usage.prompt_tokens, "output_tokens": 0},
    }  # fmt: skip
    opening = msgspec.json.encode({"type": "message_start", "message": message})
    return b"event: message_start\ndata: " + opening + b"\n\n" + data

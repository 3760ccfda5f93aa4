"""A Responses stream from an engine that leaves out its events' indices, made whole.

OpenAI's Responses API places every streamed event by `output_index` (which output item)
and `content_index` (which part of it), and numbers the events with `sequence_number`.
llama-server (b11434) names an event's item only by `item_id` and sends none of the three,
so clients that accumulate a stream by its indices fail on every answer it streams (the
`openai` SDK's `responses.stream()` raises a TypeError at the first text delta). It also
repeats `response.created` and `response.in_progress` with every chunk of an answer whose
first token was part of a character (it marks the response begun only when its first
token is sent), which restarts a client that keys its state on `response.created`.

`IndexedResponses` rewrites such a stream's whole events as they pass: each item gets the
next output index when it first appears (its `output_item.added`, or its `done` when that
came first) and keeps it; its parts and their deltas get content index 0 (llama-server
gives an item one part); every event relayed gets the next sequence number; a field the
engine did send is left as it is. A repeated `response.created` is dropped, and so is the
`response.in_progress` that follows it. An event it cannot read is relayed unchanged.

The relay applies it to the engines in `UNINDEXED` (`llmgw.router.relay`); other engines'
streams pass unread.
"""

from __future__ import annotations

from typing import Any

import msgspec

UNINDEXED = frozenset({"llamacpp"})
"""Engines whose Responses streams need `IndexedResponses`."""
MAX_ITEMS = 1024
"""Items indexed in one stream (an answer has a few: its reasoning, its message, its calls);
past them an engine's new items pass without an index, so a hostile engine naming endless
items grows no table in the router."""

_ITEM_EVENTS = frozenset({"response.output_item.added", "response.output_item.done"})
_PART_EVENTS = frozenset({
    "response.content_part.added", "response.content_part.done",
    "response.output_text.delta", "response.output_text.done",
    "response.reasoning_text.delta", "response.reasoning_text.done",
    "response.refusal.delta", "response.refusal.done",
})  # fmt: skip
"""Events of one part of an item: placed by `output_index` and `content_index`."""
_DATA = b"data: "
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


def repair(kind: str, engine: str) -> IndexedResponses | None:
    """The rewriter a stream of API `kind` from an engine of kind `engine` needs, if any."""
    return IndexedResponses() if kind == "responses" and engine in UNINDEXED else None


class IndexedResponses:
    """One Responses stream's rewriter: call it with each run of whole events."""

    __slots__ = ("_created", "_items", "_next_seq", "_skip_progress")

    def __init__(self) -> None:
        self._items: dict[str, int] = {}
        """Item id -> its output index."""
        self._next_seq = 0
        self._created = False
        self._skip_progress = False
        """The next `response.in_progress` is the repeat of a repeated `response.created`."""

    def __call__(self, events: bytes) -> bytes:
        out: list[bytes] = []
        pos, n = 0, len(events)
        while pos < n:
            end = events.find(b"\n\n", pos)
            end = n if end < 0 else end + 2
            event = self._event(events[pos:end])
            if event:
                out.append(event)
            pos = end
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        """The event rewritten (b"": dropped)."""
        at = event.find(_DATA)
        if at < 0 or (at > 0 and event[at - 1 : at] != b"\n"):
            return event  # a comment, or an event without data
        line_end = event.find(b"\n", at)
        line_end = len(event) if line_end < 0 else line_end
        try:
            data = _decode(event[at + len(_DATA) : line_end])
        except (msgspec.DecodeError, RecursionError):
            # (RecursionError: nested past what msgspec decodes, which an engine decides.)
            return event
        if not isinstance(data, dict) or not isinstance(data.get("type"), str):
            return event
        if not self._place(data):
            return b""
        return event[:at] + _DATA + _encode(data) + event[line_end:]

    def _place(self, data: dict[str, Any]) -> bool:
        """Fill in `data`'s indices and number; False: the event is a repeat to drop."""
        kind = data["type"]
        if kind == "response.created":
            if self._created:
                self._skip_progress = True
                return False
            self._created = True
        elif kind == "response.in_progress" and self._skip_progress:
            self._skip_progress = False
            return False
        else:
            self._skip_progress = False
            item = data.get("item")
            if kind in _ITEM_EVENTS and isinstance(item, dict):
                self._index(data, item.get("id"))
            elif kind in _PART_EVENTS or kind.startswith("response.function_call_arguments."):
                self._index(data, data.get("item_id"))
                if kind in _PART_EVENTS:
                    data.setdefault("content_index", 0)
        data.setdefault("sequence_number", self._next_seq)
        self._next_seq += 1
        return True

    def _index(self, data: dict[str, Any], item_id: object) -> None:
        """Set `data`'s output index from its item's (a new item: the next one)."""
        if "output_index" in data or not isinstance(item_id, str):
            return
        index = self._items.get(item_id)
        if index is None:
            if len(self._items) >= MAX_ITEMS:
                return
            index = self._items[item_id] = len(self._items)
        data["output_index"] = index

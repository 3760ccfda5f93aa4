"""The turns of a Messages or Responses API body as SGLang renders them.

SGLang serves both APIs by turning the body into a chat request and rendering that with
the model's chat template, its own way (read from SGLang 0.5.23's
`entrypoints/anthropic/serving.py` and `entrypoints/openai/serving_responses.py`), which
differs from vLLM's (`llmgw.router.turns`) in the text it gives the template:

- a message of several parts reaches a text-only template as their texts (empty ones too)
  with a space between two, as SGLang's chat does (`turns.of_chat`);
- Messages: the `system` text blocks are joined by newlines (a string of only white
  space is none), a user message of no text or image block is left out, and an
  assistant's is rendered empty;
- Responses: a `developer` message is a system turn, its text labelled; consecutive
  assistant items (a message, its reasoning, its function calls) are one assistant turn,
  two strings joined by a blank line; a reasoning item of no text is left out.

Tool calls, their results and reasoning add no text, as in `llmgw.router.turns`: a prompt
with them is keyed exactly up to the first of them. SGLang gathers a conversation's
system turns into one when the model's template renders a system turn only first; the
router keys them where they stand, as templates that render them anywhere do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import msgspec

if TYPE_CHECKING:
    from llmgw.router.turns import Content, Part, Turns, _Item, _Turn

MESSAGES_TEXT = frozenset({"text"})
MESSAGES_SHOWN = frozenset({"text", "image"})
"""The blocks that keep a Messages API user message in SGLang's chat."""
RESPONSES_TEXT = frozenset({"input_text", "output_text", "text"})
"""The parts of a Responses API message whose text SGLang renders."""
DEVELOPER_LABEL = "Developer instructions:"
"""What SGLang puts before a `developer` message's text (a line of its own)."""
TOOL_CALLS = frozenset({"function_call", "custom_tool_call"})
TOOL_OUTPUTS = frozenset({"function_call_output", "custom_tool_call_output"})
_SUMMARY = msgspec.json.Decoder(list[dict[str, object]] | None)

Said: TypeAlias = "str | list[str] | None"
"""A chat message's content as SGLang builds it: a string, its parts' texts, or none."""


def _texts(content: Sequence[str | Part], kinds: frozenset[str]) -> list[str]:
    return [p.text for p in content if not isinstance(p, str) and p.type in kinds]


def of_messages(system: str | list[str | Part], said: list[_Turn]) -> Turns:
    """A Messages API body's turns as SGLang's Anthropic adapter renders them."""
    if isinstance(system, str):
        parts = [system] if system.strip() else []
    else:
        parts = [p.text for p in system if not isinstance(p, str) and p.type == "text" and p.text]
    turns = [("system", "\n".join(parts))] if parts else []
    for message in said:
        content = message.content
        if not isinstance(content, list):
            turns.append((message.role, content or ""))
        elif message.role == "assistant" or any(
            not isinstance(p, str) and p.type in MESSAGES_SHOWN for p in content
        ):
            turns.append((message.role, " ".join(_texts(content, MESSAGES_TEXT))))
    return tuple(turns)


@dataclass
class _Entry:
    """One chat message of SGLang's Responses rendering, while assistant items merge."""

    role: str
    said: Said
    phase: bytes = b""
    """A message item's `phase`, raw (b"": none)."""
    thought: bool = False
    """It holds only reasoning so far."""
    calls: bool = False
    """It holds function calls."""


def of_responses(instructions: str | None, given: str | list[_Item]) -> Turns:
    """A Responses API body's turns as SGLang's Responses serving renders them."""
    entries = [_Entry("system", instructions)] if instructions else []
    if isinstance(given, str):
        entries.append(_Entry("user", given))
    else:
        for item in given:
            entry = _entry(item)
            if entry is None:
                continue
            last = entries[-1] if entries else None
            if last is not None and _merges(last, entry):
                _merge(last, entry)
            else:
                entries.append(entry)
    return tuple((e.role, _flat(e.said)) for e in entries)


def _entry(item: _Item) -> _Entry | None:
    """The chat message SGLang makes of one input item (None: it makes none)."""
    if item.type in TOOL_CALLS:
        return _Entry("assistant", None, calls=True)
    if item.type in TOOL_OUTPUTS:
        return _Entry("tool", "")  # its output is rendered as a tool turn, not reproduced
    if item.type == "reasoning":
        return _Entry("assistant", None, thought=True) if _thought(item) else None
    if item.type != "message" or not item.role:
        return None  # SGLang refuses an item of another type
    # Only a message carries its phase into the chat message.
    phase = bytes(item.phase) if item.phase and bytes(item.phase) != b"null" else b""
    if item.role == "developer":
        return _Entry("system", _labelled(_said(item.content)), phase)
    return _Entry(item.role, _said(item.content), phase)


def _said(content: Content) -> Said:
    return _texts(content, RESPONSES_TEXT) if isinstance(content, list) else content


def _labelled(said: Said) -> Said:
    if isinstance(said, str):
        return f"{DEVELOPER_LABEL}\n{said}"
    if isinstance(said, list):
        return [f"{DEVELOPER_LABEL}\n{said[0]}", *said[1:]] if said else [DEVELOPER_LABEL]
    return said


def _thought(item: _Item) -> bool:
    """Whether a reasoning item has text SGLang renders (its summary's, else its content's)."""
    try:
        summary = _SUMMARY.decode(item.summary) if item.summary else None
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        summary = None
    if any(isinstance(part.get("text"), str) and part["text"] for part in summary or ()):
        return True
    content = item.content
    return isinstance(content, list) and any(not isinstance(p, str) and p.text for p in content)


def _merges(last: _Entry, entry: _Entry) -> bool:
    """SGLang makes consecutive assistant messages one, unless their phases differ (a
    reasoning-only message merges whatever the phase)."""
    if last.role != "assistant" or entry.role != "assistant":
        return False
    return last.phase == entry.phase or last.thought


def _merge(last: _Entry, entry: _Entry) -> None:
    """`entry` into `last`, as SGLang merges a chat message into the one before it: the
    merged one holds only reasoning while nothing else was added to it."""
    last.said = _merged(last.said, entry.said)
    last.thought = last.thought and entry.said in (None, "") and not entry.calls
    last.thought = last.thought and not entry.phase
    last.phase = entry.phase or last.phase
    last.calls = last.calls or entry.calls


def _merged(before: Said, after: Said) -> Said:
    if after is None or after == "":
        return before
    if before is None or before == "":
        return after
    if isinstance(before, str) and isinstance(after, str):
        return f"{before}\n\n{after}"
    return _as_parts(before) + _as_parts(after)


def _as_parts(said: Said) -> list[str]:
    if isinstance(said, list):
        return said
    return [said] if said else []


def _flat(said: Said) -> str:
    """The text a text-only chat template gets of a message's content."""
    if isinstance(said, list):
        return " ".join(said)
    return said or ""

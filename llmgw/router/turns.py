"""A prompt's (role, text) turns, as a chat template renders them, for every chat-like API.

The router keys a prompt for prefix affinity (llmgw.core.prefix.ChatHashes, the cache plan
of llmgw.router.prompts) by its turns: a chat's messages, and the conversation the Messages
API (`/v1/messages`) and the Responses API (`/v1/responses`) carry in their own shapes,
read here in the order an engine renders them. vLLM turns both into a chat request and
renders it with the model's chat template, and `llmgw sim` frames them as chat messages:
so equal turns, whatever the API, are an equal prompt and hash alike. SGLang turns them
into a chat request too, its own way (`of_body`'s later turns, read from SGLang 0.5.23's
Anthropic adapter and Responses serving): the router tokenizes an SGLang model's prompt
by those.

Only text is read; what else a conversation holds contributes nothing, the same way
whatever the body: images (an engine's placeholder tokens the router cannot know), the
Messages API's `tool_use` and `tool_result` blocks, and the Responses API's function calls,
their outputs and reasoning items (rendered by the template as tool calls and tool turns).
A prompt with them is keyed as the engine's up to the first of them and approximately
after it, as a chat's tool calls are.

A body whose conversation has a shape the router does not know yields no turns: it is
routed as before, never refused (the engine says what it accepts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeAlias

import msgspec

from llmgw.router import llama_turns, sglang_turns

Turns: TypeAlias = tuple[tuple[str, str], ...]
"""(role, text) one a message, in the order the engine renders them."""


class Later(msgspec.Struct, frozen=True):
    """Turns worked out when asked for, by a model whose engine renders them so: equal
    when worked out the same way of equal parts, as a parsed request is equal to itself."""

    render: Callable[..., Turns]
    parts: tuple[Any, ...] = ()

    def __call__(self) -> Turns:
        return self.render(*self.parts)


def worked_out(turns: Turns | Later) -> Turns:
    """`turns`, worked out now if they were left for later."""
    return turns() if isinstance(turns, Later) else turns


class Part(msgspec.Struct):
    """A content block (Messages) or part (chat, Responses): its text, when it is text."""

    type: str = ""
    text: str = ""


Content: TypeAlias = str | list[str | Part] | None
"""A message's content: a string, or its parts (vLLM's chat takes a string as a text part)."""


class _Turn(msgspec.Struct):
    role: str = ""
    content: Content = None


class _Item(msgspec.Struct):
    """A Responses API input item; a message without `type` is one (an easy input message).
    `phase` and `summary` are kept raw: only SGLang's rendering reads them, and a shape the
    router does not know there must not cost the whole body its turns."""

    type: str = "message"
    role: str = ""
    content: Content = None
    phase: msgspec.Raw = msgspec.Raw()
    summary: msgspec.Raw = msgspec.Raw()


RESPONSE_ROLES = frozenset({"system", "developer", "user", "assistant"})
"""The roles of the Responses API's input messages."""
MESSAGES_TEXT = frozenset({"text"})
MESSAGES_KEPT = frozenset({"image", "thinking", "tool_use", "tool_result"})
"""The blocks besides text that keep a Messages API message in the chat vLLM renders (a
message of none, and of no text, is left out)."""
PART_JOINER = "\n"
"""What vLLM puts between two text parts of one message when its chat template is given
the message's content as a string (`"\n".join(texts)`, its default for text-only
templates); the sim renders as vLLM does."""
RESPONSES_TEXT = frozenset({"input_text", "output_text", "text"})
"""The parts whose text the Responses API's engines render (vLLM's, the sim's)."""
CHAT_TEXT = RESPONSES_TEXT
"""The parts of a chat message whose `text` vLLM renders (an image's, say, it does not)."""

_SYSTEM = msgspec.json.Decoder(str | list[str | Part])
_MESSAGES = msgspec.json.Decoder(list[_Turn])
_INSTRUCTIONS = msgspec.json.Decoder(str | None)
_INPUT = msgspec.json.Decoder(str | list[_Item])
_UNREADABLE = (msgspec.ValidationError, msgspec.DecodeError, RecursionError)
"""A member of a shape the router does not read (nested past what msgspec decodes, too)."""


def content_text(
    content: Content, kinds: frozenset[str] = CHAT_TEXT, joiner: str = PART_JOINER
) -> str:
    """A turn's text: a string as it is, or its texts (of the parts of `kinds` only) as the
    engine joins them: the non-empty ones, `joiner` between two (vLLM's chat: a newline)."""
    if isinstance(content, str):
        return content
    if not content:
        return ""
    return joiner.join(text for text in _texts(content, kinds) if text)


def _texts(parts: list[str | Part], kinds: frozenset[str]) -> Iterator[str]:
    for part in parts:
        if isinstance(part, str):
            yield part
        elif part.type in kinds:
            yield part.text


SGLANG_TEXT = frozenset({"text", "input_text"})
"""The parts of a chat message whose `text` SGLang renders."""


class ChatMessage(Protocol):
    role: str
    content: Content


def of_chat(messages: Sequence[ChatMessage]) -> tuple[Turns, Turns]:
    """A chat's (role, content) messages as turns: as vLLM (and the sim) renders them, and
    as SGLang does when a message's content is a list of parts (else none: the same).

    SGLang gives a text-only chat template a message's parts' texts (of its text types,
    empty ones too) with a space between two, where vLLM puts a newline between the
    non-empty ones; the text index keys either engine's prompt by the first."""
    turns = tuple((m.role, content_text(m.content)) for m in messages)
    if not any(isinstance(m.content, list) for m in messages):
        return turns, ()
    return turns, tuple((m.role, _sglang_text(m.content)) for m in messages)


def _sglang_text(content: Content) -> str:
    if not isinstance(content, list):
        return content or ""
    return " ".join(p.text for p in content if isinstance(p, Part) and p.type in SGLANG_TEXT)


def chat_text(turns: Turns) -> str:
    """The text the text index hashes: each role, a newline, its text and a newline, one
    after another (llmgw.core.prefix.ChatHashes relies on it)."""
    parts: list[str] = []
    for role, content in turns:
        parts += (role, "\n", content, "\n")
    return "".join(parts)


def chat_text_length(role: str, content: str) -> int:
    """What one turn adds to `chat_text`."""
    return len(role) + len(content) + 2


def given(raw: msgspec.Raw) -> bool:
    """Whether a member kept raw is in the body and not null."""
    return bool(raw) and bytes(raw) != b"null"


class _MessagesBody(msgspec.Struct):
    system: msgspec.Raw = msgspec.Raw()
    messages: msgspec.Raw = msgspec.Raw()


class _ResponsesBody(msgspec.Struct):
    """`previous_response_id`, `conversation` and `prompt` each begin the prompt with what
    the engine (or its API) stored, which the router never sees: a body with one has no
    turns, rather than turns that are not the prompt's beginning."""

    instructions: msgspec.Raw = msgspec.Raw()
    input: msgspec.Raw = msgspec.Raw()
    previous_response_id: msgspec.Raw = msgspec.Raw()
    conversation: msgspec.Raw = msgspec.Raw()
    prompt: msgspec.Raw = msgspec.Raw()


_BODIES: dict[str, msgspec.json.Decoder[_MessagesBody | _ResponsesBody]] = {
    "messages": msgspec.json.Decoder(_MessagesBody),
    "responses": msgspec.json.Decoder(_ResponsesBody),
}


def of_body(kind: str, body: bytes) -> tuple[Turns, Later, Turns]:
    """The turns of a body of API `kind` (`messages` or `responses`), one the router has
    decoded already (as `llmgw.router.requests.parse` does), as vLLM (and the sim) renders
    them; none for another API. And the function that returns them as SGLang renders them
    (asked for an SGLang model only, as they cost a third as much again to work out), and
    the turns llama-server renders where they differ from vLLM's (`llama_turns`; else
    none)."""
    decoder = _BODIES.get(kind)
    try:
        got = decoder.decode(body) if decoder is not None else None
    except _UNREADABLE:
        return (), NONE, ()
    if isinstance(got, _MessagesBody):
        return _of_messages(got.system, got.messages)
    if isinstance(got, _ResponsesBody) and not any(
        given(stored) for stored in (got.previous_response_id, got.conversation, got.prompt)
    ):
        return (*_of_responses(got.instructions, got.input), ())
    return (), NONE, ()


def _none() -> Turns:
    return ()


NONE = Later(_none)


def _of_messages(system: msgspec.Raw, messages: msgspec.Raw) -> tuple[Turns, Later, Turns]:
    """A Messages API body's turns: its `system` (a string or text blocks) as a system turn
    when it has one, then each message's that vLLM renders; as SGLang renders them; and as
    llama-server does, where its system differs."""
    try:
        said = _MESSAGES.decode(messages) if given(messages) else []
        first = _SYSTEM.decode(system) if given(system) else ""
    except _UNREADABLE:
        return (), NONE, ()
    # vLLM concatenates the system blocks, and joins a message's text blocks as a chat's.
    turns = [("system", content_text(first, MESSAGES_TEXT, ""))] if first else []
    turns += ((m.role, content_text(m.content, MESSAGES_TEXT)) for m in said if _rendered(m))
    later = Later(sglang_turns.of_messages, (first, said))
    llama_first = llama_turns.system(first)
    if llama_first == first:
        return tuple(turns), later, ()
    return (
        tuple(turns),
        later,
        (("system", content_text(llama_first, MESSAGES_TEXT, "")), *turns[1:]),
    )


def _rendered(message: _Turn) -> bool:
    """Whether vLLM renders a Messages API message: one of blocks is left out when none is
    a text or another block it keeps (`MESSAGES_KEPT`)."""
    if not isinstance(message.content, list):
        return True
    return any(
        part if isinstance(part, str) else part.type in MESSAGES_KEPT for part in message.content
    ) or bool(content_text(message.content, MESSAGES_TEXT))


def _of_responses(instructions: msgspec.Raw, given_input: msgspec.Raw) -> tuple[Turns, Later]:
    """A Responses API body's turns: its `instructions` as a system turn when it has any,
    then its `input`: a string as one user turn, or its messages' (items of other types,
    or of another role, add none); and as SGLang renders them."""
    try:
        said = _INPUT.decode(given_input) if given(given_input) else []
        first = _INSTRUCTIONS.decode(instructions) if given(instructions) else None
    except _UNREADABLE:
        return (), NONE
    turns = [("system", first)] if first else []
    if isinstance(said, str):
        turns.append(("user", said))
    else:
        turns += (
            (item.role, content_text(item.content, RESPONSES_TEXT))
            for item in said
            if item.type == "message" and item.role in RESPONSE_ROLES
        )
    return tuple(turns), Later(sglang_turns.of_responses, (first, said))

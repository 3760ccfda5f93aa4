"""What the router reads from an OpenAI request body, and the error shape it answers with.

The router decodes only the fields it routes on (model, stream, the prompt
text for prefix affinity) into small msgspec Structs, and relays the body
untouched unless it must change it (an alias or fallback renames the model; a
stream gets a usage chunk requested for token accounting). Decoding errors
become 400s in OpenAI's error shape (Anthropic's for the Messages API), never a 500.
Used by `llmgw.router.app` and `llmgw.router.dispatch`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeAlias

import msgspec

from llmgw.router import maxima, turns
from llmgw.router.turns import Content, Turns, chat_text

Kind = Literal[
    "chat", "completions", "embeddings", "responses", "messages", "count_tokens", "tokenize",
    "detokenize", "rerank", "score",
]  # fmt: skip
ANTHROPIC: frozenset[Kind] = frozenset({"messages", "count_tokens"})
"""Anthropic's APIs: their errors are in Anthropic's shape, their ids in its header too."""
STREAMED_USAGE: frozenset[Kind] = frozenset({"responses", "messages"})
"""APIs whose streams always carry their usage (no stream_options to ask for it)."""


class Message(msgspec.Struct):
    role: str = ""
    content: Content = None


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


# `stream: null` is the default, as OpenAI's API and vLLM read it: no stream.
# `priority` is vLLM's (and SGLang's) scheduling order on the engine, lowest first: not a
# client's to set, since the router's queue orders keys (only whether it is there is read).

ABSENT = msgspec.Raw()
"""The default of a member kept raw (`priority`, `cache_salt`): empty when the body has none."""
Count = Annotated[int, msgspec.Meta(ge=0)]
"""A maximum of tokens to generate: what a key's token limits hold for the request."""
Choices = Annotated[int, msgspec.Meta(ge=1)]
"""How many answers the engine generates for one request (`n`, `best_of`)."""
GENERATES: frozenset[str] = frozenset({"chat", "completions", "responses", "messages"})
"""APIs whose answers are generated tokens: the others' cost is their input's."""


class ChatBody(msgspec.Struct):
    model: str
    messages: list[Message]
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    priority: msgspec.Raw = ABSENT
    cache_salt: msgspec.Raw = ABSENT
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    n: Choices | None = None
    n_predict: int | None = None
    """llama-server's maximum, which it obeys over the others (llmgw.router.maxima)."""
    n_cmpl: int | None = None
    """llama-server's count of answers, which it obeys over `n`."""


class CompletionBody(msgspec.Struct):
    model: str
    prompt: str | list[Any]
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    priority: msgspec.Raw = ABSENT
    cache_salt: msgspec.Raw = ABSENT
    max_tokens: Count | None = None
    n: Choices | None = None
    best_of: Choices | None = None
    max_completion_tokens: Count | None = None
    """llama-server reads it on every path, over `max_tokens`."""
    n_predict: int | None = None
    n_cmpl: int | None = None


class EmbeddingBody(msgspec.Struct):
    model: str
    input: str | list[Any]
    priority: msgspec.Raw = ABSENT
    cache_salt: msgspec.Raw = ABSENT


class OtherBody(msgspec.Struct):
    """The Responses and Messages APIs, tokenize, rerank, score: the model and whether it
    streams is what the router reads of them (of the first two, their conversation too
    when it routes on prompts' text: `turns.of_body`)."""

    model: str
    stream: bool | None = False
    priority: msgspec.Raw = ABSENT
    cache_salt: msgspec.Raw = ABSENT
    max_tokens: Count | None = None
    """The Messages API's."""


class ResponsesBody(OtherBody):
    """The Responses API: its own maximum, and the chat's fields llama-server reads of it
    too (its Responses API is its chat's, with the body kept)."""

    max_output_tokens: Count | msgspec.UnsetType | None = msgspec.UNSET
    """UNSET: not in the body (llama-server renames it, even as null, to `max_tokens`)."""
    max_completion_tokens: Count | None = None
    n_predict: int | None = None
    n: int | None = None
    n_cmpl: int | None = None


_OTHER = msgspec.json.Decoder(OtherBody)
_DECODERS: dict[str, msgspec.json.Decoder[Any]] = {
    "chat": msgspec.json.Decoder(ChatBody),
    "completions": msgspec.json.Decoder(CompletionBody),
    "embeddings": msgspec.json.Decoder(EmbeddingBody),
    "responses": msgspec.json.Decoder(ResponsesBody),
}


class BadRequest(ValueError):
    """A body the router cannot route; the message is shown to the client."""


TOO_DEEP = "the request body is nested too deeply: keep it to a few hundred levels"


_ESCAPE = re.compile(rb"\\(?:u([0-9a-fA-F]{4})|.)", re.DOTALL)
"""A JSON escape: a backslash and the letter after it, or `\\u` and its four digits."""


def _not_json(body: bytes, exc: msgspec.DecodeError) -> str:
    """The 400's message for a body msgspec could not decode. msgspec says a string with
    the first half of a UTF-16 pair (`\\ud800`) and no second is 'truncated', which sends
    a client looking for a cut body: that escape is named instead."""
    said = str(exc)
    lone = _lone_surrogate(body) if "truncated" in said or "surrogate" in said else None
    if lone is None:
        return f"the request body is not valid JSON: {said}"
    at, escape = lone
    return (
        f"the request body is not valid JSON: the escape {escape} at byte {at} is a lone "
        "UTF-16 surrogate; a character above U+FFFF is escaped as a pair, \\uD800-\\uDBFF "
        "then \\uDC00-\\uDFFF: escape both halves, or send the character as UTF-8"
    )


def _lone_surrogate(body: bytes) -> tuple[int, str] | None:
    """The place and text of `body`'s first `\\u` escape of half a UTF-16 pair without
    its other half; a first half at the very end is a cut body's, not lone."""
    half: re.Match[bytes] | None = None  # a first half waiting for its second
    for escape in _ESCAPE.finditer(body):
        unit = int(escape[1], 16) if escape[1] is not None else -1
        second = 0xDC00 <= unit <= 0xDFFF
        if half is not None:
            if not (second and escape.start() == half.end()):
                return half.start(), half[0].decode()
            half = None
        elif second:
            return escape.start(), escape[0].decode()  # a second half without its first
        elif 0xD800 <= unit <= 0xDBFF:
            half = escape
    if half is None or half.end() == len(body):
        return None
    return half.start(), half[0].decode()


class Parsed(msgspec.Struct):
    model: str
    stream: bool
    wants_usage: bool
    has_options: bool
    """The body names stream_options (even as null): the fast rewrite would repeat the key."""
    text: str
    """Prompt text for prefix affinity ("" when not needed)."""
    priority: bool = False
    """The body sets the engine's scheduling `priority`: dropped before it is sent."""
    cache_salt: str | None = None
    """The client's `cache_salt` (vLLM's prefix-cache salt), when it sent a string; what
    the router does with it is its tenancy's to say (llmgw.router.dispatch)."""
    chat: Turns = ()
    """A chat request's (role, text) messages, or a Messages or Responses API request's
    turns (llmgw.router.turns), when the text is wanted: what a chat template renders
    (llmgw.router.prompts). `text` is then each role, a newline, its content and a
    newline, one after another (llmgw.core.prefix.ChatHashes relies on it)."""
    sglang_chat: Turns | turns.Later = ()
    """A chat's turns as SGLang renders them, where they differ (`turns.of_chat`); of the
    Messages and Responses APIs, what returns them, asked for an SGLang model only."""
    llamacpp_chat: Turns = ()
    """The turns as llama-server renders them, where they differ (`turns.of_body`)."""
    max_out: int | None = 0
    """The most tokens each answer may generate, as the body says (None: it says none; 0:
    an API that generates none)."""
    choices: int = 1
    """How many answers the engine generates (`n`, or `best_of` when larger, or
    llama-server's `n_cmpl`: llmgw.router.maxima.answers)."""
    max_field: str = "max_tokens"
    """The field the client names its maximum in (`max_out` is its value), as a refusal
    tells it what to lower: the Responses API's `max_output_tokens`, a chat request's
    `max_completion_tokens` when that one is the larger it sent, llama-server's
    `n_predict` when that one is, else `max_tokens` (llmgw.router.maxima.maximum)."""
    choices_field: str = "n"
    """The field `choices` came from, as a refusal names it."""
    prompts: int = 1
    """A completions request's prompts, each answered `choices` times (maxima.prompts)."""


def parse(kind: Kind, body: bytes, *, want_text: bool) -> Parsed:
    """Decode the routing fields of `body`; raises BadRequest with a message for the client."""
    if not body:
        raise BadRequest("the request body is empty: send a JSON object")
    try:
        req = _DECODERS.get(kind, _OTHER).decode(body)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid request body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(_not_json(body, exc)) from None
    except RecursionError:
        # msgspec refuses JSON nested deeper than the interpreter's recursion limit.
        raise BadRequest(TOO_DEEP) from None
    if not req.model:
        raise BadRequest("`model` is empty: name the model to use")
    if isinstance(req, OtherBody):
        return _other(kind, req, body, want_text)
    if isinstance(req, EmbeddingBody):
        text = req.input if isinstance(req.input, str) else ""
        return Parsed(
            model=req.model,
            stream=False,
            wants_usage=False,
            has_options=False,
            text=text if want_text else "",
            priority=bool(req.priority),
            cache_salt=_salt_text(req.cache_salt),
        )
    wants_usage = req.stream_options is not None and req.stream_options.include_usage
    text = ""
    chat: Turns = ()
    sglang_chat: Turns = ()
    if want_text:
        if isinstance(req, ChatBody):
            chat, sglang_chat = turns.of_chat(req.messages)
            text = chat_text(chat)
        else:
            text = _prompt_text(req.prompt)
    return Parsed(
        model=req.model,
        stream=bool(req.stream),
        wants_usage=wants_usage,
        has_options=req.stream_options is not None or b'"stream_options"' in body,
        text=text,
        chat=chat,
        sglang_chat=sglang_chat,
        priority=bool(req.priority),
        cache_salt=_salt_text(req.cache_salt),
        prompts=1 if isinstance(req, ChatBody) else maxima.prompts(req.prompt),
        **_limits(kind, req),
    )


def _other(kind: Kind, req: OtherBody, body: bytes, want_text: bool) -> Parsed:
    """The routing fields of a body of another API than chat, completions and embeddings:
    of the Messages and Responses APIs, their conversation's turns when the text is wanted
    (llmgw.router.turns), keyed as a chat's."""
    streams = bool(req.stream) and kind in STREAMED_USAGE
    chat, sglang, llama = turns.of_body(kind, body) if want_text else ((), (), ())
    return Parsed(model=req.model, stream=streams, wants_usage=True, has_options=True,
                  text=chat_text(chat), chat=chat, sglang_chat=sglang, llamacpp_chat=llama,
                  priority=bool(req.priority),
                  cache_salt=_salt_text(req.cache_salt),
                  **(_limits(kind, req) if kind in GENERATES else {"max_out": 0}))  # fmt: skip


def _salt_text(raw: msgspec.Raw) -> str | None:
    """A body's `cache_salt` when it is a string (null or another type: none)."""
    if not raw or not bytes(raw).startswith(b'"'):
        return None
    value = msgspec.json.decode(raw)
    return value if isinstance(value, str) and value else None


def _limits(kind: Kind, req: ChatBody | CompletionBody | OtherBody) -> dict[str, Any]:
    """`Parsed`'s maximum and count of answers, the most any engine reads: llmgw.router.maxima."""
    max_out, max_field = maxima.maximum(
        kind, req.max_tokens, getattr(req, "max_completion_tokens", None),
        getattr(req, "max_output_tokens", msgspec.UNSET), getattr(req, "n_predict", None),
    )  # fmt: skip
    choices, choices_field = maxima.answers(kind, getattr(req, "n", None),
                                            getattr(req, "best_of", None),
                                            getattr(req, "n_cmpl", None))  # fmt: skip
    return {"max_out": max_out, "max_field": max_field, "choices": choices,
            "choices_field": choices_field}  # fmt: skip


def _prompt_text(prompt: str | list[Any]) -> str:
    first = prompt if isinstance(prompt, str) else prompt[0] if prompt else ""
    return first if isinstance(first, str) else ""


USAGE_OPTION = b',"stream_options":{"include_usage":true}}'


class Uncached:
    """`rewrite(salt=UNCACHED)`: no `cache_salt`, and no reuse of the engine's cache."""


UNCACHED = Uncached()
Salting: TypeAlias = str | Uncached | None
"""What `rewrite` does to a body's `cache_salt`: set it to this string, drop it and turn
the engine's prompt cache off (`UNCACHED`), or leave the body's (None)."""


def rewrite(
    body: bytes,
    *,
    model: str | None,
    include_usage: bool,
    has_options: bool = True,
    drop_priority: bool = False,
    salt: Salting = None,
) -> bytes:
    """The body with another model name and/or a usage chunk requested and/or without its
    `priority` and/or its `cache_salt` set as `salt` says (`Salting`); BadRequest when it
    nests too deeply to decode.

    The common case — only the usage chunk, no stream_options in the body — appends the
    member to the top-level object's bytes instead of decoding and re-encoding the body.
    """
    if model is None and include_usage and not has_options and not drop_priority and not salt:
        trimmed = body.rstrip()
        if trimmed.endswith(b"}"):
            return trimmed[:-1] + USAGE_OPTION
    try:
        data = msgspec.json.decode(body)
    except RecursionError:
        # `parse` took it, a few frames higher up the stack: a body nested just under
        # msgspec's limit there can be over it here.
        raise BadRequest(TOO_DEEP) from None
    if model is not None:
        data["model"] = model
    if drop_priority:
        data.pop("priority", None)
    if isinstance(salt, str):
        data["cache_salt"] = salt
    elif salt is UNCACHED:
        # An engine without salts (llama.cpp): no prompt of another tenant's is reused.
        data.pop("cache_salt", None)
        data["cache_prompt"] = False
    if include_usage:
        opts = data.get("stream_options")
        data["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
    return msgspec.json.encode(data)


MAX_TOKENS = (1 << 31) - 1
"""The most tokens an engine's usage may report in one field: no context comes near it, so
more (or fewer than none) is a broken engine, and its usage is not counted rather than
taken off a key's usage or overflowing the metrics. Above it lie the counts below zero an
engine writes as unsigned 32-bit numbers (4294967295 for -1): billions of tokens charged to
a key would spend its budget and put its window in debt for years."""
Tokens = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]


class PromptDetails(msgspec.Struct):
    cached_tokens: Tokens | None = None


class Usage(msgspec.Struct):
    prompt_tokens: Tokens = 0
    completion_tokens: Tokens = 0
    prompt_tokens_details: PromptDetails | None = None
    """`cached_tokens`: the prompt tokens the engine found in its prefix cache (vLLM, the
    sim; SGLang with --enable-cache-report)."""
    input_tokens: Tokens = 0
    output_tokens: Tokens = 0
    """The Responses and Messages APIs' names for prompt and completion tokens."""
    total_tokens: Tokens = 0
    """What a usage without the others' counts is: the prompt's (vLLM's rerank)."""


CHARS_PER_TOKEN = 4
"""About how many characters of English text a tokenizer makes one token of: what a prompt's
tokens are estimated from when the engine never said (`estimated_usage`)."""


def estimated_usage(told: tuple[int, int], prompt_chars: int, events: int) -> Usage:
    """The usage of a stream cut before the engine sent its own, at the end: what the
    engine `told` of its prompt and completion tokens so far (the Messages API tells the
    prompt's at once), the rest estimated: a prompt token per `CHARS_PER_TOKEN` of its
    `prompt_chars`, a completion token per one of the `events` relayed."""
    told_in, told_out = told
    return Usage(
        prompt_tokens=told_in or prompt_chars // CHARS_PER_TOKEN,
        completion_tokens=told_out or events,
    )


class _Nested(msgspec.Struct):
    usage: Usage | None = None


class UsageOnly(msgspec.Struct):
    usage: Usage | None = None
    choices: list[msgspec.Raw] | None = None
    response: _Nested | None = None
    """A Responses stream's `response.completed` event holds the usage in its response."""
    message: _Nested | None = None
    """A Messages stream's `message_start` holds the prompt's tokens in its message."""


_usage_decoder = msgspec.json.Decoder(UsageOnly)


def usage_of(data: bytes) -> UsageOnly | None:
    """The usage (and whether choices is empty) of one JSON body or SSE data payload, in
    OpenAI's names whatever the API (Responses: input/output tokens, maybe nested in the
    response; Messages: the prompt's in `message_start`, the completion's in
    `message_delta`)."""
    try:
        u = _usage_decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        # Not a usage the router can count (RecursionError: an engine's answer nested past
        # what msgspec decodes); the answer itself is relayed as it is.
        return None
    found = u.usage
    if found is None:
        nested = u.response or u.message
        found = nested.usage if nested is not None else None
        if found is not None and u.message is not None:
            found.output_tokens = 0  # counted from message_delta
    if found is not None and not (found.prompt_tokens or found.completion_tokens):
        found.prompt_tokens, found.completion_tokens = found.input_tokens, found.output_tokens
        if not (found.prompt_tokens or found.completion_tokens):
            # A pooling API's usage may give its total alone (vLLM's rerank): the prompt's.
            found.prompt_tokens = found.total_tokens
    u.usage = found
    return u


def error_body(
    message: str, type_: str, code: str | None = None, param: str | None = None
) -> bytes:
    """OpenAI's error shape."""
    return msgspec.json.encode(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    )


_ANTHROPIC_TYPES = {
    401: "authentication_error", 402: "billing_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
    503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error",
}  # fmt: skip
"""Anthropic's error type per status (https://docs.anthropic.com/en/api/errors); other
4xx are `invalid_request_error`, other 5xx `api_error`."""


def api_error_body(
    kind: Kind, status: int, message: str, type_: str, code: str | None = None
) -> bytes:
    """An error in the shape of API `kind`'s own: OpenAI's, but for Anthropic's APIs
    (`ANTHROPIC`: Messages and its token count) Anthropic's (`{"type": "error", "error":
    {"type", "message"}}`, the type in its words for the status), whose clients branch on
    `error.type`. Anthropic's shape keeps OpenAI's `param` and `code` too, so a reader of
    either finds its fields."""
    if kind not in ANTHROPIC:
        return error_body(message, type_, code)
    atype = _ANTHROPIC_TYPES.get(status) or ("api_error" if status >= 500 else
                                             "invalid_request_error")  # fmt: skip
    return msgspec.json.encode(
        {"type": "error",
         "error": {"type": atype, "message": message, "param": None, "code": code}}
    )  # fmt: skip


def error_event(kind: Kind, body: bytes) -> bytes:
    """An SSE event carrying the error `body`, which ends a stream of API `kind` that
    already began: the openai SDK raises any `data:` holding an `error` as an APIError; the
    anthropic SDK reads only an event named `error` (a bare `data:` it skips, and a cut
    stream would look like a whole message without its stop_reason)."""
    if kind == "messages":
        return b"event: error\n" + data_event(body)
    return data_event(body)


def data_event(payload: bytes) -> bytes:
    """An SSE event whose data is `payload`: a `data:` line for each of its lines, which the
    client joins again with line feeds (JSON reads them as the whitespace they were). An
    engine's body relayed as an event (its answer or error after keep-alive comments began
    the stream) may be pretty-printed: with its line breaks written as they were, a blank
    line ended the event early and the SDK read half a JSON document."""
    if b"\n" not in payload and b"\r" not in payload:
        return b"data: " + payload + b"\n\n"
    return b"".join([b"data: " + line + b"\n" for line in payload.splitlines()]) + b"\n"

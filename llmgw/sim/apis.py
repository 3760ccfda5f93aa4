"""The simulated engine's other APIs, as vLLM serves them: the OpenAI Responses API
(`/v1/responses`), Anthropic's Messages API (`/v1/messages`) and its token count
(`/v1/messages/count_tokens`), `/tokenize` and `/detokenize`, `/v1/rerank` and `/v1/score`.

Responses and Messages are generations: they are prepared here into the same `Prepared`
the engine runs as a chat, and their bodies and SSE events are written by
`ResponsesFormat` / `MessagesFormat` (the event sequences both SDKs parse). The others
answer at once from the sim's tokenizer and its deterministic embeddings. Bad input is a
400 in OpenAI's error shape, as everywhere in the sim. Purely computational.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import msgspec

from llmgw.core import simtokens as tokens
from llmgw.sim import api
from llmgw.sim.api import ApiError, Prepared
from llmgw.sim.config import SimConfig

_json = msgspec.json.encode


class _InputPart(api._Lenient, kw_only=True):
    type: str
    text: str | None = None


class _InputItem(api._Lenient, kw_only=True):
    role: str = "user"
    content: str | list[_InputPart] | None = None
    type: str = "message"


class ResponsesRequest(api._Lenient, kw_only=True):
    model: str | None = None
    input: str | list[_InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    stream: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Any] | None = None
    cache_salt: str | None = None
    """As on chat (`api._Sampling`): the router salts every API's body under isolation."""


class _AnthropicMessage(api._Lenient, kw_only=True):
    role: str
    content: str | list[_InputPart]


class MessagesRequest(api._Lenient, kw_only=True):
    model: str | None = None
    messages: list[_AnthropicMessage]
    max_tokens: int
    system: str | list[_InputPart] | None = None
    stream: bool | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    tools: list[Any] | None = None
    cache_salt: str | None = None


class CountTokensRequest(api._Lenient, kw_only=True):
    """`/v1/messages/count_tokens`: a Messages request without what generation needs."""

    model: str | None = None
    messages: list[_AnthropicMessage]
    system: str | list[_InputPart] | None = None
    tools: list[Any] | None = None


def _text(
    content: str | list[_InputPart] | None, where: str, kinds: tuple[str, ...], joiner: str = "\n"
) -> str:
    """A message's text as vLLM renders it: a string as it is, or its parts' non-empty
    texts, `joiner` between two (a chat message's parts: a newline)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    for part in content:
        if part.type not in kinds:
            raise api._unsupported(where, f"content of type `{part.type}`")
        if part.text:
            out.append(part.text)
    return joiner.join(out)


def prepare_responses(body: bytes, cfg: SimConfig) -> Prepared:
    req: ResponsesRequest = api._decode(body, ResponsesRequest)
    model = api._resolve_model(req.model, cfg.served_model_names)
    if req.tools:
        raise api._unsupported("tools", "tool calling")
    messages: list[tuple[str, str]] = []
    if req.instructions:
        messages.append(("system", req.instructions))
    if isinstance(req.input, str):
        messages.append(("user", req.input))
    else:
        for i, item in enumerate(req.input):
            if item.type != "message" or item.role not in ("system", "developer", "user",
                                                            "assistant"):  # fmt: skip
                raise ApiError(400, f"input[{i}] is not a message of a chat role", param="input")
            messages.append((item.role, _text(item.content, f"input[{i}].content",
                                              ("input_text", "output_text", "text"))))  # fmt: skip
    if not messages:
        raise ApiError(400, "input is empty: send text or at least one message", param="input")
    prompt = tokens.tokenize(tokens.render_chat(messages))
    max_tokens = api._budget(cfg, prompt, req.max_output_tokens, "max_output_tokens", "input")
    return _generation("responses", model, prompt, max_tokens, bool(req.stream), (),
                       req.cache_salt)  # fmt: skip


def _anthropic_prompt(req: MessagesRequest | CountTokensRequest) -> list[str]:
    """The prompt's tokens of a Messages request (or of its token count: the same)."""
    if req.tools:
        raise api._unsupported("tools", "tool use")
    if not req.messages:
        raise ApiError(400, "messages: at least one message is required", param="messages")
    messages: list[tuple[str, str]] = []
    if req.system:  # vLLM concatenates the system's blocks
        messages.append(("system", _text(req.system, "system", ("text",), "")))
    for i, m in enumerate(req.messages):
        if m.role not in ("user", "assistant"):
            raise ApiError(400, f"messages.{i}.role: must be user or assistant", param="messages")
        text = _text(m.content, f"messages.{i}.content", ("text",))
        if text or isinstance(m.content, str):  # vLLM leaves out a message of no blocks
            messages.append((m.role, text))
    return tokens.tokenize(tokens.render_chat(messages))


def count_tokens(body: bytes, cfg: SimConfig) -> bytes:
    """`/v1/messages/count_tokens`: `{"input_tokens": n}`, n as a Messages request with the
    same system and messages would count its prompt (its `usage.input_tokens`)."""
    req: CountTokensRequest = api._decode(body, CountTokensRequest)
    api._resolve_model(req.model, cfg.served_model_names)
    return msgspec.json.encode({"input_tokens": len(_anthropic_prompt(req))})


def prepare_messages(body: bytes, cfg: SimConfig) -> Prepared:
    req: MessagesRequest = api._decode(body, MessagesRequest)
    model = api._resolve_model(req.model, cfg.served_model_names)
    if req.max_tokens < 1:
        raise ApiError(400, "max_tokens: must be at least 1", param="max_tokens")
    prompt = _anthropic_prompt(req)
    max_tokens = api._budget(cfg, prompt, req.max_tokens, "max_tokens", "messages")
    stops = tuple(req.stop_sequences or ())
    return _generation("messages", model, prompt, max_tokens, bool(req.stream), stops,
                       req.cache_salt)  # fmt: skip


def _generation(
    kind: str, model: str, prompt: list[str], max_tokens: int, stream: bool,
    stops: tuple[str, ...], salt: str | None,
) -> Prepared:  # fmt: skip
    return Prepared(kind=kind, model=model, prompt=prompt, max_tokens=max_tokens, stops=stops,
                    seed=None, ignore_eos=False, stream=stream, include_usage=True,
                    salt=salt or None)  # fmt: skip


# --------------------------------------------------------------------------- Responses


def _response(p: Prepared, rid: str, created: int, status: str, text: str | None,
              use: dict[str, Any] | None) -> dict[str, Any]:  # fmt: skip
    output = []
    if text is not None:
        output.append({
            "type": "message", "id": f"msg_{rid}", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        })  # fmt: skip
    return {
        "id": f"resp_{rid}", "object": "response", "created_at": created, "status": status,
        "model": p.model, "output": output, "parallel_tool_calls": False, "tool_choice": "auto",
        "tools": [], "usage": use, "error": None, "incomplete_details": None,
    }  # fmt: skip


def responses_usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt, "output_tokens": completion, "total_tokens": prompt + completion,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens_details": {"reasoning_tokens": 0},
    }  # fmt: skip


def messages_usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"input_tokens": prompt, "output_tokens": completion,
            "cache_read_input_tokens": cached}  # fmt: skip


def full_body(
    p: Prepared, rid: str, created: int, text: str, finish: str, counts: tuple[int, int, int]
) -> bytes:
    """The whole answer of a Responses or Messages request."""
    if p.kind == "responses":
        return _json(_response(p, rid, created, "completed", text, responses_usage(*counts)))
    return _json({
        "id": f"msg_{rid}", "type": "message", "role": "assistant", "model": p.model,
        "content": [{"type": "text", "text": text}], "stop_reason": _stop_reason(finish),
        "stop_sequence": None, "usage": messages_usage(*counts),
    })  # fmt: skip


def _stop_reason(finish: str) -> str:
    return "max_tokens" if finish == "length" else "end_turn"


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _json(data) + b"\n\n"


class ResponsesFormat:
    """The SSE events of a streamed Responses answer, as the openai SDK reads them."""

    def __init__(self, p: Prepared, rid: str, created: int) -> None:
        self.p, self.rid, self.created = p, rid, created
        self.n = 0
        self.text: list[str] = []

    def _seq(self, data: dict[str, Any]) -> dict[str, Any]:
        data["sequence_number"] = self.n
        self.n += 1
        return data

    def opening(self) -> bytes:
        r = _response(self.p, self.rid, self.created, "in_progress", None, None)
        item = {"type": "message", "id": f"msg_{self.rid}", "status": "in_progress",
                "role": "assistant", "content": []}  # fmt: skip
        part = {"type": "output_text", "text": "", "annotations": []}
        return b"".join([
            _event("response.created", self._seq({"type": "response.created", "response": r})),
            _event("response.in_progress", self._seq({"type": "response.in_progress",
                                                      "response": r})),
            _event("response.output_item.added", self._seq({
                "type": "response.output_item.added", "output_index": 0, "item": item})),
            _event("response.content_part.added", self._seq({
                "type": "response.content_part.added", "item_id": f"msg_{self.rid}",
                "output_index": 0, "content_index": 0, "part": part})),
        ])  # fmt: skip

    def pieces(self, texts: Iterable[str]) -> bytes:
        out = []
        for t in texts:
            self.text.append(t)
            out.append(_event("response.output_text.delta", self._seq({
                "type": "response.output_text.delta", "item_id": f"msg_{self.rid}",
                "output_index": 0, "content_index": 0, "delta": t, "logprobs": []})))  # fmt: skip
        return b"".join(out)

    def closing(self, finish: str, use: dict[str, Any] | None) -> bytes:
        text = "".join(self.text)
        part = {"type": "output_text", "text": text, "annotations": []}
        done = _response(self.p, self.rid, self.created, "completed", text, use)
        mid = f"msg_{self.rid}"
        return b"".join([
            _event("response.output_text.done", self._seq({
                "type": "response.output_text.done", "item_id": mid, "output_index": 0,
                "content_index": 0, "text": text, "logprobs": []})),
            _event("response.content_part.done", self._seq({
                "type": "response.content_part.done", "item_id": mid, "output_index": 0,
                "content_index": 0, "part": part})),
            _event("response.output_item.done", self._seq({
                "type": "response.output_item.done", "output_index": 0,
                "item": done["output"][0]})),
            _event("response.completed", self._seq({"type": "response.completed",
                                                    "response": done})),
        ])  # fmt: skip


class MessagesFormat:
    """The SSE events of a streamed Anthropic Messages answer."""

    def __init__(self, p: Prepared, rid: str, created: int, prompt_tokens: int) -> None:
        self.p, self.rid = p, rid
        self.prompt_tokens = prompt_tokens

    def opening(self) -> bytes:
        message: dict[str, Any] = {
            "id": f"msg_{self.rid}", "type": "message", "role": "assistant",
            "model": self.p.model, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0},
        }  # fmt: skip
        return b"".join([
            _event("message_start", {"type": "message_start", "message": message}),
            _event("content_block_start", {"type": "content_block_start", "index": 0,
                                           "content_block": {"type": "text", "text": ""}}),
        ])  # fmt: skip

    def pieces(self, texts: Iterable[str]) -> bytes:
        return b"".join(
            _event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                           "delta": {"type": "text_delta", "text": t}})
            for t in texts
        )  # fmt: skip

    def closing(self, finish: str, use: dict[str, Any] | None) -> bytes:
        out = (use or {}).get("output_tokens", 0)
        # The totals, the prompt's tokens again, as vLLM (and Anthropic) send them.
        totals = {"input_tokens": self.prompt_tokens, "output_tokens": out}
        return b"".join([
            _event("content_block_stop", {"type": "content_block_stop", "index": 0}),
            _event("message_delta", {"type": "message_delta", "delta": {
                "stop_reason": _stop_reason(finish), "stop_sequence": None},
                "usage": totals}),
            _event("message_stop", {"type": "message_stop"}),
        ])  # fmt: skip


# --------------------------------------------------------------------------- tokens, scores


class TokenizeRequest(api._Lenient, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[api.Message] | None = None


class DetokenizeRequest(api._Lenient, kw_only=True):
    model: str | None = None
    tokens: list[int]


def tokenize(body: bytes, cfg: SimConfig) -> bytes:
    req: TokenizeRequest = api._decode(body, TokenizeRequest)
    api._resolve_model(req.model, cfg.served_model_names)
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "give `prompt` or `messages`, one of them", param="prompt")
    if req.messages is not None:
        text = tokens.render_chat((m.role, api._message_text(m, i))
                                  for i, m in enumerate(req.messages))  # fmt: skip
    else:
        text = req.prompt or ""
    pieces = tokens.tokenize(text)
    ids = tokens.token_ids(pieces)
    for piece, i in zip(pieces, ids, strict=True):
        _PIECES.setdefault(i, piece)
    return _json({"count": len(ids), "max_model_len": cfg.max_model_len, "tokens": ids,
                  "token_strs": None})  # fmt: skip


_PIECES: dict[int, str] = {tokens.token_id(w): w for w in tokens.vocabulary()}
"""Token id -> text, of the generator's words and of every text tokenized here."""


def detokenize(body: bytes, cfg: SimConfig) -> bytes:
    req: DetokenizeRequest = api._decode(body, DetokenizeRequest)
    api._resolve_model(req.model, cfg.served_model_names)
    out = []
    for i, t in enumerate(req.tokens):
        piece = _PIECES.get(t)
        if piece is None:
            raise ApiError(400, f"tokens[{i}] ({t}) is not a token id of this model",
                           param="tokens")  # fmt: skip
        out.append(piece)
    return _json({"prompt": "".join(out)})


class RerankRequest(api._Lenient, kw_only=True):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = None


class ScoreRequest(api._Lenient, kw_only=True):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]


def _similarity(a: str, b: str, dim: int) -> float:
    va, vb = api.embed(tokens.tokenize(a), dim), api.embed(tokens.tokenize(b), dim)
    cos = sum(x * y for x, y in zip(va, vb, strict=True))
    return round(1 / (1 + math.exp(-4 * cos)), 6)  # a relevance in (0, 1)


def rerank(body: bytes, cfg: SimConfig, rid: str) -> tuple[bytes, int]:
    req: RerankRequest = api._decode(body, RerankRequest)
    model = api._resolve_model(req.model, cfg.served_model_names)
    if not req.documents:
        raise ApiError(400, "documents is empty: send at least one", param="documents")
    if req.top_n is not None and req.top_n < 1:
        raise ApiError(400, "top_n must be at least 1", param="top_n")
    scored = [(i, d, _similarity(req.query, d, cfg.embedding_dim))
              for i, d in enumerate(req.documents)]  # fmt: skip
    scored.sort(key=lambda x: -x[2])
    n = sum(tokens.count(req.query) + tokens.count(d) for d in req.documents)
    results = [{"index": i, "document": {"text": d}, "relevance_score": s}
               for i, d, s in scored[: req.top_n or len(scored)]]  # fmt: skip
    return _json({"id": f"rerank-{rid}", "model": model, "usage": {"total_tokens": n},
                  "results": results}), n  # fmt: skip


def score(body: bytes, cfg: SimConfig, rid: str, created: int) -> tuple[bytes, int]:
    req: ScoreRequest = api._decode(body, ScoreRequest)
    model = api._resolve_model(req.model, cfg.served_model_names)
    first = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    second = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    if not first or not second:
        raise ApiError(400, "text_1 and text_2 must not be empty", param="text_1")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ApiError(400, "text_1 must be one text, or as many as text_2", param="text_1")
    data = [{"index": i, "object": "score", "score": _similarity(a, b, cfg.embedding_dim)}
            for i, (a, b) in enumerate(zip(first, second, strict=True))]  # fmt: skip
    n = sum(tokens.count(a) + tokens.count(b) for a, b in zip(first, second, strict=True))
    return _json({"id": f"score-{rid}", "object": "list", "created": created, "model": model,
                  "data": data, "usage": {"prompt_tokens": n, "total_tokens": n}}), n  # fmt: skip

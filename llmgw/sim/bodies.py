"""The bodies of the simulated engine's generated responses: a whole chat or text
completion, its usage, and the SSE chunks of a streamed one.

Streamed chunks are built by concatenating pre-encoded byte strings around each
token's JSON-encoded text: the SSE hot path encodes nothing else per token.
Used by `llmgw.sim.server`. Purely computational.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from llmgw.sim.api import Prepared

_json = msgspec.json.encode


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def full_response(
    p: Prepared, rid: str, created: int, text: str, finish: str, use: dict[str, Any]
) -> bytes:
    """The body of a non-streamed chat or text completion."""
    if p.kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return _json(
        {"id": rid, "object": obj, "created": created, "model": p.model,
         "choices": [choice], "usage": use}
    )  # fmt: skip


class StreamFormat:
    """SSE framing of one streamed response: the bytes around each token are
    encoded once per request, and per token only the token's text is encoded."""

    __slots__ = ("_head", "_kind", "_pre", "_suf")

    def __init__(self, p: Prepared, rid: str, created: int) -> None:
        self._kind = p.kind
        obj = b"chat.completion.chunk" if p.kind == "chat" else b"text_completion"
        self._head = (
            b'data: {"id":' + _json(rid) + b',"object":"' + obj + b'","created":'
            + str(created).encode() + b',"model":' + _json(p.model) + b',"choices":'
        )  # fmt: skip
        if p.kind == "chat":
            self._pre = self._head + b'[{"index":0,"delta":{"content":'
            self._suf = b'},"logprobs":null,"finish_reason":null}]}\n\n'
        else:
            self._pre = self._head + b'[{"index":0,"text":'
            self._suf = b',"logprobs":null,"finish_reason":null}]}\n\n'

    def opening(self) -> bytes:
        """The chunk before any token: chat streams announce the assistant's role."""
        if self._kind == "chat":
            return (
                self._head
                + b'[{"index":0,"delta":{"role":"assistant","content":""},'
                + b'"logprobs":null,"finish_reason":null}]}\n\n'
            )
        return b""

    def pieces(self, texts: Iterable[str]) -> bytes:
        pre, suf = self._pre, self._suf
        return b"".join([pre + _json(t) + suf for t in texts])

    def closing(self, finish: str, use: dict[str, Any] | None) -> bytes:
        """The final chunk with the finish reason, the usage chunk if asked, [DONE]."""
        if self._kind == "chat":
            last = self._head + b'[{"index":0,"delta":{},"logprobs":null,"finish_reason":'
        else:
            last = self._head + b'[{"index":0,"text":"","logprobs":null,"finish_reason":'
        out = last + _json(finish) + b"}]}\n\n"
        if use is not None:
            out += self._head + b'[],"usage":' + _json(use) + b"}\n\n"
        return out + b"data: [DONE]\n\n"

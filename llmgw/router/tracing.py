"""The router's spans: one request's trace, from admission to its last byte.

A recorded request is one SERVER span (`{operation} {model}`, a child of the client's
span when it sent a valid `traceparent`) over these children:

- `admission`: the key, the body, the model, the key's limits;
- `queue`: held at zero replicas or queued behind full endpoints;
- one CLIENT span per attempt (`attempt`), whose id goes to the engine as its parent
  in `traceparent`, so vLLM's or SGLang's own span is the attempt's child;
- `first_token`, from the answering attempt's send to the first token reaching the
  client, and `completion`, from there to the end.

The root carries OpenTelemetry's GenAI attributes (`gen_ai.operation.name`,
`gen_ai.request.model`, `gen_ai.response.model`, `gen_ai.usage.input_tokens`,
`gen_ai.usage.output_tokens`) beside `http.response.status_code` and
`llmgw.request_id`. The request path only notes monotonic clock readings in a
`RequestTrace`; the spans are built once, when the request is done, and handed to the
exporter (llmgw.otlp), which posts them in the background. A router without `traces`
has no Tracer, and each request pays one `is None` check.
"""

from __future__ import annotations

import contextvars
import random
import time
from collections.abc import Mapping
from typing import Any

import structlog

from llmgw import otlp
from llmgw.core import tracing
from llmgw.core.tracing import SPAN_CLIENT, SPAN_INTERNAL, SPAN_SERVER, Span
from llmgw.router import tracecontext
from llmgw.router.config import TracesConfig


class Tracer:
    """Which requests are recorded, and where their spans go."""

    def __init__(self, cfg: TracesConfig, exporter: otlp.Exporter | None = None) -> None:
        self.ratio = cfg.sample_ratio
        self.exporter = exporter or otlp.Exporter(cfg.endpoint, cfg.service_name)
        self._bits = random.SystemRandom().getrandbits(64)
        self._rng = random.Random(self._bits)

    def start(self) -> None:
        self.exporter.start()

    async def close(self) -> None:
        await self.exporter.close()

    def begin(self, headers: Mapping[str, str], rid: str, start: float) -> RequestTrace | None:
        """The trace of a request that began at `start` (time.monotonic), if it is sampled."""
        value = headers.get("traceparent")
        parent = tracing.parse_traceparent(value) if value is not None else None
        bits = self._rng.getrandbits
        trace_id = parent.trace_id if parent is not None else tracing.trace_id_of(bits(128))
        if not tracing.sampled(parent, trace_id, self.ratio):
            return None
        state = tracecontext.tracestate(headers) if parent is not None else ""
        return RequestTrace(
            trace_id,
            parent.span_id if parent is not None else "",
            tracing.span_id_of(bits(64)),
            rid,
            start,
            state,
            self._rng,
        )

    def finish(
        self, trace: RequestTrace, end: float, *, kind: str, model: str, status: int,
        tokens_in: int, tokens_out: int,
    ) -> None:  # fmt: skip
        """The request ended at `end`: its spans go to the exporter."""
        self.exporter.add(trace.spans(end, kind=kind, model=model, status=status,
                                      tokens_in=tokens_in, tokens_out=tokens_out))  # fmt: skip


def bind_logs(
    trace: RequestTrace | None, headers: Mapping[str, str]
) -> Mapping[str, contextvars.Token[Any]]:
    """Put the request's trace id (and span) in every log line it makes (llmgw.logs merges
    the context's variables); a client's valid trace id too when the router does not
    record the trace. The tokens to unbind with, empty when nothing was bound."""
    if trace is not None:
        return structlog.contextvars.bind_contextvars(
            trace_id=trace.trace_id, span_id=trace.root_id
        )
    value = headers.get("traceparent")
    if value is None:
        return {}
    parent = tracing.parse_traceparent(value)
    if parent is None:
        return {}
    return structlog.contextvars.bind_contextvars(trace_id=parent.trace_id)


def unbind_logs(tokens: Mapping[str, contextvars.Token[Any]]) -> None:
    """Undo `bind_logs`: the connection's next request starts without them."""
    structlog.contextvars.reset_contextvars(**tokens)


class _Attempt:
    __slots__ = ("end", "endpoint", "error", "model", "span_id", "start", "url")

    def __init__(self, span_id: str, endpoint: str, url: str, model: str, start: float) -> None:
        self.span_id = span_id
        self.endpoint = endpoint
        self.url = url
        self.model = model
        self.start = start
        self.end = 0.0
        self.error = ""


class RequestTrace:
    """A recorded request's clock readings (time.monotonic), turned into spans at its end."""

    __slots__ = (
        "admitted", "attempts", "first_token", "offset_ns", "parent_id", "queue", "rid",
        "rng", "root_id", "start", "trace_id", "tracestate",
    )  # fmt: skip

    def __init__(
        self, trace_id: str, parent_id: str, root_id: str, rid: str, start: float,
        tracestate: str, rng: random.Random,
    ) -> None:  # fmt: skip
        self.trace_id = trace_id
        self.parent_id = parent_id
        self.root_id = root_id
        self.rid = rid
        self.start = start
        self.tracestate = tracestate
        self.rng = rng
        # Unix time of a monotonic reading: spans are exported in wall-clock nanoseconds.
        self.offset_ns = time.time_ns() - time.monotonic_ns()
        self.admitted = 0.0
        self.queue: tuple[float, float] | None = None
        self.attempts: list[_Attempt] = []
        self.first_token = 0.0

    def attempt_begin(self, endpoint: str, url: str, model: str, now: float) -> None:
        span = tracing.span_id_of(self.rng.getrandbits(64))
        self.attempts.append(_Attempt(span, endpoint, url, model, now))

    def attempt_end(self, error: str, now: float) -> None:
        at = self.attempts[-1]
        at.end, at.error = now, error

    def headers(self) -> list[tuple[str, str]]:
        """The trace context the current attempt sends: its own span as the engine's parent."""
        out = [("traceparent", tracing.traceparent(self.trace_id, self.attempts[-1].span_id))]
        if self.tracestate:
            out.append(("tracestate", self.tracestate))
        return out

    def _ns(self, t: float) -> int:
        return int(t * 1e9) + self.offset_ns

    def _child(self, name: str, kind: int, start: float, end: float, span_id: str = "") -> Span:
        sid = span_id or tracing.span_id_of(self.rng.getrandbits(64))
        return Span(self.trace_id, sid, self.root_id, name, kind, self._ns(start), self._ns(end))

    def spans(
        self, end: float, *, kind: str, model: str, status: int, tokens_in: int = 0,
        tokens_out: int = 0,
    ) -> list[Span]:  # fmt: skip
        """The request's spans, now that it ended at `end`."""
        op = tracing.operation(kind)
        answered = next((a for a in reversed(self.attempts) if not a.error), None)
        root = Span(self.trace_id, self.root_id, self.parent_id, f"{op} {model}", SPAN_SERVER,
                    self._ns(self.start), self._ns(end))  # fmt: skip
        attrs = root.attributes
        attrs["gen_ai.operation.name"] = op
        attrs["gen_ai.request.model"] = model
        attrs["http.response.status_code"] = status
        attrs["llmgw.request_id"] = self.rid
        if answered is not None:
            attrs["gen_ai.response.model"] = answered.model
        if tokens_in or tokens_out:
            attrs["gen_ai.usage.input_tokens"] = tokens_in
            attrs["gen_ai.usage.output_tokens"] = tokens_out
        if status >= 500:
            root.error = f"HTTP {status}"
        out = [root]
        admitted = self.admitted or end
        out.append(self._child("admission", SPAN_INTERNAL, self.start, admitted))
        if self.queue is not None:
            out.append(self._child("queue", SPAN_INTERNAL, *self.queue))
        for i, a in enumerate(self.attempts):
            span = self._child("attempt", SPAN_CLIENT, a.start, a.end or end, a.span_id)
            span.attributes.update(
                {"llmgw.endpoint": a.endpoint, "url.full": a.url, "gen_ai.request.model": a.model,
                 "llmgw.attempt": i + 1}
            )  # fmt: skip
            if a.error:
                span.error = span.attributes["error.type"] = a.error
            out.append(span)
        if answered is not None and self.first_token:
            out.append(self._child("first_token", SPAN_INTERNAL, answered.start, self.first_token))
            out.append(self._child("completion", SPAN_INTERNAL, self.first_token, end))
        return out

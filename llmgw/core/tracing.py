"""Traces as data: W3C trace context, which requests are sampled, and a request's spans.

A span is plain data (ids, name, kind, times in Unix nanoseconds, attributes); the
shells take the clock readings and the random ids, and encode spans for export
(llmgw.otlp). Sampling is OpenTelemetry's `ParentBased(TraceIdRatioBased(ratio))`: a
request whose client sent a valid `traceparent` follows the client's sampled flag (so
one trace is never half recorded), any other is sampled when its trace id's low 64
bits fall below `ratio * 2**64`, the same draw every participant would make.
Validation is W3C Trace Context's: version 00 (or a later one, read as its first four
fields), lower-case hex, neither id all zeros, version ff refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import NamedTuple

SPAN_INTERNAL = 1
SPAN_SERVER = 2
SPAN_CLIENT = 3
"""OTLP's span kinds (opentelemetry.proto.trace.v1.Span.SpanKind)."""

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16
_LOW_64 = 1 << 64
_ODD = frozenset("13579bdf")
"""The last hex digit of flags whose lowest bit, `sampled`, is set."""

Attribute = str | int | float | bool


class Parent(NamedTuple):
    """A valid incoming `traceparent`: the trace, the caller's span, its sampled flag (a
    tuple: made on every traced request, and a frozen dataclass costs several times more)."""

    trace_id: str
    span_id: str
    sampled: bool


def parse_traceparent(value: str) -> Parent | None:
    """The parent `value` names, or None when it is not one a participant may continue."""
    found = _TRACEPARENT.fullmatch(value)
    if found is None:
        return None
    version, trace_id, span_id, flags, rest = found.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return None
    if trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return None
    return Parent(trace_id, span_id, flags[1] in _ODD)


def traceparent(trace_id: str, span_id: str, sampled: bool = True) -> str:
    """The `traceparent` header naming `span_id` of `trace_id` as the callee's parent."""
    return f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}"


def ratio_sampled(trace_id: str, ratio: float) -> bool:
    """TraceIdRatioBased: whether `trace_id` (32 hex digits) is in the sampled `ratio`."""
    return draw_sampled(int(trace_id[16:], 16), ratio)


def draw_sampled(draw: int, ratio: float) -> bool:
    """`ratio_sampled` of the trace id `trace_id_of(draw)`, decided before the id is
    written out (most draws, at a low ratio, are never used)."""
    if ratio >= 1.0:
        return True
    if ratio <= 0.0:
        return False
    return ((draw % (1 << 128)) or 1) % _LOW_64 < int(ratio * _LOW_64)


def sampled(parent: Parent | None, draw: int, ratio: float, obey_parent: bool = True) -> bool:
    """ParentBased(TraceIdRatioBased(ratio)): the parent's decision, else the ratio's on
    the trace id `trace_id_of(draw)` a new trace would get (`draw_sampled`). Without
    `obey_parent`, TraceIdRatioBased(ratio) alone: the ratio's on the parent's trace id."""
    if parent is not None:
        return parent.sampled if obey_parent else ratio_sampled(parent.trace_id, ratio)
    return draw_sampled(draw, ratio)


def trace_id_of(bits: int) -> str:
    """A trace id from 128 random bits (a zero draw, which the spec forbids, becomes 1)."""
    return f"{(bits % (1 << 128)) or 1:032x}"


def span_id_of(bits: int) -> str:
    """A span id from 64 random bits (never all zeros)."""
    return f"{(bits % _LOW_64) or 1:016x}"


@dataclass(slots=True)
class Span:
    """One finished span. `error` is its status message: set, the status is ERROR."""

    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Attribute] = field(default_factory=dict)
    error: str = ""


OPERATIONS = {
    "chat": "chat",
    "responses": "chat",
    "messages": "chat",
    "completions": "text_completion",
    "embeddings": "embeddings",
}
"""`gen_ai.operation.name` (OpenTelemetry's GenAI conventions) of each request kind the
router serves; a kind not listed (tokenize, rerank, score) is named after itself."""


def operation(kind: str) -> str:
    return OPERATIONS.get(kind, kind)

"""W3C Trace Context through the router: a client's `traceparent` (and its `tracestate`)
reaches the engine unchanged, so an engine that traces (vLLM and SGLang with
`--otlp-traces-endpoint`) continues the client's trace.

A router that does not record a request's trace (no `traces` in its config, or the
request not sampled) forwards the context as a non-participating intermediary does (W3C
Trace Context, section 2.3): as received, when valid (llmgw.core.tracing) and at most
512 characters of printable ASCII (a later version's header may carry more fields, which
are forwarded, never anything the engine's request could not carry), and nothing when
not; `tracestate` only beside a valid `traceparent`, under the same bound. A request
with two `traceparent` headers has none that may be continued (the W3C test suite's
duplicated header: a new trace); several `tracestate` headers are one list, joined in
their order (HTTP's rule for a repeated list header). A router that records it names its
own attempt span as the engine's parent instead (llmgw.router.tracing). Pure.
"""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.core.tracing import parse_traceparent
from llmgw.router import headers as headers_

MAX_TRACESTATE = 512
MAX_TRACEPARENT = 512


def valid_traceparent(value: str) -> bool:
    """Whether `value` is a traceparent header a participant may continue."""
    return parse_traceparent(value) is not None


def traceparent(headers: Mapping[str, str]) -> str | None:
    """The client's `traceparent`: None without one, or with more than one."""
    value = headers.get("traceparent")
    if value is not None and len(headers_.values(headers, "traceparent")) > 1:
        return None
    return value


def tracestate(headers: Mapping[str, str]) -> str:
    """The client's `tracestate`, when one may be passed on ("" when not)."""
    state = ",".join(v for v in headers_.values(headers, "tracestate") if v)
    if state and _printable(state, MAX_TRACESTATE):
        return state
    return ""


def _printable(value: str, most: int) -> bool:
    """Whether `value` is at most `most` characters of printable ASCII: what an upstream
    request's header block carries as sent."""
    return len(value) <= most and value.isascii() and value.isprintable()


def forwarded(headers: Mapping[str, str]) -> list[tuple[str, str]]:
    """The trace-context headers to send upstream for a request with `headers`."""
    parent = traceparent(headers)
    if parent is None or not _printable(parent, MAX_TRACEPARENT) or not valid_traceparent(parent):
        return []
    out = [("traceparent", parent)]
    state = tracestate(headers)
    if state:
        out.append(("tracestate", state))
    return out

"""W3C Trace Context through the router: a client's `traceparent` (and its `tracestate`)
reaches the engine unchanged, so an engine that traces (vLLM and SGLang with
`--otlp-traces-endpoint`) continues the client's trace.

The router does not trace itself yet, so it forwards the context as a non-participating
intermediary does (W3C Trace Context, section 2.3): as received, when valid, and nothing
when not. Validation is the specification's: version 00 (or a later one, read as its first
four fields), lower-case hex, neither id all zeros, version ff refused; `tracestate` only
beside a valid `traceparent`, at most 512 characters of printable ASCII. Pure.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16
MAX_TRACESTATE = 512


def valid_traceparent(value: str) -> bool:
    """Whether `value` is a traceparent header a participant may continue."""
    found = _TRACEPARENT.fullmatch(value)
    if found is None:
        return False
    version, trace_id, parent_id, _flags, rest = found.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return False
    return trace_id != _ZERO_TRACE and parent_id != _ZERO_SPAN


def forwarded(headers: Mapping[str, str]) -> list[tuple[str, str]]:
    """The trace-context headers to send upstream for a request with `headers`."""
    parent = headers.get("traceparent")
    if parent is None or not valid_traceparent(parent):
        return []
    out = [("traceparent", parent)]
    state = headers.get("tracestate")
    if state and len(state) <= MAX_TRACESTATE and state.isascii() and state.isprintable():
        out.append(("tracestate", state))
    return out

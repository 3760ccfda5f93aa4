"""The sim's span of a request, as vLLM records it with `--otlp-traces-endpoint`.

vLLM continues the caller's W3C trace context: each finished request is one SERVER
span named `llm_request`, the child of the span its `traceparent` names (a new trace
when it has none), from the request's arrival to its end, with the latency and usage
attributes vLLM sets. The sim exports it over OTLP/HTTP (llmgw.otlp).
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping

from llmgw.core import tracing
from llmgw.core.tracing import SPAN_SERVER, Span
from llmgw.sim.engine import Request

_rng = random.Random()


def request_span(headers: Mapping[str, str], req: Request, model: str, now: float) -> Span:
    """The span of `req` (times on the loop's clock, `now` its end) for `model`."""
    value = headers.get("traceparent")
    parent = tracing.parse_traceparent(value) if value is not None else None
    trace_id = parent.trace_id if parent is not None else tracing.trace_id_of(_rng.getrandbits(128))
    offset_ns = time.time_ns() - int(now * 1e9)
    span = Span(
        trace_id,
        tracing.span_id_of(_rng.getrandbits(64)),
        parent.span_id if parent is not None else "",
        "llm_request",
        SPAN_SERVER,
        int(req.arrival * 1e9) + offset_ns,
        int(now * 1e9) + offset_ns,
    )
    a = span.attributes
    a["gen_ai.request.id"] = req.rid
    a["gen_ai.response.model"] = model
    a["gen_ai.request.max_tokens"] = req.max_tokens
    a["gen_ai.usage.prompt_tokens"] = req.num_prompt
    a["gen_ai.usage.completion_tokens"] = req.num_generated
    a["gen_ai.latency.e2e"] = now - req.arrival
    if req.first_scheduled is not None:
        a["gen_ai.latency.time_in_queue"] = req.first_scheduled - req.arrival
    if req.first_token_at is not None:
        a["gen_ai.latency.time_to_first_token"] = req.first_token_at - req.arrival
    return span

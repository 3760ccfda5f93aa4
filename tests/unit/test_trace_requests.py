"""A recorded request's trace across many requests: the sampling threshold, ids that no
two requests share, the trace in the request's log lines, the root's status and response
model, and the encoder's caches staying bounded whatever the models and endpoints."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from llmgw import logs, otlp
from llmgw.core import tracing
from llmgw.router import tracing as router_tracing
from llmgw.router.config import TracesConfig
from llmgw.router.tracing import RequestTrace, Tracer
from tests.integration.otlp_kit import Got, decode

CLIENT = f"00-{'ab' * 16}-{'cd' * 8}-01"


def test_the_ratio_samples_trace_ids_strictly_below_its_share_of_2_64() -> None:
    """TraceIdRatioBased: sampled when the id's low 64 bits are below ratio * 2**64."""
    assert tracing.ratio_sampled("f" * 16 + "7" + "f" * 15, 0.5)
    assert not tracing.ratio_sampled("0" * 16 + "8" + "0" * 15, 0.5)
    assert not tracing.draw_sampled(1 << 63, 0.5)
    assert tracing.draw_sampled((1 << 63) - 1, 0.5)


def test_a_trace_the_router_starts_has_the_id_its_sampling_drew() -> None:
    """At a ratio, the router decides on the id it then gives the trace: an engine
    sampling by the same ratio on that id records the same traces."""
    tracer = Tracer(TracesConfig(endpoint="http://c:4318", sample_ratio=0.3))
    recorded = [t for i in range(400) if (t := tracer.begin({}, f"r{i}", 1.0)) is not None]
    assert 60 < len(recorded) < 200
    assert all(tracing.ratio_sampled(t.trace_id, 0.3) for t in recorded)
    assert len({t.trace_id for t in recorded}) == len(recorded)


def _spans(t: RequestTrace, *, model: str = "m", status: int = 200) -> list[Got]:
    t.admitted = t.start + 0.001
    t.first_token = t.start + 0.05
    t.ended(t.start + 0.1, kind="chat", model=model, status=status, tokens_in=3, tokens_out=5)
    return decode(otlp.encode_fields(t.encode_spans(0), "svc"))


@pytest.mark.parametrize("client", [{}, {"traceparent": CLIENT}])
def test_no_two_requests_share_a_trace_or_span_id(client: dict[str, str]) -> None:
    """Ids come from a pool drawn for many requests at once: across pools too, each request
    takes its own (its trace's, its root's, its attempts', its children's)."""
    tracer = Tracer(TracesConfig(endpoint="http://c:4318"))
    traces, span_ids = set(), []
    for i in range(600):  # more than two pools' worth
        t = tracer.begin(client, f"r{i}", 100.0 + i)
        assert t is not None
        t.attempt_begin("e", "http://e", "m", t.start + 0.002)
        t.attempt_end("", t.start + 0.009)
        spans = _spans(t)
        assert len(spans) == 5
        traces.add(t.trace_id)
        span_ids += [s.span_id for s in spans]
    assert len(traces) == (1 if client else 600)
    assert len(set(span_ids)) == len(span_ids)


def test_a_requests_log_lines_carry_its_trace_and_root_span() -> None:
    tracer = Tracer(TracesConfig(endpoint="http://c:4318"))
    t = tracer.begin({}, "r", 1.0)
    assert t is not None
    token = router_tracing.bind_logs(t, {})
    assert token is not None
    assert logs.TRACE.get() == (t.trace_id, t.root_id)
    router_tracing.unbind_logs(token)
    assert logs.TRACE.get(None) is None


def test_an_unrecorded_request_logs_its_clients_valid_trace_id_only() -> None:
    token = router_tracing.bind_logs(None, {"traceparent": CLIENT})
    assert token is not None
    assert logs.TRACE.get() == ("ab" * 16, "")  # no span of the router's to name
    router_tracing.unbind_logs(token)
    assert logs.TRACE.get(None) is None
    for headers in ({}, {"traceparent": CLIENT.upper()}, {"traceparent": CLIENT + "x"}):
        assert router_tracing.bind_logs(None, headers) is None
        assert logs.TRACE.get(None) is None


def _retried(attempts: int, model: Callable[[int], str]) -> RequestTrace:
    """A trace of `attempts` attempts, each but the last answered 503, attempt i to `model(i)`."""
    t = RequestTrace("ab" * 16, "", "ef" * 8, "r", 100.0, "", random.Random(1))
    for i in range(attempts):
        t.attempt_begin(f"e{i}", f"http://e{i}", model(i), 100.002 + i * 0.01)
        t.attempt_end("status_503" if i < attempts - 1 else "", 100.009 + i * 0.01)
    return t


@pytest.mark.parametrize(("status", "error"), [(200, ""), (499, ""), (500, "HTTP 500"),
                                               (503, "HTTP 503")])  # fmt: skip
@pytest.mark.parametrize("attempts", [1, 2])
def test_a_server_error_marks_the_root_span_failed(status: int, error: str, attempts: int) -> None:
    t = _retried(attempts, lambda i: "m")
    root = _spans(t, status=status)[0]
    assert root.attributes["http.response.status_code"] == status
    assert root.error == error


@pytest.mark.parametrize("attempts", [1, 2])
def test_the_root_names_the_model_that_answered_beside_the_one_asked(attempts: int) -> None:
    """A request moved to a fallback model: `gen_ai.response.model` is the fallback's."""
    t = _retried(attempts, lambda i: f"fallback-{i}")
    root = _spans(t, model="asked")[0]
    assert root.name == "chat asked"
    assert root.attributes["gen_ai.request.model"] == "asked"
    assert root.attributes["gen_ai.response.model"] == f"fallback-{attempts - 1}"


def test_the_encoders_caches_stay_bounded_whatever_the_models_and_endpoints() -> None:
    """What is kept encoded is keyed by models, endpoints and statuses: a fleet of many
    of them (or a stream of distinct ones) costs re-encoding, never memory."""
    bound = otlp._CACHE_BOUND
    for i in range(bound + 200):
        t = RequestTrace("ab" * 16, "", "ef" * 8, "r" * i, 100.0, "", random.Random(i))
        t.attempt_begin(f"e{i}" + "x" * (i % 100), f"http://e{i}", f"m{i}", 100.002)
        t.attempt_end("", 100.009)
        spans = _spans(t, model=f"m{i}")
        assert spans[0].name == f"chat m{i}"  # still right once the caches are full
    caches = (router_tracing._SHAPES, router_tracing._ROOTS, router_tracing._ATTEMPTS,
              router_tracing._OK_ATTEMPTS, otlp._ATTRIBUTES, otlp._BLOCKS, otlp._NAMED,
              otlp._KEYS, otlp._PREFIXES, router_tracing._RID_PREFIXES)  # fmt: skip
    assert len(router_tracing._CHILDREN) <= 64
    assert all(len(c) <= bound for c in caches), [len(c) for c in caches]


OPERATIONS = [("chat", "chat m"), ("messages", "chat m"), ("completions", "text_completion m"),
              ("embeddings", "embeddings m"), ("rerank", "rerank m")]  # fmt: skip


@pytest.mark.parametrize(("kind", "name"), OPERATIONS)
@pytest.mark.parametrize("attempts", [1, 2])
def test_the_root_is_named_after_its_genai_operation(kind: str, name: str, attempts: int) -> None:
    t = _retried(attempts, lambda i: "m")
    t.first_token = 100.05
    t.ended(100.1, kind=kind, model="m", status=200)
    root = decode(otlp.encode_fields(t.encode_spans(0), "svc"))[0]
    assert root.name == name
    assert root.attributes["gen_ai.operation.name"] == name.split()[0]


@pytest.mark.parametrize("attempts", [1, 2])
def test_a_request_id_that_is_no_utf8_is_written_as_valid_utf8(attempts: int) -> None:
    """A lone surrogate (a client's id, from a JSON body's escape) becomes "?"."""
    t = RequestTrace("ab" * 16, "", "ef" * 8, "a\ud800b", 100.0, "", random.Random(1))
    for i in range(attempts):
        t.attempt_begin(f"e{i}", f"http://e{i}", "m", 100.002 + i * 0.01)
        t.attempt_end("status_503" if i < attempts - 1 else "", 100.009 + i * 0.01)
    assert _spans(t)[0].attributes["llmgw.request_id"] == "a?b"

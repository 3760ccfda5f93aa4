"""Traces from the client to the engine: a real router and real `llmgw sim` engines, both
exporting OTLP/HTTP to a receiver in this process, which decodes what they sent."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from llmgw.core.tracing import SPAN_CLIENT, SPAN_INTERNAL, SPAN_SERVER
from tests.integration.otlp_kit import Got, Receiver
from tests.integration.router_kit import Router, Sim

pytestmark = pytest.mark.slow

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.stop()


def _sim(receiver: Receiver, *args: str) -> Sim:
    return Sim.start("m", "--otlp-traces-endpoint", receiver.url, *args)


def _router(
    tmp: Path, receiver: Receiver, sims: dict[str, Sim | str], ratio: float, **traces: object
) -> Router:
    traces = {"endpoint": receiver.url, "sample_ratio": ratio, **traces}
    return Router.start(tmp, sims, traces=traces, max_attempts=3)


def _log(router: Router) -> list[str]:
    assert router.log_path is not None
    return router.log_path.read_text(errors="replace").splitlines()


def _one(spans: list[Got], name: str, service: str = "llmgw-router") -> Got:
    found = [s for s in spans if s.name == name and s.service == service]
    assert len(found) == 1, f"{name}: {[(s.service, s.name) for s in spans]}"
    return found[0]


def test_a_clients_request_is_one_trace_with_the_routers_spans_as_the_engines_parents(
    tmp_path: Path, receiver: Receiver, procs: list[Sim | Router]
) -> None:
    sim = _sim(receiver, "--eos-min-tokens", "12", "--eos-max-tokens", "12")
    procs.append(sim)
    router = _router(tmp_path, receiver, {"e": sim}, 1.0)
    procs.append(router)
    c = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=30)
    parent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    stream = c.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "where does this go"}],
        stream=True,
        extra_headers={"traceparent": parent, "tracestate": "vendor=abc"},
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text
    spans = receiver.wait_for(CLIENT_TRACE, router=5, sim=1)
    assert {s.trace_id for s in spans} == {CLIENT_TRACE}
    root = _one(spans, "chat m")
    assert (root.kind, root.parent_id) == (SPAN_SERVER, CLIENT_SPAN)
    attempt = _one(spans, "attempt")
    engine = _one(spans, "llm_request", "llmgw-sim")
    assert attempt.kind == SPAN_CLIENT
    assert attempt.parent_id == root.span_id
    assert engine.kind == SPAN_SERVER
    assert engine.parent_id == attempt.span_id
    children = [_one(spans, n) for n in ("admission", "first_token", "completion")]
    assert all(s.parent_id == root.span_id and s.kind == SPAN_INTERNAL for s in children)
    admission, first, completion = children
    assert root.start_ns <= admission.end_ns <= attempt.start_ns <= first.end_ns
    assert first.end_ns == completion.start_ns <= completion.end_ns <= root.end_ns
    assert attempt.start_ns <= engine.start_ns + 50_000_000  # clocks of one machine
    a = root.attributes
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == "m"
    assert a["gen_ai.response.model"] == "m"
    assert a["http.response.status_code"] == 200
    assert (
        a["gen_ai.usage.output_tokens"] == 12 == engine.attributes["gen_ai.usage.completion_tokens"]
    )
    assert a["gen_ai.usage.input_tokens"] == engine.attributes["gen_ai.usage.prompt_tokens"] > 0
    assert a["llmgw.request_id"]
    assert not root.error
    assert receiver.content_types == {"application/x-protobuf"}


def test_sampling_follows_the_clients_flag_and_otherwise_the_ratio(
    tmp_path: Path, receiver: Receiver, procs: list[Sim | Router]
) -> None:
    """At ratio 0 the router records only requests whose client sampled them; one that
    is not recorded passes the client's context on as received (or none at all)."""
    sim = _sim(receiver)
    procs.append(sim)
    router = _router(tmp_path, receiver, {"e": sim}, 0.0)
    procs.append(router)
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    unsampled = "5" * 32
    with httpx.Client(base_url=router.url, timeout=30) as h:
        for headers in ({}, {"traceparent": f"00-{unsampled}-{CLIENT_SPAN}-00"}):
            assert h.post("/v1/chat/completions", json=body, headers=headers).status_code == 200
        sampled = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
        r = h.post("/v1/chat/completions", json=body, headers={"traceparent": sampled})
        assert r.status_code == 200
    spans = receiver.wait_for(CLIENT_TRACE, router=5, sim=1)
    assert _one(spans, "chat m").parent_id == CLIENT_SPAN
    # The exporter posts in order: what the first two requests left is in by now.
    time.sleep(0.5)
    theirs = [s for s in receiver.spans if s.trace_id != CLIENT_TRACE]
    assert [s.service for s in theirs] == ["llmgw-sim", "llmgw-sim"]
    unsampled_engine = [s for s in theirs if s.trace_id == unsampled]
    assert len(unsampled_engine) == 1
    assert unsampled_engine[0].parent_id == CLIENT_SPAN


def test_without_client_sampling_a_clients_flag_records_nothing_the_ratio_would_not(
    tmp_path: Path, receiver: Receiver, procs: list[Sim | Router]
) -> None:
    """`client_sampling: false` at ratio 0: a client's sampled requests are not recorded
    by the router, and their context still reaches the engine as the client sent it."""
    sim = _sim(receiver)
    procs.append(sim)
    router = _router(tmp_path, receiver, {"e": sim}, 0.0, client_sampling=False)
    procs.append(router)
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    sampled = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    with httpx.Client(base_url=router.url, timeout=30) as h:
        for _ in range(3):
            r = h.post("/v1/chat/completions", json=body, headers={"traceparent": sampled})
            assert r.status_code == 200
    spans = receiver.wait_for(CLIENT_TRACE, router=0, sim=3)
    assert {s.service for s in spans} == {"llmgw-sim"}
    # The engine's parent is the client's span, forwarded as received: had the router
    # recorded the request, it would be the router's attempt span.
    assert {s.parent_id for s in spans} == {CLIENT_SPAN}


def test_a_retried_request_has_an_attempt_span_per_try_and_its_logs_carry_the_trace(
    tmp_path: Path, receiver: Receiver, procs: list[Sim | Router]
) -> None:
    failing = _sim(receiver, "--fail-status", "503")
    good = _sim(receiver)
    procs += [failing, good]
    models = [{"name": "m"}]
    router = Router.start(tmp_path, {"a": failing, "b": good}, models=models, max_attempts=3,
                          traces={"endpoint": receiver.url}, weights={"prefix": 0.0})  # fmt: skip
    procs.append(router)
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    with httpx.Client(base_url=router.url, timeout=30) as h:
        for i in range(8):  # until one request met the failing engine first
            trace = f"{i + 1:032x}"
            headers = {"traceparent": f"00-{trace}-{CLIENT_SPAN}-01"}
            assert h.post("/v1/chat/completions", json=body, headers=headers).status_code == 200
            spans = receiver.wait_for(trace, router=5, sim=1)
            attempts = sorted((s for s in spans if s.name == "attempt"), key=lambda s: s.start_ns)
            if len(attempts) > 1:
                break
        else:
            pytest.skip("the ranking never chose the failing engine first")
    first, last = attempts[0], attempts[-1]
    assert first.error
    assert first.attributes["error.type"] == first.error
    assert first.attributes["llmgw.endpoint"] == "a"
    assert first.attributes["llmgw.attempt"] == 1
    assert not last.error
    assert last.attributes["llmgw.endpoint"] == "b"
    engines = [s for s in spans if s.service == "llmgw-sim"]
    assert {e.parent_id for e in engines} <= {a.span_id for a in attempts}
    assert any(e.parent_id == last.span_id for e in engines)
    lines = [json.loads(x) for x in _log(router) if x.startswith("{")]
    failed = [x for x in lines if x.get("event") == "attempt_failed" and x.get("trace_id") == trace]
    assert failed
    assert failed[0]["span_id"] == _one(spans, "chat m").span_id


def test_a_collector_that_is_down_costs_spans_never_requests(
    tmp_path: Path, procs: list[Sim | Router]
) -> None:
    sim = Sim.start("m")
    procs.append(sim)
    router = Router.start(tmp_path, {"e": sim}, traces={"endpoint": "http://127.0.0.1:9"})
    procs.append(router)
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    with httpx.Client(base_url=router.url, timeout=30) as h:
        for _ in range(20):
            assert h.post("/v1/chat/completions", json=body).status_code == 200
        deadline = time.monotonic() + 30
        while "traces_not_exported" not in "\n".join(_log(router)):
            assert time.monotonic() < deadline, "the router never said its spans were dropped"
            time.sleep(0.1)
        assert h.post("/v1/chat/completions", json=body).status_code == 200
    assert router.proc.poll() is None
    assert router.log_path is not None

"""Traces: W3C trace context, sampling, a request's spans, their OTLP encoding and the
exporter's bound. The router and sim paths over real processes are in
tests/integration/test_tracing.py."""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw import otlp
from llmgw.core import tracing
from llmgw.core.tracing import SPAN_CLIENT, SPAN_INTERNAL, SPAN_SERVER, Span
from llmgw.router import config as router_config
from llmgw.router.config import RouterConfig, TracesConfig
from llmgw.router.tracing import RequestTrace, Tracer
from llmgw.sim.config import SimConfig
from tests.integration.otlp_kit import decode

hex_ids = st.integers(min_value=1, max_value=(1 << 128) - 1).map(lambda n: f"{n:032x}")
span_ids = st.integers(min_value=1, max_value=(1 << 64) - 1).map(lambda n: f"{n:016x}")


@given(hex_ids, span_ids, st.booleans())
def test_a_traceparent_names_its_trace_span_and_flag(trace: str, span: str, on: bool) -> None:
    parent = tracing.parse_traceparent(tracing.traceparent(trace, span, on))
    assert parent == tracing.Parent(trace, span, on)


@given(st.text(max_size=80))
def test_no_text_parses_to_a_parent_the_spec_refuses(value: str) -> None:
    parent = tracing.parse_traceparent(value)
    if parent is not None:
        assert value[2] == "-"
        assert value[:2] != "ff"
        assert parent.trace_id != "0" * 32
        assert parent.span_id != "0" * 16
        assert value[3:35] == parent.trace_id


@given(hex_ids, st.floats(0, 1), st.floats(0, 1))
def test_a_trace_sampled_at_one_ratio_is_sampled_at_every_higher_one(
    trace: str, a: float, b: float
) -> None:
    lo, hi = sorted((a, b))
    if tracing.ratio_sampled(trace, lo):
        assert tracing.ratio_sampled(trace, hi)
    assert tracing.ratio_sampled(trace, 1.0)
    assert not tracing.ratio_sampled(trace, 0.0)


@given(st.integers(0, (1 << 129)), st.floats(0, 1))
def test_a_draw_is_sampled_as_the_trace_id_made_of_it(draw: int, ratio: float) -> None:
    by_id = tracing.ratio_sampled(tracing.trace_id_of(draw), ratio)
    assert tracing.draw_sampled(draw, ratio) == by_id
    assert tracing.sampled(None, draw, ratio) == by_id


def test_the_ratio_samples_its_share_of_random_traces() -> None:
    rng = random.Random(3)
    ids = [tracing.trace_id_of(rng.getrandbits(128)) for _ in range(20_000)]
    for ratio in (0.01, 0.25, 0.5):
        share = sum(tracing.ratio_sampled(t, ratio) for t in ids) / len(ids)
        assert abs(share - ratio) < 0.01 + ratio * 0.1


@given(hex_ids, span_ids, st.booleans(), st.floats(0, 1))
def test_a_clients_decision_is_followed_whatever_the_ratio(
    trace: str, span: str, on: bool, ratio: float
) -> None:
    assert tracing.sampled(tracing.Parent(trace, span, on), int(trace, 16), ratio) is on


@given(hex_ids, span_ids, st.booleans(), st.floats(0, 1))
def test_without_client_sampling_the_ratio_decides_on_the_clients_trace_id(
    trace: str, span: str, on: bool, ratio: float
) -> None:
    parent = tracing.Parent(trace, span, on)
    assert tracing.sampled(parent, 0, ratio, obey_parent=False) is tracing.ratio_sampled(
        trace, ratio
    )
    tracer = Tracer(TracesConfig(endpoint="http://c:4318", sample_ratio=ratio,
                                 client_sampling=False))  # fmt: skip
    got = tracer.begin({"traceparent": f"00-{trace}-{span}-{'01' if on else '00'}"}, "r", 0.0)
    assert (got is not None) is tracing.ratio_sampled(trace, ratio)
    if got is not None:
        assert (got.trace_id, got.parent_id) == (trace, span)  # still the client's trace


def test_ids_are_never_all_zeros() -> None:
    assert tracing.trace_id_of(0) != "0" * 32
    assert tracing.span_id_of(1 << 64) != "0" * 16


def _trace(
    attempts: list[tuple[float, float, str]], first_token: float, queued: bool = True
) -> RequestTrace:
    t = RequestTrace("ab" * 16, "cd" * 8, "ef" * 8, "rid-1", 100.0, "", random.Random(1))
    t.admitted = 100.001
    if queued:
        t.queue = (100.001, 100.002)
    for i, (start, end, error) in enumerate(attempts):
        t.attempt_begin(f"e{i}", f"http://e{i}", "m", start)
        t.attempt_end(error, end)
    t.first_token = first_token
    return t


attempt_lists = st.lists(st.sampled_from(["", "status_503", "connect"]), min_size=0, max_size=4)


@given(attempt_lists, st.integers(0, 500), st.integers(0, 500), st.booleans(), st.booleans())
def test_every_span_is_in_the_trace_under_its_root_and_inside_it(
    errors: list[str], tokens_in: int, tokens_out: int, first_token: bool, queued: bool
) -> None:
    """Whatever the request's shape (one answered attempt without a queue has a path of
    its own in the encoder)."""
    attempts = [(100.002 + i * 0.01, 100.009 + i * 0.01, e) for i, e in enumerate(errors)]
    t = _trace(attempts, 100.05 if first_token else 0.0, queued)
    count = t.ended(100.1, kind="chat", model="m", status=200, tokens_in=tokens_in,
                    tokens_out=tokens_out)  # fmt: skip
    offset = 1_700_000_000 * 10**9
    spans = decode(otlp.encode_fields(t.encode_spans(offset), "svc"))  # the official decoder
    assert len(spans) == count
    (root,) = [s for s in spans if s.kind == SPAN_SERVER]
    assert spans[0] is root
    assert root.name == "chat m"
    assert root.attributes["llmgw.request_id"] == "rid-1"
    assert root.attributes["http.response.status_code"] == 200
    assert (root.start_ns, root.end_ns) == (100 * 10**9 + offset, 100_100_000_000 + offset)
    assert (root.kind, root.parent_id, root.span_id) == (SPAN_SERVER, "cd" * 8, "ef" * 8)
    assert len({s.span_id for s in spans}) == len(spans)
    for s in spans[1:]:
        assert s.trace_id == root.trace_id
        assert s.parent_id == root.span_id
        assert root.start_ns <= s.start_ns <= s.end_ns <= root.end_ns
    tried = [s for s in spans if s.name == "attempt"]
    assert [s.kind for s in tried] == [SPAN_CLIENT] * len(errors)
    assert [s.error for s in tried] == errors
    assert [s.span_id for s in tried] == [a.span_id for a in t.attempts]
    assert [s.attributes["llmgw.attempt"] for s in tried] == list(range(1, len(errors) + 1))
    assert [s.attributes.get("error.type", "") for s in tried] == errors
    answered = "" in errors
    assert ("gen_ai.response.model" in root.attributes) is answered
    assert any(s.name == "first_token" for s in spans) is (answered and first_token)
    assert any(s.name == "completion" for s in spans) is (answered and first_token)
    (admission,) = [s for s in spans if s.name == "admission"]
    assert (admission.start_ns, admission.end_ns) == (root.start_ns, 100_001_000_000 + offset)
    if answered and first_token:  # from the answering attempt's send to the first token
        last_ok = [a for a in t.attempts if not a.error][-1]
        (first,) = [s for s in spans if s.name == "first_token"]
        (rest,) = [s for s in spans if s.name == "completion"]
        assert first.start_ns == int(last_ok.start * 1e9) + offset
        assert (first.end_ns, rest.start_ns) == (100_050_000_000 + offset,) * 2
        assert rest.end_ns == root.end_ns
    if tokens_in or tokens_out:
        assert root.attributes["gen_ai.usage.output_tokens"] == tokens_out


@pytest.mark.parametrize("rid", ["", "r", "é" * 40, "x" * 300, "y" * 20_000])
@pytest.mark.parametrize("tokens", [(0, 0), (3, 5), (3, 300), (200, 1), (127, 128), (128, 127)])
@pytest.mark.parametrize("parent", ["", "cd" * 8, "cd" * 4])
def test_a_one_attempt_request_encodes_whatever_its_ids_length_and_counts(
    rid: str, tokens: tuple[int, int], parent: str
) -> None:
    """The common shape's own path (one answered attempt, no queue): request ids of any
    length (the longest take the general path), token counts of one and two bytes, a
    root with and without a client's parent, an error status."""
    t = _trace([(100.002, 100.009, "")], 100.05, queued=False)
    t.rid, t.parent_id = rid, parent
    t.ended(100.1, kind="chat", model="m", status=503, tokens_in=tokens[0], tokens_out=tokens[1])
    spans = decode(otlp.encode_fields(t.encode_spans(0), "svc"))
    root = spans[0]
    assert (root.name, root.parent_id, root.error) == ("chat m", parent, "HTTP 503")
    assert root.attributes["llmgw.request_id"] == rid
    if tokens != (0, 0):
        got = (root.attributes["gen_ai.usage.input_tokens"],
               root.attributes["gen_ai.usage.output_tokens"])  # fmt: skip
        assert got == tokens
    assert sorted(s.name for s in spans[1:]) == ["admission", "attempt", "completion",
                                                  "first_token"]  # fmt: skip
    assert all(s.parent_id == root.span_id and s.trace_id == "ab" * 16 for s in spans[1:])
    (attempt,) = [s for s in spans if s.name == "attempt"]
    assert attempt.span_id == t.attempts[0].span_id
    assert (attempt.start_ns, attempt.end_ns) == (100_002_000_000, 100_009_000_000)
    (admission,) = [s for s in spans if s.name == "admission"]
    assert (admission.start_ns, admission.end_ns) == (100_000_000_000, 100_001_000_000)


@settings(max_examples=60)
@given(st.sampled_from(["router", "ratio", "client"]), attempt_lists, st.booleans(),
       st.integers(0, 2**32))  # fmt: skip
def test_a_begun_traces_spans_carry_the_ids_its_attempts_sent(
    who: str, errors: list[str], queued: bool, seed: int
) -> None:
    """A trace the tracer begins draws its ids at once (the trace's, the root's, the first
    attempt's, the children's): whatever the request's shape, its spans are one trace
    under the root it logged, each attempt's span is the parent the engine was sent, and
    no id is repeated or all zeros."""
    ratio = 0.5 if who == "ratio" else 1.0
    tracer = Tracer(TracesConfig(endpoint="http://c:4318", sample_ratio=ratio))
    tracer._rng = random.Random(seed)
    client = {"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-01"} if who == "client" else {}
    t = tracer.begin(client, "rid-1", 100.0)
    if t is None:
        assert who == "ratio"
        return
    assert tracing.ratio_sampled(t.trace_id, ratio)
    t.admitted = 100.001
    if queued:
        t.queue = (100.001, 100.002)
    sent = []
    for i, error in enumerate(errors):
        t.attempt_begin(f"e{i}", f"http://e{i}", "m", 100.002 + i * 0.01)
        sent.append(dict(t.headers())["traceparent"])
        t.attempt_end(error, 100.009 + i * 0.01)
    t.first_token = 100.05
    count = t.ended(100.1, kind="chat", model="m", status=200, tokens_in=3, tokens_out=5)
    spans = decode(otlp.encode_fields(t.encode_spans(0), "svc"))
    assert len(spans) == count
    root = spans[0]
    assert (root.trace_id, root.span_id) == (t.trace_id, t.root_id)
    assert root.parent_id == ("cd" * 8 if who == "client" else "")
    assert t.trace_id == "ab" * 16 if who == "client" else t.trace_id != "ab" * 16
    assert all(s.trace_id == t.trace_id for s in spans)
    assert all(s.parent_id == t.root_id for s in spans[1:])
    ids = [s.span_id for s in spans]
    assert len(set(ids)) == len(ids)
    assert "0" * 16 not in ids
    tried = [s.span_id for s in spans if s.name == "attempt"]
    assert [tracing.parse_traceparent(header) for header in sent] == [
        tracing.Parent(t.trace_id, span, True) for span in tried
    ]


class _Zeros(random.Random):
    """Draws that are all zeros: the one draw in 2**64 the spec's ids must survive."""

    def randbytes(self, n: int) -> bytes:
        return bytes(n)

    def getrandbits(self, k: int) -> int:
        return 0


@pytest.mark.parametrize(
    ("ratio", "client"),
    [(1.0, {}), (0.5, {}), (0.0, {"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-01"})],
)
def test_a_draw_of_zeros_still_gives_ids_the_spec_allows(
    ratio: float, client: dict[str, str]
) -> None:
    tracer = Tracer(TracesConfig(endpoint="http://c:4318", sample_ratio=ratio))
    tracer._rng = _Zeros()
    t = tracer.begin(client, "r", 1.0)
    assert t is not None
    t.attempt_begin("e", "http://e", "m", 1.0)
    t.attempt_end("connect", 1.1)
    t.attempt_begin("f", "http://f", "m", 1.1)  # a retry's span id: drawn as it is sent
    t.attempt_end("", 1.5)
    t.first_token = 1.2
    t.ended(2.0, kind="chat", model="m", status=200)
    spans = decode(otlp.encode_fields(t.encode_spans(0), "svc"))
    assert t.trace_id != "0" * 32
    assert "0" * 16 not in [s.span_id for s in spans] + [t.root_id]
    assert dict(t.headers())["traceparent"] == f"00-{t.trace_id}-{t.attempts[1].span_id}-01"


def test_an_attempts_headers_name_its_own_span_and_keep_the_clients_state() -> None:
    t = RequestTrace("ab" * 16, "cd" * 8, "ef" * 8, "r", 1.0, "vendor=x", random.Random(2))
    t.attempt_begin("e", "http://e", "m", 1.0)
    parent, state = t.headers()
    assert parent == ("traceparent", f"00-{'ab' * 16}-{t.attempts[0].span_id}-01")
    assert state == ("tracestate", "vendor=x")


attributes = st.dictionaries(
    st.text(min_size=1, max_size=20),
    st.one_of(
        st.text(max_size=30),
        st.integers(-(2**63), 2**63 - 1),
        st.booleans(),
        st.floats(allow_nan=False),
    ),
    max_size=6,
)


@settings(max_examples=50)
@given(
    st.lists(
        st.tuples(
            hex_ids,
            span_ids,
            st.one_of(st.just(""), span_ids),
            st.sampled_from([SPAN_INTERNAL, SPAN_SERVER, SPAN_CLIENT]),
            st.integers(0, 2**64 - 6),
            attributes,
            st.text(max_size=20),
        ),
        max_size=5,
    )
)
def test_spans_survive_otlps_encoding(
    items: list[tuple[str, str, str, int, int, dict, str]],
) -> None:  # type: ignore[type-arg]
    spans = [
        Span(t, s, parent, f"n{i}", kind, at, at + 5, dict(a), err)
        for i, (t, s, parent, kind, at, a, err) in enumerate(items)
    ]
    got = decode(otlp.encode(spans, "svc"))
    fields = [
        (g.trace_id, g.span_id, g.parent_id, g.kind, g.name, g.start_ns, g.end_ns, g.error)
        for g in got
    ]
    assert fields == [
        (s.trace_id, s.span_id, s.parent_id, s.kind, s.name, s.start_ns, s.end_ns, s.error)
        for s in spans
    ]
    assert [g.attributes for g in got] == [s.attributes for s in spans]
    typed = [{k: type(v) for k, v in g.attributes.items()} for g in got]
    assert typed == [{k: type(v) for k, v in s.attributes.items()} for s in spans]  # True, 1
    assert {g.service for g in got} <= {"svc"}


@given(attributes)
def test_attributes_kept_encoded_read_as_those_encoded_afresh(attrs: dict) -> None:  # type: ignore[type-arg]
    """The cache of repeated attributes never gives one value's encoding for another's
    (True, 1 and 1.0 are equal keys in Python)."""
    for k, v in attrs.items():
        for value in (v, True, 1, 1.0):
            assert otlp.repeated_attribute(k, value) == otlp.attribute(k, value)
            block = otlp.repeated_attributes((("n", 2), (k, value)))
            assert block == otlp.attribute("n", 2) + otlp.attribute(k, value)


@given(st.text(min_size=1, max_size=20), st.text(max_size=300), st.integers(-(2**63), 2**63 - 1))
def test_per_span_attributes_read_as_those_encoded_afresh(key: str, text: str, n: int) -> None:
    """A request id or a token count is written after a prefix kept per length: the same
    bytes as the attribute encoded whole, whatever its length (twice: kept, then reused)."""
    for _ in range(2):
        assert otlp.string_attribute(key, text) == otlp.attribute(key, text)
        assert otlp.int_attribute(key, n) == otlp.attribute(key, n)


async def test_the_exporter_holds_at_most_its_bound_and_a_dead_collector_costs_spans() -> None:
    ex = otlp.Exporter("http://127.0.0.1:9", "svc", max_spans=10, batch=4, timeout_s=2)
    span = Span("ab" * 16, "cd" * 8, "", "x", SPAN_SERVER, 0, 1)
    for _ in range(25):
        ex.add([span])
    ex.add([span, span])  # a request's spans go in whole or not at all
    assert ex.buffered == len(ex.buffer) == 10
    assert ex.dropped == 17
    await ex.flush()  # connection refused: the batch is dropped, nothing raises
    assert ex.exported == 0
    assert ex.dropped == 21
    assert ex.buffered == len(ex.buffer) == 6
    await asyncio.wait_for(ex.close(), 10)


class _Broken:
    def encode_spans(self, offset_ns: int) -> bytes:
        raise ValueError("a bug")


async def test_spans_that_fail_to_encode_are_dropped_and_the_rest_still_go() -> None:
    from tests.integration.otlp_kit import Receiver

    receiver = Receiver()
    try:
        ex = otlp.Exporter(receiver.url, "svc", timeout_s=5)
        ex.put(_Broken(), 3)
        ex.add([Span("ab" * 16, "cd" * 8, "", "fine", SPAN_SERVER, 0, 1)])
        await ex.flush()
        assert (ex.dropped, ex.exported, ex.buffered) == (3, 1, 0)
        assert [s.name for s in receiver.spans] == ["fine"]
        await asyncio.wait_for(ex.close(), 10)
    finally:
        receiver.stop()


def test_the_tracer_records_only_what_it_samples() -> None:
    never = Tracer(TracesConfig(endpoint="http://c:4318", sample_ratio=0.0))
    always = Tracer(TracesConfig(endpoint="http://c:4318"))
    sampled = {"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-01", "tracestate": "v=1"}
    assert never.begin({}, "r", 0.0) is None
    assert never.begin({"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-00"}, "r", 0.0) is None
    t = never.begin(sampled, "r", 0.0)
    assert t is not None
    assert (t.trace_id, t.parent_id, t.tracestate) == ("ab" * 16, "cd" * 8, "v=1")
    fresh = always.begin({"traceparent": "garbage", "tracestate": "v=1"}, "r", 0.0)
    assert fresh is not None
    assert fresh.parent_id == ""
    assert fresh.tracestate == ""  # a state without a valid parent is not passed on
    assert fresh.trace_id != "ab" * 16


@pytest.mark.parametrize(
    ("traces", "says"),
    [
        ({"endpoint": "collector:4317"}, "OTLP/HTTP"),
        ({"endpoint": "grpc://collector:4317"}, "OTLP/HTTP"),
        ({"endpoint": "http://"}, "OTLP/HTTP"),
        ({"endpoint": "https:///"}, "OTLP/HTTP"),
        ({"endpoint": "http://c:4318", "sample_ratio": 1.5}, "sample_ratio"),
        ({"endpoint": "http://c:4318", "service_name": ""}, "service_name"),
    ],
)
def test_a_bad_traces_section_says_what_to_change(traces: dict, says: str) -> None:  # type: ignore[type-arg]
    cfg = msgspec.convert({"traces": traces, "auth": {"allow_anonymous": True}}, RouterConfig)
    problems = router_config.validate(cfg)
    assert len(problems) == 1
    assert says in problems[0]


@pytest.mark.parametrize("endpoint", ["grpc://user:s3cret-pw@collector:4317", "user:s3cret-pw@c"])
def test_a_bad_traces_endpoint_is_quoted_without_its_password(endpoint: str) -> None:
    """Before: the problem quoted the endpoint whole, password and all, to the terminal
    and the log of whoever started the router (or the sim)."""
    cfg = msgspec.convert({"traces": {"endpoint": endpoint}, "auth": {"allow_anonymous": True}},
                          RouterConfig)  # fmt: skip
    for problems in (
        router_config.validate(cfg),
        SimConfig(otlp_traces_endpoint=endpoint).problems(),
    ):
        (problem,) = problems
        assert "s3cret-pw" not in problem
        assert "user:***@" in problem
        assert "OTLP/HTTP" in problem


async def test_a_collectors_password_stays_out_of_the_log() -> None:
    """aiohttp sends a URL's userinfo to the collector as Basic auth; the line that says
    the collector failed names it without the password."""
    ex = otlp.Exporter("http://user:s3cret-pw@127.0.0.1:9", "svc", timeout_s=2)
    ex._said_at = float("-inf")  # said once a minute: whatever the clock, now
    ex.add([Span("ab" * 16, "cd" * 8, "", "x", SPAN_SERVER, 0, 1)])
    with structlog.testing.capture_logs() as logged:
        await ex.flush()  # connection refused
    await asyncio.wait_for(ex.close(), 10)
    (said,) = [e for e in logged if e["event"] == "traces_not_exported"]
    assert said["url"] == "http://user:***@127.0.0.1:9/v1/traces"
    assert "s3cret-pw" not in repr(logged)


def test_an_attempts_span_names_its_engine_without_a_password() -> None:
    t = RequestTrace("ab" * 16, "cd" * 8, "", "rid-1", 100.0, "", random.Random(1))
    t.attempt_begin("e", "http://user:s3cret-pw@engine:8000", "m", 100.001)
    t.attempt_end("", 100.002)
    t.ended(100.1, kind="chat", model="m", status=200, tokens_in=0, tokens_out=0)
    spans = decode(otlp.encode_fields(t.encode_spans(0), "svc"))
    (attempt,) = [s for s in spans if s.name == "attempt"]
    assert attempt.attributes["url.full"] == "http://user:***@engine:8000"


def test_traces_urls_are_the_sdks() -> None:
    assert otlp.traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert otlp.traces_url("http://c:4318/v1/traces/") == "http://c:4318/v1/traces"


def test_a_lone_surrogate_from_a_json_body_still_encodes_as_valid_utf8() -> None:
    span = Span("ab" * 16, "cd" * 8, "", "chat \ud800m", SPAN_SERVER, 0, 1, {"k": "é\udfff"})
    (got,) = decode(otlp.encode([span], "svc"))  # the official decoder refuses bad UTF-8
    assert got.name == "chat ?m"
    assert got.attributes == {"k": "é?"}


def test_an_id_of_the_wrong_size_is_framed_as_it_is_not_misframed() -> None:
    """Ids are fixed-size in OTLP; a malformed one must not corrupt the spans after it."""
    odd = Span("abcd", "cd" * 8, "ef", "odd", SPAN_SERVER, 0, 1)
    good = Span("ab" * 16, "cd" * 8, "", "good", SPAN_SERVER, 0, 1, {"k": 1})
    got = decode(otlp.encode([odd, good], "svc"))
    assert [(g.trace_id, g.parent_id, g.name) for g in got] == [
        ("abcd", "ef", "odd"),
        ("ab" * 16, "", "good"),
    ]
    assert got[1].attributes == {"k": 1}

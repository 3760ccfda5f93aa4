"""W3C Trace Context validation at the router (llmgw.router.tracecontext), by property."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict

from llmgw.router import tracecontext
from llmgw.router import tracing as router_tracing
from llmgw.router.config import TracesConfig
from llmgw.router.tracing import Tracer

hexes = st.text(alphabet="0123456789abcdef", min_size=1, max_size=40)


def hex_of(n: int) -> st.SearchStrategy[str]:
    return st.text(alphabet="0123456789abcdef", min_size=n, max_size=n)


@given(hex_of(32), hex_of(16), hex_of(2))
def test_a_well_formed_version_00_header_is_valid_unless_an_id_is_zero(
    trace: str, span: str, flags: str
) -> None:
    value = f"00-{trace}-{span}-{flags}"
    expected = trace != "0" * 32 and span != "0" * 16
    assert tracecontext.valid_traceparent(value) is expected
    assert tracecontext.valid_traceparent(value.upper()) is (value == value.upper() and expected)
    assert not tracecontext.valid_traceparent(value + "-extra")  # version 00 has four fields
    assert not tracecontext.valid_traceparent("ff" + value[2:])


later_versions = st.builds(
    lambda v, t, s, f, rest: f"{v}-{t}-{s}-{f}-{rest}",
    st.sampled_from(["01", "02", "fe"]),
    hex_of(32),
    hex_of(16),
    hex_of(2),
    st.text(max_size=600),
)


@given(st.text(max_size=80) | later_versions, st.text(max_size=600))
def test_what_is_forwarded_is_only_ever_valid_and_printable(parent: str, state: str) -> None:
    out = dict(tracecontext.forwarded({"traceparent": parent, "tracestate": state}))
    if out:
        assert tracecontext.valid_traceparent(out["traceparent"])
        assert out["traceparent"] == parent
    for value in out.values():
        assert value.isascii()
        assert value.isprintable()
        value.encode("latin-1")  # as the upstream request's header block is written
        assert len(value) <= tracecontext.MAX_TRACESTATE
    if "tracestate" in out:
        assert out["tracestate"] == state


def test_a_later_versions_extra_fields_are_forwarded_only_as_printable_ascii() -> None:
    base = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert tracecontext.forwarded({"traceparent": base + "-more"}) == [
        ("traceparent", base + "-more")
    ]
    for tail in ("-€", "-\udcff", "-\x7f", "-" + "x" * 600):
        assert tracecontext.forwarded({"traceparent": base + tail}) == [], tail


def test_no_traceparent_means_no_tracestate() -> None:
    assert tracecontext.forwarded({"tracestate": "a=1"}) == []
    assert tracecontext.forwarded({}) == []


PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_a_valid_parents_tracestate_goes_with_it_up_to_its_bound() -> None:
    assert tracecontext.forwarded({"traceparent": PARENT, "tracestate": "v=1,w=2"}) == [
        ("traceparent", PARENT),
        ("tracestate", "v=1,w=2"),
    ]
    longest = "v=" + "x" * (tracecontext.MAX_TRACESTATE - 2)
    assert tracecontext.MAX_TRACESTATE == 512  # W3C Trace Context: at least 512 kept
    assert dict(tracecontext.forwarded({"traceparent": PARENT, "tracestate": longest})) == {
        "traceparent": PARENT,
        "tracestate": longest,
    }
    assert tracecontext.forwarded({"traceparent": PARENT, "tracestate": longest + "x"}) == [
        ("traceparent", PARENT)
    ]


def test_a_later_versions_header_is_forwarded_up_to_its_bound_exactly() -> None:
    later = "01" + PARENT[2:] + "-"
    longest = later + "x" * (tracecontext.MAX_TRACEPARENT - len(later))
    assert len(longest) == tracecontext.MAX_TRACEPARENT
    assert tracecontext.forwarded({"traceparent": longest}) == [("traceparent", longest)]
    assert tracecontext.forwarded({"traceparent": longest + "x"}) == []


@given(hex_of(32), hex_of(16), hex_of(2), st.sampled_from(["00", "01", "cc"]),
       st.text(min_size=1, max_size=20).filter(lambda t: not t.startswith("-")))  # fmt: skip
def test_a_header_with_anything_after_its_flags_but_a_field_is_refused(
    trace: str, span: str, flags: str, version: str, tail: str
) -> None:
    """After the flags comes the end of the header or, in a later version, `-` and more
    fields: anything else (a character, a line break) is not a traceparent."""
    value = f"{version}-{trace}-{span}-{flags}{tail}"
    assert not tracecontext.valid_traceparent(value)
    assert tracecontext.forwarded({"traceparent": value, "tracestate": "v=1"}) == []


def test_a_request_with_two_traceparents_has_no_parent_to_continue() -> None:
    """W3C Trace Context's test suite (duplicated traceparent): neither is forwarded nor
    continued, nor its trace id logged; the router's own trace starts afresh."""
    other = "00-" + "12" * 16 + "-" + "34" * 8 + "-01"
    headers = CIMultiDict([("traceparent", PARENT), ("traceparent", other),
                           ("tracestate", "v=1")])  # fmt: skip
    assert tracecontext.forwarded(headers) == []
    assert router_tracing.bind_logs(None, headers) is None
    t = Tracer(TracesConfig(endpoint="http://c:4318")).begin(headers, "r", 1.0)
    assert t is not None
    assert (t.parent_id, t.tracestate) == ("", "")
    assert t.trace_id not in (PARENT[3:35], other[3:35])
    assert (
        Tracer(TracesConfig(endpoint="http://c:4318", sample_ratio=0.0)).begin(headers, "r", 1.0)
        is None
    )  # no client's sampled flag to follow


def test_several_tracestate_headers_are_one_list_in_their_order() -> None:
    headers = CIMultiDict([("traceparent", PARENT), ("tracestate", "a=1,b=2"),
                           ("tracestate", "c=3")])  # fmt: skip
    assert tracecontext.forwarded(headers) == [("traceparent", PARENT),
                                               ("tracestate", "a=1,b=2,c=3")]  # fmt: skip
    t = Tracer(TracesConfig(endpoint="http://c:4318")).begin(headers, "r", 1.0)
    assert t is not None
    assert t.tracestate == "a=1,b=2,c=3"
    long = CIMultiDict([("traceparent", PARENT), ("tracestate", "a=" + "x" * 300),
                        ("tracestate", "b=" + "y" * 300)])  # fmt: skip
    assert tracecontext.forwarded(long) == [("traceparent", PARENT)]  # over the bound joined

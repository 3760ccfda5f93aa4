"""The per-message TTL rule: only heartbeats expire, and within an hour."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llmgw.core import retention, subjects

names = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,20}", fullmatch=True)


def test_parse_ttl_reads_what_nats_accepts() -> None:
    assert retention.parse_ttl("60") == 60
    assert retention.parse_ttl("60s") == 60
    assert retention.parse_ttl("1h30m") == 5400
    assert retention.parse_ttl("1500ms") == 1.5
    assert retention.parse_ttl("never") == float("inf")
    assert retention.parse_ttl("NEVER") == float("inf")
    for bad in ("", "s", "-5s", "5 s", "1d", "5x", "abc", "1h-2m", "²", "٣s", "1h²"):
        assert retention.parse_ttl(bad) is None, bad


@given(value=st.text(max_size=12) | st.from_regex(r"[0-9²٣.]{1,4}(ns|us|µs|ms|s|m|h)?"))
def test_parse_ttl_never_raises_on_what_a_writer_sends(value: str) -> None:
    found = retention.parse_ttl(value)
    assert found is None or found >= 0


@given(node=names, seconds=st.integers(1, int(retention.MAX_HEARTBEAT_TTL_S)))
def test_a_heartbeat_may_expire_within_the_bound(node: str, seconds: int) -> None:
    subject = subjects.node_event(node, "heartbeat")
    assert retention.ttl_problem(subject, f"{seconds}s") is None
    assert retention.ttl_problem(subject, str(seconds)) is None


@given(node=names, ttl=st.sampled_from(["never", "3601s", "2h", "0", "0s", "bogus"]) | st.none())
def test_a_heartbeat_that_would_stay_is_refused(node: str, ttl: str | None) -> None:
    problem = retention.ttl_problem(subjects.node_event(node, "heartbeat"), ttl)
    assert problem is not None
    assert "heartbeat" in problem


@given(
    subject=st.sampled_from(
        [
            subjects.node_event("n1", "shard"),
            subjects.node_event("n1", "registered"),
            subjects.command("n1"),
            subjects.control_event("replica_placed"),
            subjects.operator_event("alice", "node_cordoned"),
        ]
    ),
    ttl=st.sampled_from(["1s", "60", "never"]),
)
def test_nothing_but_a_heartbeat_may_expire(subject: str, ttl: str) -> None:
    assert retention.ttl_problem(subject, None) is None
    problem = retention.ttl_problem(subject, ttl)
    assert problem is not None
    assert "only heartbeats" in problem

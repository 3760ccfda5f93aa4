"""Circuit breaker transitions (llmgw.core.breaker)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llmgw.core import breaker
from llmgw.core.breaker import BreakerPolicy

P = BreakerPolicy(failures_to_open=3, open_s=10.0)


def test_consecutive_failures_open_and_a_success_resets_the_count() -> None:
    b = breaker.CLOSED
    b = breaker.on_failure(b, P, 1.0)
    b = breaker.on_failure(b, P, 2.0)
    b = breaker.on_success(b)
    assert b.state == "closed"
    assert b.failures == 0
    for t in (3.0, 4.0, 5.0):
        b = breaker.on_failure(b, P, t)
    assert b.state == "open"
    assert b.opened_at == 5.0
    assert not breaker.allows(b, P, 14.9)


def test_half_open_probe_closes_or_reopens() -> None:
    b = breaker.Breaker(state="open", opened_at=0.0)
    assert breaker.allows(b, P, 10.0)
    probe = breaker.on_attempt(b, P, 10.0)
    assert probe.state == "half_open"
    assert not breaker.allows(probe, P, 10.0)
    assert breaker.on_success(probe).state == "closed"
    again = breaker.on_failure(probe, P, 11.0)
    assert again.state == "open"
    assert again.opened_at == 11.0
    assert not breaker.allows(again, P, 20.0)
    assert breaker.allows(again, P, 21.0)


def test_an_abandoned_probe_frees_the_slot() -> None:
    probe = breaker.on_attempt(breaker.Breaker(state="open", opened_at=0.0), P, 10.0)
    assert breaker.allows(breaker.on_abandon(probe), P, 10.0)
    # The request the slot then goes to is the one probe: everyone else waits for it.
    again = breaker.on_attempt(breaker.on_abandon(probe), P, 12.0)
    assert (again.state, again.probing) == ("half_open", True)
    assert not breaker.allows(again, P, 12.0)


def test_an_open_breaker_stays_open_until_its_probe() -> None:
    """A request sent before the breaker opened fails after: the cool-down runs on (it
    does not close the breaker, nor start counting again); an attempt during the
    cool-down (the planner never makes one) takes no probe slot."""
    b = breaker.Breaker(state="open", opened_at=5.0)
    assert breaker.on_failure(b, P, 7.0) == b
    assert breaker.on_attempt(b, P, 7.0) == b
    assert not breaker.allows(b, P, 14.9)


@given(st.lists(st.tuples(st.sampled_from(["attempt", "ok", "fail", "abandon"]), st.floats(0, 5))))
def test_the_breaker_only_ever_lets_one_probe_through(steps: list[tuple[str, float]]) -> None:
    b, now = breaker.CLOSED, 0.0
    for kind, dt in steps:
        now += dt
        was = b.state
        if kind == "attempt":
            if b.state == "half_open" and b.probing:
                assert not breaker.allows(b, P, now)
            if breaker.allows(b, P, now):
                b = breaker.on_attempt(b, P, now)
        elif kind == "ok":
            b = breaker.on_success(b)
        elif kind == "fail":
            b = breaker.on_failure(b, P, now)
        else:
            b = breaker.on_abandon(b)
        assert b.state in ("closed", "open", "half_open")
        assert b.failures < P.failures_to_open
        if was != "closed" and kind != "ok":
            assert b.state != "closed"  # only a success closes an open breaker

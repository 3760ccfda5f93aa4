"""The simulated engine's fault plan (llmgw.sim.faultplan): a plan hits exactly `count`
requests (or every one) and then clears itself, `GET /sim/faults` says what is left, and
a plan `/sim/faults` refuses leaves the one before in place."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.sim.config import Faults
from llmgw.sim.faultplan import FaultPlan, InvalidPlan


@given(st.integers(1, 20), st.integers(0, 30))
def test_a_counted_plan_hits_exactly_count_requests(count: int, extra: int) -> None:
    plan = FaultPlan(Faults())
    plan.set(json.dumps({"fail_status": 503, "count": count}).encode())
    hits = [plan.take() for _ in range(count + extra)]
    assert [f.fail_status if f else None for f in hits[:count]] == [503] * count
    assert hits[count:] == [None] * extra
    shown = json.loads(plan.json())
    assert shown["active"] is False  # cleared once the last counted request took it
    assert shown["count"] is None
    assert shown["fail_status"] is None


def test_what_is_left_of_a_plan_is_shown() -> None:
    plan = FaultPlan(Faults(stall_at="first_token", stall_s=2.0, count=3))
    assert plan.take() is not None
    shown = json.loads(plan.json())
    assert (shown["count"], shown["active"], shown["stall_at"]) == (2, True, "first_token")
    plan.set(b'{"die_mid_stream": true}')  # no count: every request
    for _ in range(50):
        f = plan.take()
        assert f is not None
        assert f.die_mid_stream
    assert json.loads(plan.json())["count"] is None
    plan.set(b"")  # empty: no faults
    assert plan.take() is None
    assert json.loads(plan.json())["active"] is False


def test_a_plan_without_a_fault_hits_nothing() -> None:
    plan = FaultPlan(Faults(count=2, after_tokens=3))
    assert [plan.take() for _ in range(3)] == [None, None, None]


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (b'{"fail_status": 200}', "fail_status"),
        (b'{"fail_status": 503, "count": 0}', "count"),
        (b'{"stall_at": "first_token", "stall_s": -1}', "stall_s"),
        (b'{"die_mid_stream": true, "after_tokens": -2}', "after_tokens"),
        (b'{"fail_status": 503, "bogus": 1}', "bogus"),
        (b"{not json", "JSON"),
    ],
)
def test_a_refused_plan_says_why_and_leaves_the_one_before(body: bytes, said: str) -> None:
    plan = FaultPlan(Faults(fail_status=500, count=2))
    with pytest.raises(InvalidPlan, match=said):
        plan.set(body)
    f = plan.take()
    assert f is not None
    assert f.fail_status == 500
    assert json.loads(plan.json())["count"] == 1

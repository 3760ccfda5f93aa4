"""What a key's token limits tell a client: the 400 of a maximum no limit admits names the
field the client sent it in, on every API, and the 429 of a spent budget names when the
budget renews (the next day, or the next month, at 00:00 UTC) with a Retry-After that
agrees, and what of it this router still holds when the fleet overspent it."""

from __future__ import annotations

import asyncio
import datetime
import math
from typing import Any

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from llmgw.core import tenancy
from llmgw.router import admission, requests
from llmgw.router.errors import Refusal
from llmgw.router.quotas import Held, Quotas
from tests.unit.test_quotas import Store, key

CAPS = st.none() | st.integers(0, 3) | st.integers(0, 10**7)
WALLS = st.floats(0, 4_000_000_000, allow_nan=False)
"""UNIX times from 1970 into the 2090s."""


def body(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


def named(doc: dict[str, Any], parsed: requests.Parsed) -> None:
    """The field a refusal names holds the maximum the hold covers, when the body sent one."""
    if parsed.max_out is not None:
        assert doc[parsed.max_field] == parsed.max_out


@given(CAPS, CAPS)
def test_a_chat_requests_maximum_is_named_by_the_field_it_came_in(
    max_tokens: int | None, max_completion_tokens: int | None
) -> None:
    doc = body(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=max_tokens,
               max_completion_tokens=max_completion_tokens)  # fmt: skip
    parsed = requests.parse("chat", msgspec.json.encode(doc), want_text=False)
    named(doc, parsed)
    if not max_completion_tokens:
        assert parsed.max_field == "max_tokens"


@given(CAPS, CAPS, st.sampled_from(["messages", "responses", "completions"]))
def test_every_other_api_names_its_own_field(
    max_tokens: int | None, max_output_tokens: int | None, kind: requests.Kind
) -> None:
    doc = body(model="m", prompt="hi", max_tokens=max_tokens, max_output_tokens=max_output_tokens)
    parsed = requests.parse(kind, msgspec.json.encode(doc), want_text=False)
    assert parsed.max_field == ("max_output_tokens" if kind == "responses" else "max_tokens")
    named(doc, parsed)


def test_the_400_of_a_maximum_too_large_says_which_field_to_lower() -> None:
    q = Quotas(Store())  # type: ignore[arg-type]
    p = key(tokens_per_min=1000.0)
    for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        refused = q.hold_now(p, 0, 4000, 0.0, 1, field)
        assert isinstance(refused, Refusal)
        assert f"completion tokens ({field})" in refused.message
        assert f"lower {field} to at most 1000" in refused.message
        others = {"max_tokens", "max_completion_tokens", "max_output_tokens"} - {field}
        assert not any(other in refused.message for other in others)


def next_renewal(wall: float, period: tenancy.Period) -> datetime.datetime:
    """00:00 UTC of the day, or of the first of the month, after `wall`'s."""
    now = datetime.datetime.fromtimestamp(wall, datetime.UTC)
    if period == "day":
        return datetime.datetime(now.year, now.month, now.day, tzinfo=datetime.UTC) + (
            datetime.timedelta(days=1)
        )
    year, month = (now.year + 1, 1) if now.month == 12 else (now.year, now.month + 1)
    return datetime.datetime(year, month, 1, tzinfo=datetime.UTC)


@given(WALLS, st.sampled_from(["day", "month"]))
def test_a_spent_budgets_429_names_its_renewal_and_retry_after_agrees(
    wall: float, period: tenancy.Period
) -> None:
    p = key(budget_tokens=100, budget_period=period)
    refused = admission.over_budget(p, 0, 10, wall, "max_output_tokens")
    renews = next_renewal(wall, period)
    assert f"(at {renews:%Y-%m-%d} 00:00 UTC)" in refused.message
    assert "lower max_output_tokens" in refused.message
    assert refused.retry_after == max(1, math.ceil(renews.timestamp() - wall))


def test_a_monthly_budget_spent_mid_month_renews_on_the_first_of_the_next() -> None:
    """Through the fleet's counters: a key of 100 tokens a month, spent on 15 December,
    is told 1 January, about 17 days away, not midnight."""
    wall = datetime.datetime(2026, 12, 15, 12, 0, tzinfo=datetime.UTC).timestamp()

    async def run() -> object:
        q = Quotas(Store())  # type: ignore[arg-type]
        p = key(budget_tokens=100, budget_period="month")
        held = await q.hold(p, 100, wall, 0.0)
        assert isinstance(held, Held)
        return await q.hold(p, 1, wall, 0.0, "max_completion_tokens")

    refused = asyncio.run(run())
    assert isinstance(refused, Refusal)
    assert refused.code == "budget_exceeded"
    assert "(at 2027-01-01 00:00 UTC)" in refused.message
    assert "lower max_completion_tokens" in refused.message
    assert refused.retry_after == 16 * 86_400 + 12 * 3600


def test_a_budget_the_fleet_overspent_names_what_this_router_still_holds_of_it() -> None:
    """Router B's answers used 600 tokens beyond their holds, taking the counter past the
    budget of 1,000, while A still holds 10 of its lease: A's 429 to a request that may use
    100 says 10 are left (a request of at most 10 is still admitted), not 0."""

    async def run() -> tuple[Refusal | Held, Refusal | Held]:
        store = Store()
        a, b = Quotas(store), Quotas(store)  # type: ignore[arg-type]
        p = key(budget_tokens=1000)
        first = await a.hold(p, 10, 0.5, 0.0)  # A leases 20, holds 10 of them
        spender = await b.hold(p, 900, 0.5, 0.0)
        assert isinstance(first, Held)
        assert isinstance(spender, Held)
        b.settle(spender, 1500)
        await b.pay_owed(0.5)
        return await a.hold(p, 100, 0.5, 0.0), await a.hold(p, 10, 0.5, 0.0)

    refused, small = asyncio.run(run())
    assert isinstance(refused, Refusal)
    assert "has 10 tokens left of its budget of 1000" in refused.message
    assert isinstance(small, Held)

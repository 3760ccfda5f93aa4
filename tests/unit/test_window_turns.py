"""A lease belongs to the window (or budget period) it was taken of: what a router has
left of it when the window turns is never spent in the next one, where the counter may have
granted the whole limit to other routers already, nor is the rest of a hold of a window
that is over; a use beyond such a hold is charged all the same, and paying a past period
is no reading of the current one. A request is never held of a lease holding less than it
may cost, a request its window refuses gives its budget hold back, and a request no wait
could admit is told so at once (a 400), by the key's tightest token limit."""

from __future__ import annotations

import asyncio

from hypothesis import given
from hypothesis import strategies as st

from llmgw.router import auth
from llmgw.router.errors import Refusal
from llmgw.router.holds import Held
from llmgw.router.quotas import Quotas
from tests.unit.test_quotas import Store, key
from tests.unit.test_token_holds import Stalls


async def held_or_refused(q: Quotas, p: auth.Principal, max_out: int, wall: float) -> object:
    """A request's hold as the router takes it: from its leases, else by `hold`."""
    need = q.hold_now(p, 0, max_out, wall)
    return need if not isinstance(need, int) else await q.hold(p, need, wall, 0.0)


async def fill(q: Quotas, p: auth.Principal, requests: int, wall: float) -> int:
    """Admit up to `requests` of `p` on router `q`; how many were admitted."""
    admitted = 0
    for _ in range(requests):
        if q.admit_now(p, wall) or await q.admit(p, wall, 0.0) is None:
            admitted += 1
    return admitted


def test_requests_left_of_a_windows_lease_are_not_admitted_in_the_next_window() -> None:
    """A key of 100 requests/s: router A leases two in window 100 and uses one. In window
    101 router B is granted all 100; A's request there is refused, on either path."""

    async def run() -> tuple[bool, object]:
        store = Store()
        a, b = Quotas(store), Quotas(store)  # type: ignore[arg-type]
        p = key(requests_per_s=100.0)
        assert await a.admit(p, 100.5, 0.0) is None
        assert await fill(b, p, 100, 101.5) == 100
        return a.admit_now(p, 101.5), await a.admit(p, 101.5, 0.0)

    now, later = asyncio.run(run())
    assert not now
    assert isinstance(later, Refusal)


def test_a_lease_answered_after_its_window_turned_is_not_spent_in_the_next() -> None:
    """Router A's lease of window 100 is answered only once window 101 has begun and A
    leased of it too: the two requests window 100 granted are no use in window 101, where
    router B holds the rest of the limit; A admits no more there than 101's counter granted
    it."""

    async def run() -> int:
        store = Stalls(".r.100")
        a, b = Quotas(store), Quotas(store)  # type: ignore[arg-type]
        a.clock = lambda: 101.5
        p = key(requests_per_s=100.0)
        late = asyncio.ensure_future(a.admit(p, 100.5, 0.0))
        await store.waiting.wait()
        assert await a.admit(p, 101.5, 0.0) is None  # leases two of window 101
        assert await fill(b, p, 98, 101.5) == 98
        store.go.set()
        assert await late is None  # retried in window 101, of A's lease there
        return await fill(a, p, 5, 101.5)

    assert asyncio.run(run()) == 0


async def last_of(p: auth.Principal, *requests: tuple[str, int, float]) -> object:
    """Requests of key `p` on routers "a" and "b" sharing one store, each (router, what it
    may cost, when) in turn: every one held but the last, whose hold or refusal it is."""
    store = Store()
    routers = {"a": Quotas(store), "b": Quotas(store)}  # type: ignore[arg-type]
    *before, (last, cost, wall) = requests
    for router, may_cost, at in before:
        assert isinstance(await held_or_refused(routers[router], p, may_cost, at), Held)
    return await held_or_refused(routers[last], p, cost, wall)


def test_tokens_left_of_a_windows_lease_are_not_held_in_the_next_window() -> None:
    """A key of 1,000 tokens/min: router A leased 20 in one window and holds 10. In the next,
    router B holds all 1,000; A's request there is refused, not held of the old lease."""
    p = key(tokens_per_min=1000.0)
    held = last_of(p, ("a", 10, 60.5), ("b", 1000, 120.5), ("a", 5, 120.5))
    assert isinstance(asyncio.run(held), Refusal)


def test_a_budgets_lease_holding_less_than_a_request_may_cost_does_not_hold_it() -> None:
    """A budget of 1,000: router A leased 20 and holds 10 of them; router B holds the other
    980. A request of A that may cost 15 does not fit the 10 A has left: it is refused, not
    held with A's lease gone below nothing."""
    held = last_of(key(budget_tokens=1000), ("a", 10, 1e9), ("b", 980, 1e9), ("a", 15, 1e9))
    assert isinstance(asyncio.run(held), Refusal)


@given(st.integers(1, 10_000), st.integers(1, 10_000))
def test_a_request_over_the_tightest_token_limit_is_told_no_wait_admits_it(
    tokens_per_min: int, budget: int
) -> None:
    """A key limited by tokens/min and a budget: asking for more completion tokens than the
    smaller of the two is a 400 at once (a 429 would have its client wait forever)."""
    p = key(tokens_per_min=float(tokens_per_min), budget_tokens=budget)
    tightest = min(tokens_per_min, budget)
    refused = Quotas(Store()).hold_now(p, 0, tightest + 1, 1e9)  # type: ignore[arg-type]
    assert isinstance(refused, Refusal)
    assert refused.status == 400
    assert str(tightest) in refused.message


def test_a_request_its_window_refuses_gives_its_budget_hold_back() -> None:
    """A key of 100 tokens/min and a budget of 1,000: a request its full window refuses held
    of the budget first, and gives it back: the 900 the first request left of the budget
    are all there for the windows after, 90 in each."""

    async def run() -> int:
        q = Quotas(Store())  # type: ignore[arg-type]
        p = key(tokens_per_min=100.0, budget_tokens=1000)
        first = await held_or_refused(q, p, 100, 60.5)
        assert isinstance(first, Held)
        q.settle(first, 100)
        assert isinstance(await held_or_refused(q, p, 50, 60.5), Refusal)
        return sum([isinstance(await held_or_refused(q, p, 90, 60.5 + 60 * n), Held)
                    for n in range(1, 13)])  # fmt: skip

    assert asyncio.run(run()) == 10


def test_the_rest_of_a_hold_whose_window_is_over_is_not_given_to_the_next() -> None:
    """A request held 100 tokens of one window and ends, having used none, once the next
    window began and its counter was granted in full: the 100 are no one's any more, not
    tokens of the new window this router could hold again."""

    async def run() -> object:
        store = Store()
        a, b = Quotas(store), Quotas(store)  # type: ignore[arg-type]
        p = key(tokens_per_min=1000.0)
        old = await held_or_refused(a, p, 100, 60.5)
        assert isinstance(old, Held)
        assert isinstance(await held_or_refused(a, p, 10, 120.5), Held)
        assert isinstance(await held_or_refused(b, p, 980, 120.5), Held)
        a.settle(old, 0)
        return await held_or_refused(a, p, 50, 120.5)

    assert isinstance(asyncio.run(run()), Refusal)


def test_a_use_beyond_a_hold_whose_window_is_over_is_still_charged() -> None:
    """A request held 100 tokens of one window and used 300, ending in the next window:
    the 200 beyond its hold are charged to the counters all the same."""

    async def run() -> int:
        store = Store()
        q = Quotas(store)  # type: ignore[arg-type]
        p = key(tokens_per_min=1000.0)
        old = await held_or_refused(q, p, 100, 60.5)
        assert isinstance(old, Held)
        assert isinstance(await held_or_refused(q, p, 10, 120.5), Held)
        q.settle(old, 300)
        await q.pay_owed(120.5)
        return sum(store.totals.values())

    assert asyncio.run(run()) == 100 + 20 + 200  # two leases, and the charge


def test_paying_a_past_budget_period_is_no_reading_of_the_current_one() -> None:
    """A request of yesterday's budget ends today, owing it 800: the total yesterday's
    counter answers is not today's. An outage today is reckoned from today's reading: the
    router's share of today's budget is there."""
    day1, day2 = 1e9, 1e9 + 86_400.0

    async def run() -> object:
        store = Store()
        q = Quotas(store)  # type: ignore[arg-type]
        p = key(budget_tokens=1000)
        yesterdays = await held_or_refused(q, p, 100, day1)
        assert isinstance(yesterdays, Held)
        assert isinstance(await held_or_refused(q, p, 10, day2), Held)
        q.settle(yesterdays, 900)
        await q.pay_owed(day2)
        store.down = True
        return await q.hold(p, 500, day2, 0.0)

    assert isinstance(asyncio.run(run()), Held)

"""A key's limits at their edges (llmgw.router.quotas): a keys-file key is limited by this
router's buckets alone, even named as a key of the log; a window the counters found spent
costs no round trip per request it refuses; what requests hold of a budget's lease is
taken out of it; a hold of both a window and a budget is settled in both; the unused rest
of a hold whose window is over goes back to no window; a request charged tokens counts in
the key's usage whatever its status; a budget's payment under way when the flusher turns
is owed again if its add fails, and counts against this router's share of the budget
should the counters go away meanwhile; a lease answered windows late is retried in the
window it is now; and the flusher reads the budgets, so an outage's share counts the
other routers' spending."""

from __future__ import annotations

import asyncio
import time

import pytest

from llmgw.bus.counters import CounterError
from llmgw.core import subjects, tenancy
from llmgw.router import auth
from llmgw.router.errors import Refusal
from llmgw.router.holds import Held
from llmgw.router.quotas import Quotas
from tests.unit.test_quotas import Store, admitted, key
from tests.unit.test_token_holds import Stalls
from tests.unit.test_window_turns import held_or_refused


def test_a_keys_file_key_named_as_a_fleet_key_is_limited_by_this_routers_buckets() -> None:
    """A keys file may name a key as the log names another: the file's key spends neither
    the fleet key's leases nor the fleet's counters, only its own buckets."""

    async def run() -> None:
        store = Store()
        q = Quotas(store)  # type: ignore[arg-type]
        fleet = key(requests_per_s=100.0, tokens_per_min=6000.0)
        assert await admitted(q, fleet, 0.5)
        assert isinstance(await held_or_refused(q, fleet, 10, 0.5), Held)
        leased = dict(store.totals)
        settings = tenancy.KeySettings(name="k", requests_per_s=1.0, tokens_per_min=60.0)
        local = auth.Principal(settings, "b" * 64, 0.0)
        mono = time.monotonic()
        assert not q.admit_now(local, 0.5)
        assert await q.admit(local, 0.5, mono) is None
        assert not q.admit_now(local, 0.5)
        assert isinstance(await q.admit(local, 0.5, mono), Refusal)  # 1 a second, its own
        assert q.hold_now(local, 0, 50, 0.5) == 50  # nothing held of the fleet key's lease
        assert isinstance(await q.hold(local, 50, 0.5, mono), Held)
        assert isinstance(await q.hold(local, 50, 0.5, mono), Refusal)  # 60 a minute, its own
        assert store.totals == leased

    asyncio.run(run())


def test_a_window_found_spent_is_asked_again_only_in_the_next_window() -> None:
    async def run() -> tuple[list[bool], bool]:
        store = Store()
        a, b = Quotas(store), Quotas(store)  # type: ignore[arg-type]
        p = key(requests_per_s=2.0)
        while await admitted(b, p, 0.5):  # router b is granted the whole window
            pass
        assert not await admitted(a, p, 0.5)
        asked = dict(store.totals)
        refused = [await admitted(a, p, 0.5) for _ in range(5)]
        assert store.totals == asked  # no round trip per refused request
        return refused, await admitted(a, p, 1.5)

    assert asyncio.run(run()) == ([False] * 5, True)


def test_requests_held_of_a_budgets_lease_never_hold_more_than_the_budget() -> None:
    async def run() -> int:
        q = Quotas(Store())  # type: ignore[arg-type]
        p = key(budget_tokens=1000)
        held = [await held_or_refused(q, p, 10, 0.5) for _ in range(150)]  # leases of 100
        return sum(h.tokens for h in held if isinstance(h, Held))

    assert asyncio.run(run()) == 1000


def test_a_hold_of_a_window_and_a_budget_gives_its_rest_back_to_both() -> None:
    async def run() -> list[bool]:
        q = Quotas(Store())  # type: ignore[arg-type]
        p = key(tokens_per_min=6000.0, budget_tokens=100)
        first = await held_or_refused(q, p, 100, 0.5)
        assert isinstance(first, Held)
        assert first.window is not None
        assert first.period is not None
        spent = await held_or_refused(q, p, 100, 0.5)
        q.settle(first, 0)
        again = await held_or_refused(q, p, 100, 0.5)
        return [isinstance(spent, Refusal), isinstance(again, Held)]

    assert asyncio.run(run()) == [True, True]


def test_the_rest_of_a_hold_whose_window_is_over_is_owed_to_no_window() -> None:
    """A hold of a window that is over, ending having used less than it held: nothing is
    taken off the counter of the window it is now."""

    async def run() -> tuple[int, dict[str, int], dict[str, int]]:
        store = Store()
        q = Quotas(store)  # type: ignore[arg-type]
        p = key(tokens_per_min=1000.0)
        old = await held_or_refused(q, p, 100, 60.5)
        assert isinstance(old, Held)
        assert isinstance(await held_or_refused(q, p, 10, 120.5), Held)
        before = dict(store.totals)
        q.settle(old, 30)
        await q.pay_owed(120.5)
        return q.owes("k", ""), before, store.totals

    owed, before, after = asyncio.run(run())
    assert owed == 0
    assert after == before


def test_a_request_charged_tokens_counts_in_usage_whatever_its_status() -> None:
    q = Quotas()
    p = key()
    q.ended(p, "m", 499, (5, 3), None)  # a stream its client cut, charged what it relayed
    q.ended(p, "m", 502, (0, 0), None)  # refused, charged nothing: no request of its usage
    q.ended(p, "m", 200, (0, 0), None)
    assert q.usage.pending() == [("k", "m", 0, 0, 2)]


def test_a_budget_payment_under_way_when_the_flusher_turns_is_owed_again_if_it_fails() -> None:
    period = tenancy.period_of(0.5, "day")

    async def run() -> tuple[int, int]:
        store = Stalls(period)
        q = Quotas(store)  # type: ignore[arg-type]
        q.owe("k", period, 100, 1000)
        paying = asyncio.create_task(q.pay_owed(0.5))
        await asyncio.wait_for(store.waiting.wait(), 30)
        await q.pay_owed(0.5)  # the flusher's next turn, the add still under way
        store.down = True
        store.go.set()
        with pytest.raises(CounterError):
            await paying
        owed = q.owes("k", period)
        store.down = False
        await q.pay_owed(0.5)
        return owed, store.totals[subjects.budget_counter("k", period)]

    assert asyncio.run(run()) == (100, 100)


def test_a_fleet_keys_tokens_per_min_is_this_routers_bucket_while_the_counters_are_away() -> None:
    async def run() -> tuple[object, object]:
        store = Store()
        store.down = True
        q = Quotas(store)  # type: ignore[arg-type]
        p = key(tokens_per_min=60.0)
        now = time.monotonic()
        return await q.hold(p, 50, 0.5, now), await q.hold(p, 50, 0.5, now)

    first, second = asyncio.run(run())
    assert isinstance(first, Held)
    assert first.local
    assert isinstance(second, Refusal)


def test_the_flusher_keeps_a_monthly_budgets_lease() -> None:
    async def run() -> object:
        q = Quotas(Store())  # type: ignore[arg-type]
        p = key(budget_tokens=1000, budget_period="month")
        assert isinstance(await held_or_refused(q, p, 10, 0.5), Held)  # a lease of 100
        await q.read_budgets(0.5)
        return q.hold_now(p, 0, 10, 0.5)

    assert isinstance(asyncio.run(run()), Held)  # of what it leased, no round trip


def test_a_requests_prompt_and_completion_tokens_are_both_charged_when_it_ends() -> None:
    p = key(tokens_per_min=100.0)
    p.fleet = False
    q = Quotas()
    now = time.monotonic()
    held = asyncio.run(q.hold(p, 80, 0.0, now))
    assert isinstance(held, Held)
    q.ended(p, "m", 200, (50, 40), held)  # used 90: 10 beyond its hold, 10 left
    assert isinstance(asyncio.run(q.hold(p, 20, 0.0, now)), Refusal)
    assert isinstance(asyncio.run(q.hold(p, 10, 0.0, time.monotonic())), Held)


def test_a_lease_answered_windows_later_is_retried_in_the_window_it_is_now() -> None:
    """Router A's lease of window 100 is answered once its clock reads 103.5: the request
    waiting for it is counted in window 103, never in 101, a window already over."""

    async def run() -> list[str]:
        store = Stalls(".r.100")
        a = Quotas(store)  # type: ignore[arg-type]
        a.clock = lambda: 103.5
        p = key(requests_per_s=100.0)
        late = asyncio.ensure_future(a.admit(p, 100.5, 0.0))
        await asyncio.wait_for(store.waiting.wait(), 30)
        assert await a.admit(p, 103.5, 0.0) is None
        store.go.set()
        assert await late is None
        return sorted(store.totals)

    assert asyncio.run(run()) == [subjects.limit_counter("k", "r", w) for w in (100, 103)]


def test_a_budget_payment_unanswered_when_the_counters_go_away_counts_against_the_share() -> None:
    """100 of a budget of 1,000 read as spent, and 500 more on their way to the counter when
    it stops answering: this router's outage share is the 400 that leaves, not 900."""
    period = tenancy.period_of(0.5, "day")

    async def run() -> int:
        store = Stalls("no subject holds this")
        q = Quotas(store)  # type: ignore[arg-type]
        p = key(budget_tokens=1000)
        assert isinstance(await held_or_refused(q, p, 100, 0.5), Held)
        q.owe("k", period, 500, 1000)
        store.part = period
        paying = asyncio.create_task(q.pay_owed(0.5))
        await asyncio.wait_for(store.waiting.wait(), 30)
        q.counters = None  # out of reach, the add unanswered
        held = [await q.hold(p, 100, 0.5, 0.0) for _ in range(12)]
        store.down = True
        store.go.set()
        with pytest.raises(CounterError):
            await paying
        return sum(isinstance(h, Held) for h in held)

    assert asyncio.run(run()) == 4


class Reads(Store):
    """Counters that tell when a budget's counter was read (an add of nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.read = asyncio.Event()

    async def add(self, subject: str, amount: int) -> int:
        total = await super().add(subject, amount)
        if amount == 0 and ".b." in subject:
            self.read.set()
        return total


def test_the_flusher_reads_the_budgets_so_an_outage_share_counts_other_routers_spending() -> None:
    """Router A leased 100 of a budget of 1,000 and B 800 since: A's flusher reads the
    counter, so when the counters go away A's share is the 100 left, not the 900 its own
    lease's answer said."""

    async def run() -> int:
        store = Reads()
        a, b = Quotas(store), Quotas(store)  # type: ignore[arg-type]
        a.clock = lambda: 0.5
        p = key(budget_tokens=1000)
        assert isinstance(await held_or_refused(a, p, 100, 0.5), Held)
        assert isinstance(await held_or_refused(b, p, 800, 0.5), Held)
        flusher = asyncio.create_task(a.flush_until_stopped())
        await asyncio.wait_for(store.read.wait(), 30)
        await a.close()
        await flusher
        a.counters = None
        held = [await a.hold(p, 100, 0.5, 0.0) for _ in range(12)]
        return sum(isinstance(h, Held) for h in held)

    assert asyncio.run(run()) == 1

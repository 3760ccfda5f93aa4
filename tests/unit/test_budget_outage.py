"""A key's budget while the fleet's counters cannot be reached (llmgw.router.quotas,
llmgw.core.reserve): each router spends at most what it leased and its share of what its
last reading left, refuses a budget it never read, and nothing it spent is lost: the
counters hold all of it once they answer again."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.bus.counters import CounterError
from llmgw.core import reserve, subjects, tenancy
from llmgw.router import auth
from llmgw.router.errors import Refusal
from llmgw.router.holds import Held
from llmgw.router.quotas import Quotas
from tests.unit.test_quotas import Store, key

WALL = 1e9
BUDGET_SUBJECT = subjects.budget_counter("k", tenancy.period_of(WALL, "day"))


class Ledger(Store):
    """Counters that also keep what the leases they answered did not grant (the budget was
    passed): the part of the counter that is neither used nor held by any router."""

    def __init__(self) -> None:
        super().__init__()
        self.ungranted = 0

    @contextlib.contextmanager
    def watching_leases(self) -> Iterator[None]:
        """Counts what each lease did not grant (a lease may add what its key owed beside
        it, so the increment alone does not tell)."""
        leased = reserve.Pool.leased

        def counted(pool: reserve.Pool, size: int, total_after: int, limit: int) -> int:
            got = leased(pool, size, total_after, limit)
            self.ungranted += size - got
            return got

        with mock.patch.object(reserve.Pool, "leased", counted):
            yield


@dataclass
class Router:
    quotas: Quotas
    budget: int
    allowance: int = 0
    """What it may admit in this outage: its lease's rest and its share's rest."""
    admitted: int = 0
    """What the requests it admitted in this outage used, each up to its hold."""
    used: int = 0
    """Everything its requests used."""
    within_holds: int = 0
    """What its requests used, each up to its hold."""
    refusals: list[str] = field(default_factory=list)

    def reckon_outage(self) -> None:
        """The stated allowance, from what the router knew when the counters went away."""
        pool = self.quotas._budgets.get("k")
        self.admitted = 0
        if pool is None or not pool.read:
            self.allowance = 0
            return
        share = pool.outage_left
        if share is None:  # reckoned from the reading and what the router owes beside it
            unpaid = self.quotas.owes("k", str(pool.period))
            share = reserve.outage_allowance(
                self.budget, pool.total + unpaid, self.quotas.processes
            )
        self.allowance = pool.left + share


@dataclass(frozen=True)
class Request:
    router: int
    need: int
    used: int
    """Less or more than its hold (a prompt longer than estimated)."""


@dataclass(frozen=True)
class Round:
    """Requests while the counters answer, the flusher's turn or not, then requests while
    they cannot be reached, and once they answer again the flusher's turn (`paid`: 0 not
    yet, 1 its payments only, its budgets' reading not due, 2 both)."""

    before: list[Request]
    read: bool
    during: list[Request]
    paid: int


REQUESTS = st.lists(
    st.builds(Request, st.integers(0, 2), st.integers(1, 300), st.integers(0, 450)), max_size=12
)
ROUNDS = st.lists(
    st.builds(Round, REQUESTS, st.booleans(), REQUESTS, st.integers(0, 2)), max_size=6
)


async def play(budget: int, routers: int, rounds: list[Round]) -> None:
    store = Ledger()
    with store.watching_leases():
        fleet = [Router(Quotas(store), budget) for _ in range(routers)]  # type: ignore[arg-type]
        for r in fleet:
            r.quotas.processes = routers
        p = key(budget_tokens=budget)

        async def send(requests: list[Request]) -> None:
            for rq in requests:  # a request holds at most the whole budget (`reservation`)
                await request(fleet[rq.router % routers], p, min(rq.need, budget), rq.used, store)

        for turn in rounds:
            await send(turn.before)
            if turn.read:
                await flush(store, fleet)
            store.down = True
            for r in fleet:
                r.reckon_outage()
            await send(turn.during)
            settle_outage(fleet)
            store.down = False
            if turn.paid:
                await flush(store, fleet, read=turn.paid == 2)
        await flush(store, fleet)
        leased_rest = sum(left(r.quotas) for r in fleet)
        # Nothing spent is lost: the counter holds every token used, every lease's unused rest,
        # and what leases asked of a spent budget and were not granted; nothing else.
        assert store.totals.get(BUDGET_SUBJECT, 0) == (
            sum(r.used for r in fleet) + leased_rest + store.ungranted
        )
        if routers == 1:  # every hold it gave was granted of what it knew the budget had left
            assert fleet[0].within_holds <= budget


def settle_outage(fleet: list[Router]) -> None:
    for r in fleet:
        assert r.admitted <= r.allowance, (r.admitted, r.allowance)
        # Refused for want of a share, or, by what the last reading said, a spent budget.
        assert set(r.refusals) <= {"budget_unavailable", "budget_exceeded"}
        r.refusals.clear()


def left(q: Quotas) -> int:
    pool = q._budgets.get("k")
    return 0 if pool is None else pool.left


async def flush(store: Ledger, fleet: list[Router], *, read: bool = True) -> None:
    """The flusher: what each router owes, then (when due) a reading of its budgets."""
    for r in fleet:
        with contextlib.suppress(CounterError):
            await r.quotas.pay_owed(WALL)
            if read:
                await r.quotas.read_budgets(WALL)


async def request(r: Router, p: auth.Principal, need: int, used: int, store: Ledger) -> None:
    held = await r.quotas.hold(p, need, WALL, 0.0)
    if not isinstance(held, Held):
        if store.down:
            r.refusals.append(str(held.code))
        return
    r.quotas.settle(held, used)
    r.used += used
    r.within_holds += min(used, need)
    if store.down:
        r.admitted += min(used, need)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 3), ROUNDS)
def test_an_outage_admits_at_most_each_routers_share_and_loses_nothing(
    budget: int, routers: int, rounds: list[Round]
) -> None:
    """Over any sequence of requests (using less or more than they held), outages and
    recoveries on several routers: what a router admits during an outage never passes what
    it had leased and its share of what its last reading left; after recovery the counter
    holds everything the routers charged."""
    asyncio.run(play(budget, routers, rounds))


def test_a_budget_never_read_is_refused_while_the_counters_are_out_of_reach() -> None:
    async def run() -> object:
        q = Quotas()  # never connected
        return await q.hold(key(budget_tokens=1000), 10, WALL, 0.0)

    refused = asyncio.run(run())
    assert not isinstance(refused, Held)
    assert (refused.status, refused.code) == (503, "budget_unavailable")
    assert "budget of 1000 tokens per day cannot be checked" in refused.message
    assert refused.retry_after >= 1


async def spent_then_out_of_reach(spent: int) -> tuple[Store, Quotas, auth.Principal]:
    """One of two routers, a day's budget of 1000 of which `spent` is used and read, then
    the counters out of reach."""
    store = Store()
    q = Quotas(store)  # type: ignore[arg-type]
    q.processes = 2
    p = key(budget_tokens=1000)
    first = await q.hold(p, spent, WALL, 0.0)
    assert isinstance(first, Held)
    q.settle(first, spent)
    await q.read_budgets(WALL)
    store.down = True
    return store, q, p


async def hundreds(q: Quotas, p: auth.Principal, times: int, wall: float) -> list[bool]:
    """Whether each of `times` requests holding and using 100 tokens was admitted."""
    admitted = []
    for _ in range(times):
        held = await q.hold(p, 100, wall, 0.0)
        admitted.append(isinstance(held, Held))
        if isinstance(held, Held):
            q.settle(held, 100)
    return admitted


def test_an_outage_spends_the_share_then_refuses_and_the_counter_gets_it_all() -> None:
    """Two routers, a budget of 1000 of which 400 is spent: one router's share of the 600
    left is 300. It admits 300 during the outage, refuses the next, and once the counters
    answer they hold the 400 and those 300."""

    async def run() -> tuple[list[bool], object, int]:
        store, q, p = await spent_then_out_of_reach(400)
        admitted = await hundreds(q, p, 4, WALL)
        refused = await q.hold(p, 1, WALL, 0.0)
        store.down = False
        await q.pay_owed(WALL)
        return admitted, refused, store.totals[BUDGET_SUBJECT]

    admitted, refused, total = asyncio.run(run())
    assert admitted == [True, True, True, False]
    assert not isinstance(refused, Held)
    assert refused.code == "budget_unavailable"
    assert "0 tokens" in refused.message
    assert total == 700


@given(
    st.integers(1, 10**6),
    st.integers(0, 2 * 10**6),
    st.integers(1, 8),
    st.lists(st.tuples(st.integers(0, 7), st.integers(1, 10**6)), max_size=40),
)
def test_the_routers_outage_leases_grant_no_more_than_their_readings_left(
    limit: int, total: int, processes: int, needs: list[tuple[int, int]]
) -> None:
    """Every router process read the same total: whatever they ask during the outage, each
    grants itself at most its share, and all of them together at most what was left."""
    pools = [reserve.Pool("d20261205") for _ in range(processes)]
    for pool in pools:
        pool.reading(total)
    granted = [0] * processes
    for i, need in needs:
        granted[i % processes] += pools[i % processes].outage_lease(need, limit, processes)
    assert all(g <= reserve.outage_allowance(limit, total, processes) for g in granted)
    assert sum(granted) <= max(0, limit - total)
    assert reserve.Pool("d20261205").outage_lease(1, limit, processes) == 0  # never read


def test_the_flusher_reads_the_budgets_of_their_current_period_only() -> None:
    """A budget read on one day is read again that day; the day after, its pool is dropped
    unread: the reads grow with the keys in use this period, not with every key ever used."""

    class Reads(Store):
        def __init__(self) -> None:
            super().__init__()
            self.reads: list[str] = []

        async def add(self, subject: str, amount: int) -> int:
            if not amount:
                self.reads.append(subject)
            return await super().add(subject, amount)

    async def run() -> list[str]:
        store = Reads()
        q = Quotas(store)  # type: ignore[arg-type]
        held = await q.hold(key(budget_tokens=1000), 10, WALL, 0.0)
        assert isinstance(held, Held)
        q.settle(held, 10)
        await q.read_budgets(WALL + 60)
        await q.read_budgets(WALL + 2 * 86_400)
        await q.read_budgets(WALL + 3 * 86_400)
        return store.reads

    assert asyncio.run(run()) == [BUDGET_SUBJECT]


async def spent_and_read(budget: int, used: int) -> tuple[Store, Quotas, auth.Principal]:
    """One router of a key of `budget` tokens a day, which used `used` of it and read it."""
    store = Store()
    q = Quotas(store)  # type: ignore[arg-type]
    p = key(budget_tokens=budget)
    held = await q.hold(p, used, WALL, 0.0)
    assert isinstance(held, Held)
    q.settle(held, used)
    await q.read_budgets(WALL)
    return store, q, p


def test_an_outage_after_a_short_recovery_counts_what_the_last_one_paid() -> None:
    """One router, a budget of 1000. It spends its share in an outage; the counters come
    back and a lease is answered before the flusher pays what that outage spent, then the
    flusher pays it, and the counters go away again before the next reading. The second
    outage must be reckoned with that payment: all the router used stays within the budget."""

    async def spend_outage(q: Quotas, p: auth.Principal) -> int:
        used = 0
        while isinstance(held := await q.hold(p, 50, WALL, 0.0), Held):
            q.settle(held, 50)
            used += 50
        return used

    async def run() -> tuple[int, int]:
        store, q, p = await spent_and_read(1000, 100)
        used = 100
        store.down = True
        used += await spend_outage(q, p)
        store.down = False
        pool = q._budgets["k"]
        held = await q.hold(p, pool.left + 1, WALL, 0.0)  # a lease, before the flusher's turn
        if isinstance(held, Held):
            q.settle(held, held.tokens)
            used += held.tokens
        await q.pay_owed(WALL)
        store.down = True
        used += await spend_outage(q, p)
        store.down = False
        await q.pay_owed(WALL)
        return used, store.totals[BUDGET_SUBJECT]

    used, total = asyncio.run(run())
    assert used <= 1000, (used, total)
    assert total >= used


def test_what_is_owed_is_added_once_when_a_lease_and_the_flusher_both_pay_it() -> None:
    """After an outage, a lease (which adds what the key owes with it) and the flusher's
    turn run at once: the counter gets what was owed once, not twice."""

    async def run() -> tuple[int, int, int]:
        store, q, p = await spent_and_read(10_000, 100)
        store.down = True
        held = await q.hold(p, 500, WALL, 0.0)  # of the outage's share, owed
        assert isinstance(held, Held)
        q.settle(held, 500)
        store.down = False
        pool = q._budgets["k"]
        lease = q.hold(p, pool.left + 1, WALL, 0.0)
        got, _ = await asyncio.gather(lease, q.pay_owed(WALL))
        assert isinstance(got, Held)
        held_or_leased = 100 + 500 + got.tokens + pool.left
        return store.totals[BUDGET_SUBJECT], held_or_leased, q.owes("k", str(pool.period))

    total, held_or_leased, owed = asyncio.run(run())
    assert (total, owed) == (held_or_leased, 0)


def test_a_period_that_turns_during_an_outage_is_spent_from_zero_by_shares() -> None:
    """A day's budget read (900 of 1000 spent), then an outage across midnight: the new
    day's counter began at 0, so each of two routers may spend its share of 1000 (500) of
    it, not nothing; once the counters answer, the new day's counter holds what was spent."""

    async def run() -> tuple[list[bool], int, int]:
        store, q, p = await spent_then_out_of_reach(900)
        tomorrow = tenancy.period_end(WALL, "day") + 60.0
        admitted = await hundreds(q, p, 6, tomorrow)
        store.down = False
        await q.pay_owed(tomorrow)
        day2 = subjects.budget_counter("k", tenancy.period_of(tomorrow, "day"))
        return admitted, store.totals[BUDGET_SUBJECT], store.totals.get(day2, 0)

    admitted, day1, day2 = asyncio.run(run())
    assert admitted == [True] * 5 + [False]
    assert day1 == 900
    assert day2 == 500


@given(st.sampled_from(["day", "month"]), st.floats(0, 4e9), st.floats(0, 4e9))
def test_a_period_turned_only_forward_and_within_its_kind(
    kind: tenancy.Period, a: float, b: float
) -> None:
    first, second = tenancy.period_of(a, kind), tenancy.period_of(b, kind)
    assert reserve.turned(first, second) == (first != second and a < b)
    other = tenancy.period_of(b, "month" if kind == "day" else "day")
    assert not reserve.turned(first, other)


def test_a_request_the_routers_bucket_refuses_in_an_outage_gives_its_budget_hold_back() -> None:
    """While the counters are out of reach, a request's budget hold is taken first, then its
    tokens/min of this router's bucket: a bucket that refuses (it asks for more than the
    bucket holds) leaves the budget as it was. The counter, once it answers, holds what was
    used and what this router still has to hold: none of the budget is lost."""

    async def run() -> tuple[object, int, int]:
        store = Store()
        q = Quotas(store)  # type: ignore[arg-type]
        p = key(tokens_per_min=100.0, budget_tokens=1000)
        held = await q.hold(p, 10, WALL, 0.0)
        assert isinstance(held, Held)
        q.settle(held, 10)
        store.down = True
        refused = await q.hold(p, 150, WALL, 0.0)
        store.down = False
        await q.pay_owed(WALL)
        return refused, store.totals[BUDGET_SUBJECT], left(q)

    refused, counted, rest = asyncio.run(run())
    assert isinstance(refused, Refusal)
    assert counted == 10 + rest

"""Reservations of tokens (llmgw.core.reserve), as routers sharing one window's counter use
them: in any interleaving of requests starting and ending on any of the routers, the fleet
never holds and uses more than the limit but by what requests used beyond their
reservations, no token is lost or counted twice when they are settled, and what a window
went over is carried, exactly, as the next one's debt."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core import reserve

LIMITS = st.integers(1, 5_000)


@dataclass
class Fleet:
    """One window's counter and the routers' pools on it, as the server adds."""

    limit: int
    routers: int
    total: int = 0
    granted: int = 0
    charged: int = 0
    debt: int = 0
    used: int = 0
    pools: list[reserve.Pool] = field(default_factory=list)
    running: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.pools = [reserve.Pool(0) for _ in range(self.routers)]

    def start(self, router: int, need: int) -> bool:
        pool = self.pools[router]
        if not pool.reserve(need):
            if pool.exhausted:
                return False
            size = pool.lease_size(need, self.limit)
            self.total += size
            self.granted += pool.leased(size, self.total, self.limit)
            if not pool.reserve(need):
                return False
        self.running.append((router, need))
        return True

    def end(self, which: int, used: int) -> None:
        router, reserved = self.running.pop(which)
        charge = self.pools[router].settle(reserved, used)
        self.used += used
        if charge:
            self.total += charge
            self.charged += charge
            self.debt += reserve.carried(charge, self.total, self.limit)

    def held(self) -> int:
        return sum(n for _, n in self.running)


STEPS = st.lists(
    st.tuples(st.booleans(), st.integers(0, 7), st.integers(1, 1_500), st.integers(0, 3_000)),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(LIMITS, st.integers(1, 4), STEPS, st.booleans())
def test_no_interleaving_holds_and_uses_more_than_the_limit_nor_loses_a_token(
    limit: int, routers: int, steps: list[tuple[bool, int, int, int]], within: bool
) -> None:
    """`within`: every request uses at most what it reserved; else any amount."""
    fleet = Fleet(limit, routers)
    for starts, who, need, used in steps:
        if starts or not fleet.running:
            fleet.start(who % routers, need)
        else:
            which = who % len(fleet.running)
            fleet.end(which, min(used, fleet.running[which][1]) if within else used)
        # What is held and used fleet-wide: never past the limit but by the charges.
        assert fleet.held() + fleet.used <= limit + fleet.charged
        if within:
            assert fleet.charged == 0
        # Every token granted or charged is held, used or left in a pool: none lost, none
        # counted twice.
        left = sum(p.left for p in fleet.pools)
        assert fleet.granted + fleet.charged == left + fleet.held() + fleet.used
        # The debt is exactly what the window's grants and charges went over its limit.
        assert fleet.debt == max(0, fleet.granted + fleet.charged - limit)


@settings(max_examples=200, deadline=None)
@given(LIMITS, st.integers(1, 4), st.integers(1, 200), st.integers(1, 5_000))
def test_one_burst_is_admitted_up_to_the_limit_and_no_further(
    limit: int, routers: int, requests: int, need: int
) -> None:
    fleet = Fleet(limit, routers)
    admitted = sum(fleet.start(i % routers, need) for i in range(requests))
    assert admitted * need <= limit
    # What is not admitted is at most the rest of each router's lease: never a whole request
    # more than those rests hold.
    wasted = sum(p.left for p in fleet.pools)
    assert admitted >= min(requests, (limit - wasted) // need)


@given(st.integers(0, 10_000), st.integers(0, 10_000) | st.none(), st.integers(0, 10_000),
       st.integers(1, 10_000), st.integers(1, 8))  # fmt: skip
def test_a_reservation_covers_what_the_request_asks_and_fits_unless_it_never_can(
    prompt: int, max_out: int | None, default_out: int, limit: int, choices: int
) -> None:
    n = reserve.reservation(prompt, max_out, default_out, limit, choices)
    asked = prompt + (default_out if max_out is None else max_out) * choices
    # All it asks for (each of its answers), up to the whole limit: never more, so that a
    # request whose prompt was estimated high is still admitted once the window has room;
    # never nothing, which a full window would admit.
    assert n == max(1, min(asked, limit))
    assert 1 <= n <= limit
    # Refused only on the client's own maximum, never on the prompt's estimate.
    refused = reserve.never_fits(max_out, limit, choices)
    assert refused == (max_out is not None and max_out * choices > limit)


@given(st.lists(st.integers(0, 10_000), min_size=1, max_size=8), LIMITS, st.integers(1, 4))
def test_an_outage_is_reckoned_from_the_largest_reading_whatever_order_answers_came(
    readings: list[int], limit: int, processes: int
) -> None:
    """A period's counter only grows: a reading answered late (smaller than one already
    seen) must not make the counter look emptier, or an outage after it would lease what
    other routers already spent."""
    pool = reserve.Pool("d20261202")
    for total in readings:
        pool.reading(total)
    assert pool.total == max(readings)
    granted = pool.outage_lease(limit, limit, processes)
    assert granted <= max(0, limit - max(readings)) // processes


@given(st.integers(0, 5_000), st.integers(1, 1_000), st.integers(0, 10_000))
def test_a_use_beyond_the_hold_is_paid_from_the_lease_before_the_counter_is_charged(
    left: int, reserved: int, used: int
) -> None:
    """What the lease still holds covers a request's use beyond its hold: the counter is
    charged (and a window taken over its limit, as a debt) only for what the lease
    cannot cover."""
    pool = reserve.Pool(0)
    pool.left = left
    charge = pool.settle(reserved, used)
    over = max(0, used - reserved)
    assert charge == max(0, over - left)
    assert pool.left == left + max(0, reserved - used) - (over - charge)

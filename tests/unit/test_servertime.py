"""The control plane's measure of the NATS server's time (llmgw.bus.servertime)."""

from __future__ import annotations

import datetime
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.bus.servertime import KEPT, Sample, ServerTime, offset_of, unix_time

offsets = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)
sends = st.floats(min_value=1.6e9, max_value=2.0e9, allow_nan=False)
trips = st.lists(
    st.tuples(
        st.floats(min_value=0.0, max_value=5.0, allow_nan=False),  # round trip
        st.floats(min_value=0.0, max_value=1.0, allow_nan=False),  # where in it the store was
    ),
    min_size=1,
    max_size=KEPT,
)


def _samples(offset: float, sent: float, trips: list[tuple[float, float]]) -> list[Sample]:
    """Writes sent one second apart; the server (its clock `offset` ahead of the host's)
    stored each somewhere within its round trip."""
    out = []
    for i, (trip, where) in enumerate(trips):
        start = sent + i
        out.append(Sample(start, start + trip * where + offset, start + trip))
    return out


@given(offsets, sends, trips)
def test_the_offset_is_within_half_the_shortest_round_trip(
    offset: float, sent: float, trips: list[tuple[float, float]]
) -> None:
    found = offset_of(_samples(offset, sent, trips))
    assert found is not None
    estimate, uncertainty = found
    shortest = min(trip for trip, _ in trips)
    assert uncertainty == pytest.approx(shortest / 2, abs=1e-6)
    # Float rounding of UNIX times (~2e9) costs a few microseconds.
    assert abs(estimate - offset) <= uncertainty + 1e-5


@given(offsets, sends, trips)
def test_a_clock_reads_the_servers_time(
    offset: float, sent: float, trips: list[tuple[float, float]]
) -> None:
    now = [sent]
    clock = ServerTime(lambda: now[0])
    assert clock() == now[0]  # no measurement yet: the host's own
    for sample in _samples(offset, sent, trips):
        clock.observe(sample)
    now[0] = sent + 100.0
    assert abs(clock() - (now[0] + offset)) <= clock.uncertainty + 1e-5
    assert clock.wall() == now[0]


def test_unusable_samples_change_nothing() -> None:
    assert offset_of([]) is None
    backwards = Sample(10.0, 5.0, 9.0)  # received before sent: a clock stepped meanwhile
    endless = Sample(10.0, 5.0, math.inf)
    assert offset_of([backwards, endless]) is None
    clock = ServerTime(lambda: 100.0)
    clock.observe(backwards)
    assert clock() == 100.0


def test_only_the_last_measurements_count() -> None:
    clock = ServerTime(lambda: 0.0)
    clock.observe(Sample(0.0, 50.0, 0.0))  # exact, but old
    for i in range(KEPT):
        clock.observe(Sample(i, i + 0.5 - 7.0, i + 1.0))
    assert clock.offset == pytest.approx(-7.0)
    assert clock.uncertainty == pytest.approx(0.5)


instants = st.datetimes(
    min_value=datetime.datetime(2000, 1, 1), max_value=datetime.datetime(2200, 1, 1)
)


@given(instants, st.integers(min_value=0, max_value=999), st.booleans())
def test_the_servers_time_reads_as_it_writes_it(
    when: datetime.datetime, nanos: int, whole: bool
) -> None:
    # nats-server writes RFC 3339 in UTC with up to nine digits of a second, or none.
    base = when.replace(microsecond=0) if whole else when
    text = base.strftime("%Y-%m-%dT%H:%M:%S")
    if not whole:
        text += f".{base.microsecond:06d}{nanos:03d}"
    found = unix_time(text + "Z")
    expected = base.replace(tzinfo=datetime.UTC).timestamp() + (0 if whole else nanos / 1e9)
    assert found is not None
    assert found == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize(
    "text",
    ["", "now", "2026-12-05T16:55:19.x1Z", "2026-12-05T16:55:19+01:00", "2026-13-05T16:55:19Z"],
)
def test_what_is_not_the_servers_time_reads_as_none(text: str) -> None:
    assert unix_time(text) is None


steps = st.floats(min_value=-1e5, max_value=1e5, allow_nan=False)


def _measure(clock: ServerTime, at: float, offset: float) -> float:
    """One measurement at `at`, a quarter second into a half-second round trip, of a
    server `offset` ahead; how far it moved the time read."""
    return clock.observe(Sample(at, at + 0.25 + offset, at + 0.5))


def _measured(offset: float, sent: float, trips: list[tuple[float, float]]) -> ServerTime:
    """A clock that measured a server `offset` ahead over `trips` (`_samples`)."""
    clock = ServerTime(lambda: 0.0)
    for sample in _samples(offset, sent, trips):
        clock.observe(sample)
    return clock


@given(offsets, sends, trips, steps)
def test_two_measurements_that_agree_take_a_step_of_the_servers_clock(
    offset: float, sent: float, trips: list[tuple[float, float]], step: float
) -> None:
    clock = _measured(offset, sent, trips)
    # The server's clock jumps by `step`.
    after = sent + len(trips) + 10.0
    _measure(clock, after, offset + step)
    _measure(clock, after + 1.0, offset + step)
    # A step within what the measurements can tell apart (their ranges meet) may stay
    # hidden in them; a larger one is out with the second measurement.
    error = abs(clock.offset - (offset + step))
    assert error <= clock.uncertainty + 0.25 + 1e-5
    if abs(step) > 5.0 + 0.25 + 1e-5:  # beyond any two ranges here
        assert error <= clock.uncertainty + 1e-5
        assert clock.uncertainty == pytest.approx(0.25)


# Beyond any two ranges here (a round trip is at most 5 s): an answer that disagrees.
wrongs = st.floats(min_value=5.5, max_value=1e5) | st.floats(min_value=-1e5, max_value=-5.5)


@given(offsets, sends, trips, wrongs)
def test_one_wrong_answer_moves_nothing(
    offset: float, sent: float, trips: list[tuple[float, float]], wrong_by: float
) -> None:
    # A server (or a cluster's member with a bad clock) that answers once with a time
    # that is not its own: the leader would find every node lost at once on it.
    clock = _measured(offset, sent, trips)
    before, uncertainty = clock.offset, clock.uncertainty
    after = sent + len(trips) + 10.0
    moved = _measure(clock, after, offset + wrong_by)
    assert (moved, clock.offset, clock.uncertainty) == (0.0, before, uncertainty)
    _measure(clock, after + 1.0, offset)  # the server's own time again
    assert abs(clock.offset - offset) <= clock.uncertainty + 1e-5


def test_a_step_of_the_hosts_wall_clock_moves_no_reading() -> None:
    # An NTP step of the host's clock (after a pause of its machine, say): read on the
    # wall clock, "now" would be off by the step until the next measurement.
    wall, ticks = [1_000_000.0], [50.0]
    clock = ServerTime(lambda: wall[0], lambda: ticks[0])
    assert clock() == 1_000_000.0  # nothing measured: the host's wall clock
    assert _measure(clock, 50.0, 999_950.0 + 3.0) == pytest.approx(3.0)  # server 3 s ahead
    wall[0] += 3600.0
    ticks[0] += 1.0
    assert clock() == pytest.approx(1_000_004.0, abs=1e-6)  # the server's time still
    assert clock.offset == pytest.approx(4.0 - 3600.0, abs=1e-6)  # what the alert reports

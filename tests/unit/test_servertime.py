"""The control plane's measure of the NATS server's time (llmgw.control.servertime)."""

from __future__ import annotations

import datetime
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.bus.lease import unix_time
from llmgw.control.servertime import KEPT, Sample, ServerTime, offset_of

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


@given(offsets, sends, trips, st.floats(min_value=-1e5, max_value=1e5, allow_nan=False))
def test_one_measurement_takes_a_step_of_the_hosts_clock_out(
    offset: float, sent: float, trips: list[tuple[float, float]], step: float
) -> None:
    clock = ServerTime(lambda: 0.0)
    for sample in _samples(offset, sent, trips):
        clock.observe(sample)
    # The host's clock jumps by `step`: the server's is now `offset - step` ahead of it.
    after = sent + len(trips) + 10.0 + step
    clock.observe(Sample(after, after + 0.25 + offset - step, after + 0.5))
    # A step within what the measurements can tell apart (their ranges meet) may stay
    # hidden in them; a larger one is out at once.
    error = abs(clock.offset - (offset - step))
    assert error <= clock.uncertainty + 0.25 + 1e-5
    if abs(step) > 5.0 + 0.25 + 1e-5:  # beyond any two ranges here
        assert error <= clock.uncertainty + 1e-5
        assert clock.uncertainty == pytest.approx(0.25)

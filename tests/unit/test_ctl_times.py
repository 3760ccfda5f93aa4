"""`--at 03:12`: a time of day is the latest such moment (UTC) at or before now."""

from __future__ import annotations

import datetime as dt

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.ctl import history
from llmgw.ctl.errors import BadInput


@given(
    now=st.floats(1.6e9, 2.0e9),
    hour=st.integers(0, 23),
    minute=st.integers(0, 59),
    second=st.integers(0, 59),
)
def test_a_time_of_day_is_the_latest_such_moment_before_now(
    now: float, hour: int, minute: int, second: int
) -> None:
    for text in (f"{hour:02d}:{minute:02d}:{second:02d}", f"{hour}:{minute:02d}:{second:02d}Z"):
        when = history.parse_time(text, now)
        assert now - 86400 < when <= now
        t = dt.datetime.fromtimestamp(when, dt.UTC)
        assert (t.hour, t.minute, t.second) == (hour, minute, second)


@pytest.mark.parametrize("text", ["24:00", "03:60", "3:1", "03:12:61", "03:12pm", ":12"])
def test_a_malformed_time_of_day_says_what_works(text: str) -> None:
    with pytest.raises(BadInput, match="a time of day in UTC"):
        history.parse_time(text, 1.8e9)


@given(
    text=st.text(max_size=30)
    | st.from_regex(r"@[-+]?(inf|nan|[0-9]{1,400}(e[0-9]{1,4})?)", fullmatch=True)
    | st.from_regex(r"[0-9²٣]{1,30}(s|m|h|d)?( ago)?", fullmatch=True)
)
def test_any_text_is_a_point_or_bad_input_never_another_error(text: str) -> None:
    # What a console visitor or `ctl replay --at` passes: read, or refused with what to use.
    try:
        point = history.parse_point(text, 1.8e9)
    except BadInput as exc:
        refusal = str(exc)
        point = None
    if point is None:
        assert len(refusal) < 400  # the text is quoted shortened, however long
    elif point.time is not None:
        assert 0 <= point.time <= 253402300799
        history.format_time(point.time)
    else:
        assert point.seq is not None
        assert point.seq >= 0


@pytest.mark.parametrize(
    "text", ["@inf", "@nan", "@-1e300", "²", "9" * 4400, "99999999999999d", "٣m"]
)
def test_points_a_caller_could_use_to_break_the_console_are_refused(text: str) -> None:
    with pytest.raises(BadInput):
        history.parse_point(text, 1.8e9)

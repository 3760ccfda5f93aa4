"""What `llmgw ctl key` and `llmgw ctl usage` make of an operator's flags and show back
(llmgw.ctl.keys, llmgw.ctl.usage): durations in their units and bounds, limits turned
off, a key's row at the moment it expires, usage summed by key and model. Pure."""

from __future__ import annotations

import datetime as dt
import time

import pytest

from llmgw.core import subjects, tenancy
from llmgw.core.state import KeyState
from llmgw.ctl import keys, usage
from llmgw.ctl.errors import BadInput

NOW = dt.datetime(2026, 12, 2, 10, 30, tzinfo=dt.UTC).timestamp()


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90.0), ("90s", 90.0), ("30m", 1800.0), ("1h", 3600.0), ("2d", 172800.0), ("0", 0.0)],
)
def test_a_duration_is_read_in_its_unit(text: str, seconds: float) -> None:
    assert keys.duration(text, "--overlap") == seconds


def test_a_duration_past_its_bound_says_the_bound() -> None:
    assert keys.duration("2d", "--since", most_s=2 * 86_400.0) == 2 * 86_400.0
    with pytest.raises(BadInput, match="between 0 and 2 days"):
        keys.duration("172801", "--since", most_s=2 * 86_400.0)
    with pytest.raises(BadInput, match="between 0 and 30 days"):
        keys.duration("31d", "--overlap")


def test_an_expiry_without_a_zone_is_utc_and_one_in_the_past_is_refused() -> None:
    assert keys.expiry("2027-01-31", NOW) == dt.datetime(2027, 1, 31, tzinfo=dt.UTC).timestamp()
    assert keys.expiry("+1h", NOW) == NOW + 3600
    assert keys.expiry("never", NOW) is None
    with pytest.raises(BadInput, match="in the past"):
        keys.expiry("2026-12-02T10:30:00Z", NOW)  # now is not later than now


def test_zero_or_none_turns_a_limit_and_a_budget_off() -> None:
    base = keys.settings("a", keys.Flags(rps="5", tpm="1k", budget="2M/day"), NOW)
    assert (base.requests_per_s, base.tokens_per_min, base.budget_tokens) == (5, 1000, 2_000_000)
    for off in ("0", "none", "None"):
        flags = keys.Flags(rps=off, tpm=off, budget=off)
        made = keys.settings("a", flags, NOW, base=base)
        assert (made.requests_per_s, made.tokens_per_min, made.budget_tokens) == (None, None, None)


def test_flags_are_trimmed_and_models_listed_once_in_order() -> None:
    made = keys.settings("a", keys.Flags(team=" red ", models=("m2", " m1", "m2")), NOW)
    assert made.team == "red"
    assert made.models == ("m2", "m1")


def test_an_unknown_priority_is_refused_naming_the_three() -> None:
    with pytest.raises(BadInput, match="one of high, normal, low"):
        keys.settings("a", keys.Flags(priority="urgent"), NOW)
    assert keys.settings("a", keys.Flags(priority="low"), NOW).priority == "low"


def test_what_the_fold_would_refuse_is_refused_before_publishing() -> None:
    # A team name the log's schema refuses: BadInput now, not a write the fold drops.
    with pytest.raises(BadInput, match="key 'a'"):
        keys.settings("a", keys.Flags(team="x" * 1000), NOW)


def _key(**settings: object) -> KeyState:
    return KeyState(settings=tenancy.KeySettings(name="a", **settings), sha256="f" * 64,  # type: ignore[arg-type]
                    created_by="alice", created_ts=NOW - 60)  # fmt: skip


def test_a_key_is_expired_from_its_expiry_on() -> None:
    key = _key(expires_at=NOW)
    assert keys.row(key, NOW - 0.5)["expired"] is False
    assert keys.row(key, NOW)["expired"] is True
    (row,) = keys.table_rows({"a": key}, NOW)
    assert row[4].startswith("expired 2026-12-02 10:30")


def test_a_key_row_shows_a_budget_period_only_with_a_budget() -> None:
    assert keys.row(_key(), NOW)["budget_period"] is None
    assert keys.row(_key(budget_tokens=100, budget_period="month"), NOW)["budget_period"] == (
        "month"
    )


def test_an_old_secret_is_shown_only_while_it_still_works() -> None:
    key = _key()
    key.previous_sha256 = "e" * 64
    key.previous_until = NOW + 60
    assert keys.row(key, NOW)["previous_valid_until"] == NOW + 60
    assert any("old secret" in line for line in keys.show_lines(key, NOW))
    assert keys.row(key, NOW + 61)["previous_valid_until"] is None
    assert not any("old secret" in line for line in keys.show_lines(key, NOW + 61))


def test_the_limits_column_leaves_out_team_and_models() -> None:
    (row,) = keys.table_rows({"a": _key(team="red", models=("m1",), requests_per_s=5)}, NOW)
    assert row[1:4] == ["red", "m1", "5 req/s"]


def test_an_unknown_key_names_those_there_are() -> None:
    with pytest.raises(BadInput, match="keys: a"):
        keys.require({"a": _key()}, "b")


def _usage(key: str, hour: int, model: str, what: str) -> str:
    return subjects.usage_counter(key, hour, model, what)


def test_usage_sums_each_key_and_model_from_the_hour_asked_on() -> None:
    totals = {
        _usage("a", 100, "m1", "req"): 2,
        _usage("a", 101, "m1", "req"): 3,
        _usage("a", 101, "m1", "in"): 40,
        _usage("a", 101, "m1", "out"): 7,
        _usage("a", 99, "m1", "req"): 1000,  # before the span asked for
        _usage("a", 101, "m2", "req"): 1,
        _usage("gone", 101, "m1", "req"): 1,
    }
    rows = usage.rows(totals, {"a": _key(team="red")}, since_hour=100)
    assert rows == [
        {"key": "a", "team": "red", "model": "m1", "requests": 5, "tokens_in": 40,
         "tokens_out": 7},
        {"key": "a", "team": "red", "model": "m2", "requests": 1, "tokens_in": 0,
         "tokens_out": 0},
        {"key": "gone", "team": "", "model": "m1", "requests": 1, "tokens_in": 0,
         "tokens_out": 0},
    ]  # fmt: skip


def test_a_budget_spent_past_its_amount_has_none_left_not_less() -> None:
    key = _key(budget_tokens=100, budget_period="day")
    period = tenancy.period_of(NOW, "day")
    totals = {subjects.budget_counter("a", period): 130}
    (b,) = usage.budgets(totals, {"a": key, "free": _key()}, NOW)
    assert (b["key"], b["used"], b["budget"], b["left"]) == ("a", 130, 100, 0)
    assert b["renews_at"] == dt.datetime(2026, 12, 3, tzinfo=dt.UTC).timestamp()


def test_an_expiry_without_a_zone_is_utc_on_a_machine_of_another_zone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        assert keys.expiry("2027-01-31T12:00", NOW) == (
            dt.datetime(2027, 1, 31, 12, tzinfo=dt.UTC).timestamp()
        )
    finally:
        monkeypatch.undo()
        time.tzset()

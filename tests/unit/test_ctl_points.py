"""Points of the log at their edges, as `ctl replay --at / --diff` and `ctl events --since`
read them: the first moment allowed, a time of day that is now. Pure.
"""

from __future__ import annotations

import datetime as dt

import pytest
from typer.testing import CliRunner

from llmgw.cli.main import app
from llmgw.ctl import history
from llmgw.ctl.errors import BadInput

AT_0312 = dt.datetime(2026, 11, 29, 3, 12, tzinfo=dt.UTC).timestamp()


def test_a_time_of_day_that_is_now_is_today_not_yesterday() -> None:
    # "the latest 03:12 at or before now": at 03:12:00 sharp, that is now itself.
    assert history.parse_time("03:12", AT_0312) == AT_0312
    assert history.parse_time("03:12:00Z", AT_0312) == AT_0312
    assert history.parse_time("03:12:01", AT_0312) == AT_0312 + 1 - 86400


def test_the_first_moment_of_1970_is_a_time() -> None:
    assert history.parse_time("@0", AT_0312) == 0.0
    assert history.parse_time("1970-01-01T00:00:00Z", AT_0312) == 0.0
    assert history.parse_point("@0", AT_0312) == history.Point(time=0.0)


def test_a_sequence_has_at_most_20_digits() -> None:
    assert history.parse_point("9" * 20, AT_0312) == history.Point(seq=int("9" * 20))
    with pytest.raises(BadInput, match="at most 20 digits"):
        history.parse_point("1" + "0" * 20, AT_0312)


def test_replay_refuses_two_modes_at_once_before_connecting() -> None:
    # No server: an exit 2 here is the flags' check, not a failed connection.
    offline = ["--server", "nats://127.0.0.1:1"]
    for args in (
        ["replay", "--timeline", "node-a", "--to", "5"],
        ["replay", "--diff", "1", "2", "--at", "10m"],
        ["replay", "--verify", "--timeline", "node-a"],
        ["events", "--seq", "0"],
    ):
        result = CliRunner().invoke(app, ["ctl", *args, *offline])
        assert result.exit_code == 2, (args, result.output)
        assert "error:" in result.output


def test_verify_says_which_epochs_the_control_config_was_used_for() -> None:
    from pathlib import Path

    from llmgw.cli.ctl_history import _timings_notes
    from llmgw.control.verify import Timings
    from llmgw.core.reconcile import ReconcileConfig

    given = Path("control.yaml")
    every = Timings(by_epoch={1: ReconcileConfig(), 2: ReconcileConfig()})
    (note,) = _timings_notes(every, str(given), given)
    assert note.endswith(
        "(epochs 1, 2) (--control-config applies only to epochs that recorded none)"
    )
    some = Timings(by_epoch={2: ReconcileConfig()}, unrecorded=(1,))
    recorded, older = _timings_notes(some, str(given), given)
    assert recorded.endswith("(epochs 2)")  # the file was used, for epoch 1
    assert older == (
        "epochs 1 recorded no timings (a log from an older llmgw): checked with control.yaml"
    )
    (hint,) = _timings_notes(
        Timings(by_epoch={}, unrecorded=tuple(range(1, 13))), "the defaults", None
    )
    assert hint.startswith("epochs 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 ... recorded no timings")
    assert hint.endswith(
        ": pass --control-config with that leader's config file if its timings differ"
    )

"""What a newcomer reads first: counted nouns agree with their number, help says what
each option is for."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from llmgw import wording
from llmgw.cli.main import app


@pytest.mark.parametrize(
    ("n", "text"), [(0, "0 models"), (1, "1 model"), (2, "2 models"), (1500, "1,500 models")]
)
def test_count_agrees_with_its_number(n: int, text: str) -> None:
    assert wording.count(n, "model") == text


def test_count_takes_an_irregular_plural() -> None:
    assert wording.count(2, "replica set", "replica sets") == "2 replica sets"
    assert wording.count(1, "entry", "entries") == "1 entry"


def help_text(*command: str) -> str:
    done = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
    assert done.exit_code == 0, done.output
    return done.output


def test_events_help_says_json_plainly() -> None:
    text = help_text("ctl", "events")
    assert "One JSON object per line." in text
    assert "common." not in text


def test_every_ctl_option_has_help() -> None:
    text = help_text("ctl", "drain")
    reason = next(line for line in text.splitlines() if "--reason" in line)
    assert "recorded in the log" in reason

"""schemas/ must match the Structs: a changed event cannot ship without its schema."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmgw import schemas
from llmgw.cli.main import app

ROOT = Path(__file__).resolve().parents[2]


def test_checked_in_schemas_match_the_code() -> None:
    drift = schemas.drift(ROOT / "schemas")
    assert drift == [], f"schemas/ is stale ({drift}): run `llmgw schemas --write`"


def test_drift_is_detected(tmp_path: Path) -> None:
    schemas.write(tmp_path)
    assert schemas.drift(tmp_path) == []
    (tmp_path / "events.schema.json").write_text("{}\n")
    (tmp_path / "gone.schema.json").write_text("{}\n")
    assert schemas.drift(tmp_path) == ["events.schema.json", "gone.schema.json"]


def test_event_schema_is_a_tagged_union_of_every_type() -> None:
    import json

    schema = json.loads((ROOT / "schemas" / "events.schema.json").read_text())
    mapping = schema["discriminator"]["mapping"] if "discriminator" in schema else {}
    from llmgw.core import events

    assert set(mapping) == set(events.BY_TAG)


@pytest.mark.parametrize("write", [True, False])
def test_a_dir_that_cannot_hold_the_schemas_is_one_line(tmp_path: Path, write: bool) -> None:
    # `llmgw schemas --write --dir` under a file ended in a NotADirectoryError traceback.
    (tmp_path / "notes").write_text("a file\n")
    args = ["schemas", "--dir", str(tmp_path / "notes" / "schemas"), *(["--write"] * write)]
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 2 if write else result.exit_code == 1
    assert "notes" in result.output

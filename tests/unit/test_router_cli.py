"""`llmgw router check` and `hash-key`; the example config in deploy/ stays valid."""

from __future__ import annotations

from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from llmgw.cli.main import app
from llmgw.router import auth
from llmgw.router import config as rc

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def test_example_config_loads(tmp_path: Path) -> None:
    data = yaml.safe_load((ROOT / "deploy" / "router.example.yaml").read_text())
    data["auth"]["keys_file"] = str(tmp_path / "keys.yaml")
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(data))
    (tmp_path / "keys.yaml").write_text("keys:\n" + auth.entry_yaml("t", auth.new_key()))
    cfg = rc.load(path)
    assert cfg.workers == 2
    assert rc.model_names(cfg)["default"].name == "llama-3-8b"
    result = runner.invoke(app, ["router", "check", "--config", str(path)])
    assert result.exit_code == 0, result.output
    assert "3 endpoints: ok" in result.output


def test_check_refuses_a_bad_config_with_what_to_change(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(
        "auth: {allow_anonymous: true}\nmodels: [{name: m, aliases: [m]}]\n"
        "endpoints: [{id: a, url: 'http://x:1', models: [m]},"
        " {id: a, url: 'http://y:1', models: [m]}]\n"
    )
    result = runner.invoke(app, ["router", "check", "--config", str(path)])
    assert result.exit_code == 2
    assert "shadows the model" in result.output
    assert "used twice" in result.output


def test_hash_key_prints_an_entry_that_matches_the_key() -> None:
    result = runner.invoke(app, ["router", "hash-key", "--name", "ops", "--stdin"], input="k-123\n")
    assert result.exit_code == 0, result.output
    entry = yaml.safe_load("keys:\n" + result.stdout)["keys"][0]
    assert entry["sha256"] == auth.digest("k-123")
    assert entry["models"] == ["*"]
    fresh = runner.invoke(app, ["router", "hash-key", "--name", "x", "-m", "a", "-m", "b"])
    assert fresh.exit_code == 0
    assert '["a", "b"]' in fresh.stdout


@settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.text(min_size=1, max_size=30), models=st.lists(st.text(max_size=20), max_size=3))
def test_an_entry_of_any_name_and_models_loads_as_written(
    tmp_path: Path, name: str, models: list[str]
) -> None:
    # `--name 'a"b'` wrote `name: "a"b"`: appended with `>>`, the whole keys file stopped
    # loading (the router refused to start, a reload kept the old keys), and the key just
    # handed out could never be used.
    key = auth.new_key()
    path = tmp_path / "keys.yaml"
    path.write_text("keys:\n" + auth.entry_yaml(name, key, tuple(models) or ("*",)))
    (entry,) = auth.load_keys(path, 0.0).by_digest.values()
    assert entry.name == name
    assert entry.models == frozenset(models or ["*"])

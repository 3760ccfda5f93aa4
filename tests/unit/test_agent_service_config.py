"""The agent service's settings: the shipped example config, the new checks, the run command."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from llmgw import config
from llmgw.agent import config as agent_config
from llmgw.cli.main import app

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "agent.example.yaml"


def test_the_example_config_loads() -> None:
    cfg = agent_config.load(EXAMPLE, environ={})
    assert cfg.node_id == "gpu-07"
    assert cfg.fabrics[0].hcas == ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3")
    assert cfg.heartbeat_ttl_s > cfg.heartbeat_s
    assert cfg.state_dir == "/var/lib/llmgw/agent"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"heartbeat_s": 10, "heartbeat_ttl_s": 5}, "at least heartbeat_s"),
        ({"heartbeat_ttl_s": 0.5}, "whole seconds"),
        ({"heartbeat_s": 0}, "must be positive"),
        ({"engine_poll_s": -1}, "must be positive"),
        ({"outbox_max_events": 0}, "outbox_max_events"),
    ],
)
def test_bad_service_settings_say_what_to_change(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(config.ConfigError, match=message):
        agent_config.load(overrides={"node_id": "n", **overrides}, environ={})


def test_run_command_needs_a_config_and_checks_it(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["agent", "--check"])
    assert result.exit_code == 2
    assert "give --config FILE" in result.output
    # The example names certificates where a deployed node keeps them: --check says which
    # file is missing and what to do, rather than ok for an agent that could not connect.
    result = runner.invoke(app, ["agent", "--config", str(EXAMPLE), "--check"])
    assert result.exit_code == 2, result.output
    assert "nats.ca_file: /etc/llmgw/certs/ca.pem does not exist" in result.output
    assert "fix the path or copy the file there" in result.output
    # With those files present, the same config is ok (tests/unit/test_check_files.py
    # checks real certificates).
    local = tmp_path / "agent.yaml"
    example = yaml.safe_load(EXAMPLE.read_text())
    example.pop("nats", None)
    example["state_dir"] = str(tmp_path / "state")
    local.write_text(yaml.safe_dump(example))
    result = runner.invoke(app, ["agent", "--config", str(local), "--check"])
    assert result.exit_code == 0, result.output
    assert "node 'gpu-07'" in result.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("node_id: not.a.token\n")
    result = runner.invoke(app, ["agent", "--config", str(bad)])
    assert result.exit_code == 2
    assert "node_id" in result.output

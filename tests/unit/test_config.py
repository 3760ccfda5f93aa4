"""Config loading: environment variables are read as their setting's type, errors name
the variable, and ports outside 0-65535 are refused before anything binds."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from llmgw import config
from llmgw.agent.config import AgentConfig
from llmgw.cli.main import app
from llmgw.router.config import RouterConfig
from llmgw.sim.config import SimConfig

runner = CliRunner()
ANON = {"LLMGW_ROUTER__AUTH__ALLOW_ANONYMOUS": "true"}


def router(env: dict[str, str]) -> RouterConfig:
    return config.load(RouterConfig, section="ROUTER", environ={**ANON, **env})


def test_a_string_setting_takes_the_text_as_it_is() -> None:
    for raw in ("0123", "on", "yes", "null", "1e3", "[a]", " spaced "):
        cfg = config.load(AgentConfig, section="AGENT", environ={"LLMGW_AGENT__NODE_ID": raw})
        assert cfg.node_id == raw


@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")))
def test_any_text_reaches_a_string_setting_unchanged(raw: str) -> None:
    cfg = config.load(AgentConfig, section="AGENT", environ={"LLMGW_AGENT__NODE_ID": raw})
    assert cfg.node_id == raw


def test_numbers_booleans_none_and_lists_are_parsed_for_their_settings() -> None:
    cfg = router(
        {
            "LLMGW_ROUTER__LISTEN__PORT": "09001",
            "LLMGW_ROUTER__WEIGHTS__QUEUE": "3.5",
            "LLMGW_ROUTER__COUNT_STREAM_TOKENS": "off",
            "LLMGW_ROUTER__SEED": "null",
            "LLMGW_ROUTER__MODELS": "[{name: a}]",
        }
    )
    assert cfg.listen.port == 9001  # decimal: a leading zero is not octal
    assert cfg.weights.queue == 3.5
    assert cfg.count_stream_tokens is False
    assert cfg.seed is None
    assert [m.name for m in cfg.models] == ["a"]
    assert router({"LLMGW_ROUTER__SEED": "42"}).seed == 42


@given(st.integers().filter(lambda p: not 0 <= p <= 65535))
def test_a_port_out_of_range_is_refused_naming_the_variable(port: int) -> None:
    with pytest.raises(config.ConfigError) as info:
        router({"LLMGW_ROUTER__LISTEN__PORT": str(port)})
    assert str(info.value).startswith(f"LLMGW_ROUTER__LISTEN__PORT='{port}': ")


@given(st.integers(0, 65535))
def test_a_port_in_range_is_taken(port: int) -> None:
    assert router({"LLMGW_ROUTER__LISTEN__PORT": str(port)}).listen.port == port


@pytest.mark.parametrize(
    ("name", "raw", "says"),
    [
        ("LLMGW_ROUTER__LISTEN__PORT", "abc", "is not a whole number"),
        ("LLMGW_ROUTER__COUNT_STREAM_TOKENS", "maybe", "is not true or false"),
        ("LLMGW_ROUTER__LISTEN__PROT", "1", "there is no setting listen.prot"),
        ("LLMGW_ROUTER__MODELS", "[a", "is not valid YAML"),
        ("LLMGW_ROUTER__MODELS", "[{nam: a}]", "unknown field"),
    ],
)
def test_a_bad_variable_is_named_in_the_error(name: str, raw: str, says: str) -> None:
    with pytest.raises(config.ConfigError) as info:
        router({name: raw})
    text = str(info.value)
    assert text.startswith(name), text
    assert says in text


def test_a_bad_file_value_still_blames_the_file(tmp_path: Path) -> None:
    path = tmp_path / "sim.yaml"
    path.write_text("port: 99999\n")
    with pytest.raises(config.ConfigError) as info:
        config.load(SimConfig, path, section="SIM", environ={})
    assert str(info.value).startswith(f"{path}: ")
    assert "65535" in str(info.value)


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_router_check_refuses_a_port_out_of_range(tmp_path: Path, port: str) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(f"auth: {{allow_anonymous: true}}\nlisten: {{port: {port}}}\n")
    result = runner.invoke(app, ["router", "check", "--config", str(path)], env={})
    assert result.exit_code == 2, result.output
    assert "listen.port" in result.output
    (tmp_path / "ok.yaml").write_text("auth: {allow_anonymous: true}\n")
    result = runner.invoke(
        app,
        ["router", "check", "--config", str(tmp_path / "ok.yaml")],
        env={"LLMGW_ROUTER__LISTEN__PORT": port},
    )
    assert result.exit_code == 2, result.output
    assert "LLMGW_ROUTER__LISTEN__PORT" in result.output

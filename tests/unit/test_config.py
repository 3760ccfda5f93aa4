"""Config loading: environment variables are read as their setting's type, errors name
the variable, and ports outside 0-65535 are refused before anything binds."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from llmgw import config
from llmgw.agent import config as agent_config
from llmgw.agent.config import AgentConfig
from llmgw.cli.main import app
from llmgw.control import config as control_config
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


# A value a variable set fails a check made after loading (a duration above 0, a port
# range): the problem is reported against the file, which does not hold the value, so it
# names the variable too.


def test_a_problem_names_the_variable_that_set_its_setting(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("auth: {allow_anonymous: true}\n")
    env = {"LLMGW_ROUTER__BODY_TIMEOUT_S": "-1", "LLMGW_ROUTER__SEED": "3"}
    result = runner.invoke(app, ["router", "check", "--config", str(path)], env=env)
    assert result.exit_code == 2, result.output
    line = next(x for x in result.output.splitlines() if "body_timeout_s" in x)
    assert "LLMGW_ROUTER__BODY_TIMEOUT_S='-1' set it" in line, line
    assert "SEED" not in result.output
    result = runner.invoke(app, ["router", "check", "--config", str(path)], env={})
    assert result.exit_code == 0, result.output


def test_an_agent_problem_names_the_variable_of_a_setting_in_its_section() -> None:
    env = {"LLMGW_AGENT__ENGINE_PORTS__FIRST": "9000", "LLMGW_AGENT__ENGINE_PORTS__LAST": "8000"}
    with pytest.raises(config.ConfigError) as info:
        agent_config.load(environ=env, hostname="n1")
    text = str(info.value)
    assert text.startswith("engine_ports 9000-8000 is not a port range"), text
    assert "LLMGW_AGENT__ENGINE_PORTS__FIRST='9000'" in text
    assert "LLMGW_AGENT__ENGINE_PORTS__LAST='8000'" in text


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("-1", "shutdown_timeout_s must be 0-3600 seconds"),
        ("7200", "shutdown_timeout_s must be 0-3600 seconds"),
        ("inf", "give a finite number"),
        ("nan", "give a finite number"),
    ],
)
def test_the_sims_shutdown_grace_is_bounded(value: str, says: str) -> None:
    result = runner.invoke(app, ["sim", "--served-model-name", "m", "--shutdown-timeout-s", value])
    assert result.exit_code == 2, result.output
    assert says in result.output


def test_sim_problems_name_their_variables() -> None:
    env = {"LLMGW_SIM__LOAD_S": "7200"}
    result = runner.invoke(app, ["sim", "--served-model-name", "m"], env=env)
    assert result.exit_code == 2, result.output
    assert "load_s must be 0-3600 seconds, not 7200" in result.output
    assert "LLMGW_SIM__LOAD_S='7200' set it" in result.output


_KEY = st.from_regex(r"[a-h]([a-h_]{0,6}[a-h])?", fullmatch=True).filter(lambda k: "__" not in k)


@given(st.lists(_KEY, min_size=1, max_size=3), st.lists(_KEY, min_size=1, max_size=3))
def test_only_a_problem_naming_the_setting_or_its_section_names_the_variable(
    keys: list[str], other: list[str]
) -> None:
    name = "LLMGW_S__" + "__".join(k.upper() for k in keys)
    path = ".".join(keys)
    problems = [f"{path} is wrong", f"x.{path} is wrong", f"{path}x is wrong", "nothing here"]
    out = config.name_variables(problems, "S", {name: "v", "LLMGW_T__X": "w"})
    assert len(out) == len(problems)
    assert out[0] == f"{path} is wrong ({name}='v' set it: change the variable or unset it)"
    assert out[1:] == problems[1:]  # another setting's path, a longer name, none
    # A section above the setting counts only when its name is no plain word.
    section = ".".join(other)
    deeper = config.name_variables([f"{section} is wrong"], "S", {
        "LLMGW_S__" + "__".join(k.upper() for k in [*other, "leaf"]): "v"})  # fmt: skip
    assert ("set it" in deeper[0]) == ("_" in section or "." in section)


def _control_refused(path: Path) -> list[str]:
    """The lines of the error a control config at `path` is refused with."""
    with pytest.raises(config.ConfigError) as info:
        control_config.load(path)
    return str(info.value).splitlines()


def test_a_control_problem_names_its_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "control.yaml"
    path.write_text("name: c1\n")
    monkeypatch.setenv("LLMGW_CONTROL__LEASE_TTL_S", "0")
    lines = _control_refused(path)
    line = next(x for x in lines if "lease_ttl_s" in x)
    assert line.startswith(f"{path}: lease_ttl_s is 0.0")
    assert line.endswith("(LLMGW_CONTROL__LEASE_TTL_S='0' set it: change the variable or unset it)")
    assert all("LLMGW_" not in x for x in lines if x != line)


@given(st.text(min_size=1, max_size=200).filter(lambda s: "\x00" not in s))
def test_an_error_never_shows_a_secret_settings_value(secret: str) -> None:
    # Errors reach terminals and logs: a key's value is never in one, nor a long value
    # (YAML holding a list of endpoints may carry their keys).
    with pytest.raises(config.ConfigError) as info:
        config.load(SimConfig, section="SIM",
                    environ={"LLMGW_SIM__API_KEY": secret, "LLMGW_SIM__PORT": "99999"})  # fmt: skip
    assert info.value.args[0].startswith("LLMGW_SIM__PORT='99999': ")
    env = {"LLMGW_SIM__API_KEY": secret, "LLMGW_SIM__PORT": "9" * 65}
    named = config.name_variables(["api_key is wrong", "port is wrong"], "SIM", env)
    assert named == [
        "api_key is wrong (LLMGW_SIM__API_KEY set it: change the variable or unset it)",
        "port is wrong (LLMGW_SIM__PORT set it: change the variable or unset it)",
    ]


# A setting named by a plain word (`name`, `host`, `address`) is named by a problem only
# where the problem is about it: at its start, as a list's index, or in backticks. The same
# word in a hint, another setting's sentence or a model's problem is not the setting.


def test_a_plain_word_in_a_hint_or_a_models_problem_names_no_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "control.yaml"
    path.write_text("models: [{name: m, engine: vllm, model: x, aliases: [m]}]\n")
    monkeypatch.setenv("LLMGW_CONTROL__NAME", "ctl-a")
    said = "\n".join(_control_refused(path))
    # The nats hints say `<name>`, the model's problem "its own name": neither is the CN.
    assert "repeats the model's own name" in said
    assert "LLMGW_CONTROL__NAME" not in said, said
    monkeypatch.setenv("LLMGW_CONTROL__NAME", "ctl.a")  # the setting's own problem: named
    line = next(x for x in _control_refused(path) if "'ctl.a'" in x)
    assert "(LLMGW_CONTROL__NAME='ctl.a' set it" in line, line
    env = {"LLMGW_SIM__HOST": "0.0.0.0"}  # the OTLP hint's http://host:4318
    result = runner.invoke(app, ["sim", "--served-model-name", "m", "--otlp-traces-endpoint",
                                 "grpc://c:4317"], env=env)  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "LLMGW_SIM__HOST" not in result.output, result.output
    env = {"LLMGW_AGENT__ADDRESS": "10.0.0.5"}  # "the collector's address"
    with pytest.raises(config.ConfigError) as info:
        agent_config.load(overrides={"traces": {"collector": "x"}}, environ=env, hostname="n1")
    assert "collector's address" in str(info.value)
    assert "LLMGW_AGENT__ADDRESS" not in str(info.value), str(info.value)


def test_a_list_setting_is_named_where_a_problem_indexes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from llmgw.router import config as router_config

    for name, value in {**ANON, "LLMGW_ROUTER__MODELS": "[{name: m}, {name: m}]"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(config.ConfigError) as info:
        router_config.load(None)
    line = next(x for x in str(info.value).splitlines() if "declared twice" in x)
    assert "(LLMGW_ROUTER__MODELS='[{name: m}, {name: m}]' set it" in line, line


def test_a_flag_that_set_the_value_is_blamed_not_the_variable_it_overrode() -> None:
    # `llmgw sim` flags win over LLMGW_SIM__* variables: the value in the problem is the
    # flag's, and changing or unsetting the variable would change nothing.
    env = {"LLMGW_SIM__LOAD_S": "5", "LLMGW_SIM__PORT": "8001"}
    result = runner.invoke(app, ["sim", "--served-model-name", "m", "--load-s", "7200"], env=env)
    assert result.exit_code == 2, result.output
    assert "load_s must be 0-3600 seconds, not 7200" in result.output
    assert "LLMGW_SIM__LOAD_S" not in result.output, result.output
    result = runner.invoke(app, ["sim", "--served-model-name", "m", "--port", "99999"], env=env)
    assert result.exit_code == 2, result.output
    assert "65535" in result.output
    assert "LLMGW_SIM__PORT" not in result.output, result.output
    flags = {"load_s": 7200.0}
    named = config.name_variables(["load_s is wrong", "port is wrong"], "SIM", env, overrides=flags)
    assert named[0] == "load_s is wrong"
    assert named[1].startswith("port is wrong (LLMGW_SIM__PORT='8001' set it")


@given(st.from_regex(r"[a-z]{1,8}:[A-Za-z0-9]{4,20}", fullmatch=True))
def test_an_error_never_shows_a_password_in_a_urls_value(userinfo: str) -> None:
    # A NATS or collector URL may carry its credentials (tls://user:password@host): the
    # setting's name says nothing of a secret, but its value holds one.
    url = f"tls://{userinfo}@nats.example:4222"
    env = {"LLMGW_ROUTER__LOG__SERVERS": url}  # a URL where a list belongs
    with pytest.raises(config.ConfigError) as info:
        config.load(RouterConfig, section="ROUTER", environ={**ANON, **env})
    assert "LLMGW_ROUTER__LOG__SERVERS" in str(info.value)
    assert userinfo not in str(info.value)
    named = config.name_variables(["traces.endpoint is wrong"], "ROUTER", {
        "LLMGW_ROUTER__TRACES__ENDPOINT": f"http://{userinfo}@c:4318"})  # fmt: skip
    assert named == [
        "traces.endpoint is wrong (LLMGW_ROUTER__TRACES__ENDPOINT set it: change the variable"
        " or unset it)"
    ]


@pytest.mark.parametrize("setting", ["token", "hf_token", "secret", "password", "key_passphrase"])
def test_a_variable_named_like_a_secret_is_named_without_its_value(setting: str) -> None:
    env = {f"LLMGW_X__{setting.upper()}": "hunter2"}
    [named] = config.name_variables([f"{setting} is wrong"], "X", env)
    assert named == (
        f"{setting} is wrong (LLMGW_X__{setting.upper()} set it: change the variable or unset it)"
    )


def test_an_empty_file_is_no_settings(tmp_path: Path) -> None:
    path = tmp_path / "sim.yaml"
    path.write_text("# nothing set yet\n")
    assert config.read_yaml(path) == {}
    assert config.load(SimConfig, path, section="SIM", environ={}) == SimConfig()


@pytest.mark.parametrize(
    ("name", "raw", "says"),
    [
        ("LLMGW_AGENT__KV_EVENTS", "y", "is not true or false"),  # only true/yes/on/1
        ("LLMGW_AGENT__HEARTBEAT_S", "inf", "is not a finite number"),
        ("LLMGW_AGENT__HEARTBEAT_S", "-Infinity", "is not a finite number"),
    ],
)
def test_an_agent_variable_that_is_no_value_of_its_setting_is_refused(
    name: str, raw: str, says: str
) -> None:
    with pytest.raises(config.ConfigError) as info:
        config.load(AgentConfig, section="AGENT", environ={name: raw})
    assert info.value.args[0].startswith(f"{name}={raw!r} {says}")


@pytest.mark.parametrize("raw", ["", "null", "NULL", "None", "~"])
def test_an_optional_section_is_unset_by_any_spelling_of_null(raw: str) -> None:
    env = {"LLMGW_AGENT__TRACES": raw}
    assert config.load(AgentConfig, section="AGENT", environ=env).traces is None

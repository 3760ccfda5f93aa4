"""Configuration files an operator got wrong, or an attacker wrote: every loader (router,
control, agent, sim, ctl settings, keys files, models.yaml, simulated inventories) answers
with its own error saying what to do, never another exception, a hang, or gigabytes of
memory."""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from llmgw import config
from llmgw.agent import config as agent_config
from llmgw.agent.discovery import simulated
from llmgw.cli.main import app
from llmgw.control import config as control_config
from llmgw.ctl import catalogfile
from llmgw.ctl import settings as ctl_settings
from llmgw.ctl.errors import BadInput
from llmgw.router import auth
from llmgw.router import config as router_config
from llmgw.sim.config import SimConfig

runner = CliRunner()
REFUSALS = (config.ConfigError, BadInput, simulated.SimSpecError)


LOADERS: dict[str, Callable[[Path], object]] = {
    "router": router_config.load,
    "control": control_config.load,
    "agent": lambda p: agent_config.load(p, environ={}, hostname="node-1"),
    "sim": lambda p: config.load(SimConfig, p, section="SIM", environ={}),
    "ctl": lambda p: ctl_settings.load(p, environ={}),
    "keys": lambda p: auth.load_keys(p, 0.0),
    "models": catalogfile.read,
    "inventory": lambda p: simulated.load(str(p)),
}


def _refused(loader: str, path: Path) -> str:
    """The refusal, with the file's path as <file> (the test's name is in the path)."""
    with pytest.raises(REFUSALS) as info:
        LOADERS[loader](path)
    return str(info.value).replace(str(path), "<file>")


@pytest.fixture(params=sorted(LOADERS))
def loader(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_a_file_that_is_not_utf8_is_refused_naming_the_line(loader: str, tmp_path: Path) -> None:
    path = tmp_path / "settings.yaml"
    path.write_bytes(b"# written on an old editor\nlog_level: caf\xe9\n")
    text = _refused(loader, path)
    assert "<file>" in text
    assert "UTF-8" in text
    assert "line 2" in text


def test_a_huge_file_is_refused_without_reading_it(loader: str, tmp_path: Path) -> None:
    # A path to a disk image or a log by mistake, or a file someone made to exhaust memory.
    path = tmp_path / "settings.yaml"
    with path.open("wb") as f:
        f.truncate(1 << 30)  # sparse: 1 GiB of NULs that take no disk
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    text = _refused(loader, path)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 200 * 1024, f"the loader grew by {grown_kib} KiB"
    assert "MiB" in text
    assert "check the path" in text


def test_a_directory_or_a_symlink_loop_is_refused(loader: str, tmp_path: Path) -> None:
    (tmp_path / "a.yaml").symlink_to(tmp_path / "b.yaml")
    (tmp_path / "b.yaml").symlink_to(tmp_path / "a.yaml")
    assert "symbolic links" in _refused(loader, tmp_path / "a.yaml")
    if loader != "inventory":  # a folder there is a spec string, refused as one
        assert "Is a directory" in _refused(loader, tmp_path)


def test_deep_nesting_is_refused_before_python_runs_out_of_stack(
    loader: str, tmp_path: Path
) -> None:
    path = tmp_path / "settings.yaml"
    path.write_text("log_level: " + "[" * 50_000 + "]" * 50_000 + "\n")
    text = _refused(loader, path)
    assert "nested" in text


def _billion_laughs() -> str:
    """A flow list of ten anchors, each nine aliases of the one before: 9**10 strings."""
    levels = ["&a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    levels += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    return f"[{', '.join(levels)}]"


@pytest.mark.parametrize("where", ["log_level", "engine", "models"])
def test_aliases_that_expand_to_billions_of_values_are_refused(
    loader: str, tmp_path: Path, where: str
) -> None:
    # 1 KiB that PyYAML loads as shared references, but 9**10 values for whatever walks it
    # (msgspec, the repr in an error message): minutes of CPU and gigabytes of memory.
    path = tmp_path / "settings.yaml"
    if where == "models":
        path.write_text(f"models: [{{name: m, engine: {_billion_laughs()}}}]\n")
    else:
        path.write_text(f"{where}: {_billion_laughs()}\n")
    text = _refused(loader, path)
    assert "expands to more than 1,000,000 values through its aliases" in text


def test_an_alias_inside_its_own_anchor_is_refused(loader: str, tmp_path: Path) -> None:
    path = tmp_path / "settings.yaml"
    path.write_text("models: &m [{name: m, aliases: *m}]\n")
    assert "inside its own anchor" in _refused(loader, path)


def test_anchors_and_merge_keys_within_bounds_still_work(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(
        "auth: {allow_anonymous: true}\n"
        "models:\n"
        "  - name: a\n"
        "    deadlines: &d {connect_s: 1, total_s: 60}\n"
        "  - name: b\n"
        "    deadlines: {<<: *d, total_s: 30}\n"
    )
    cfg = router_config.load(path)
    assert [m.deadlines.total_s for m in cfg.models] == [60, 30]
    assert cfg.models[1].deadlines.connect_s == 1


def test_a_large_file_without_aliases_is_not_refused_as_expanding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The values a file writes out counted against the aliases' limit too: a keys file of
    # 60,000 keys (13 MiB, under the size limit, not one alias) was refused as a value
    # that "expands to more than 1,000,000 values through its aliases". The same here with
    # a limit of 1,000 and 200 keys of 8 values each.
    monkeypatch.setattr(config, "MAX_VALUES", 1000)
    path = tmp_path / "keys.yaml"
    path.write_text("keys:\n" + "".join(auth.entry_yaml(f"k{i}", f"s{i}") for i in range(200)))
    assert len(auth.load_keys(path, 0.0).by_digest) == 200
    path.write_text(f"keys: {_billion_laughs()}\n")  # what the limit is for still is
    assert "through its aliases" in _refused("keys", path)


def test_a_key_given_twice_is_refused_naming_both_lines(loader: str, tmp_path: Path) -> None:
    # Last-one-wins would silently drop the first `models:` list of a long file.
    path = tmp_path / "settings.yaml"
    path.write_text("log_level: info\nmodels: []\n\nlog_level: debug\n")
    text = _refused(loader, path)
    assert "log_level" in text
    assert "line 1" in text
    assert "line 4" in text


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", ".NaN", "+.Inf"])
def test_a_number_that_is_not_finite_is_refused(loader: str, tmp_path: Path, value: str) -> None:
    # `probe_interval_s: .nan` passed every `<= 0` check and made the router probe its
    # engines in a busy loop (asyncio.sleep(nan) returns at once).
    path = tmp_path / "settings.yaml"
    path.write_text(f"probe_interval_s: {value}\n")
    text = _refused(loader, path)
    assert "probe_interval_s" in text or "line 1" in text
    assert "finite" in text


def test_a_non_finite_number_from_a_variable_or_a_flag_is_refused(tmp_path: Path) -> None:
    with pytest.raises(config.ConfigError) as info:
        config.load(
            router_config.RouterConfig,
            section="ROUTER",
            environ={"LLMGW_ROUTER__PROBE_INTERVAL_S": "nan"},
        )
    assert str(info.value).startswith("LLMGW_ROUTER__PROBE_INTERVAL_S='nan'")
    with pytest.raises(config.ConfigError) as info:
        config.load(
            router_config.RouterConfig,
            section="ROUTER",
            environ={"LLMGW_ROUTER__WEIGHTS": "{queue: .inf}"},
        )
    assert "LLMGW_ROUTER__WEIGHTS" in str(info.value)
    result = runner.invoke(app, ["sim", "--port", "0", "--decode-base-ms", "inf"], env={})
    assert result.exit_code == 2, result.output
    assert "decode_base_ms" in result.output
    assert "finite" in result.output


@pytest.mark.parametrize(
    "value",
    [
        "9" * 5000,  # past Python's 4,300 digits for int(): a ValueError from PyYAML
        "2001-13-45",  # a date PyYAML's pattern takes, datetime refuses
        "2001-02-30 10:00:00",
        "2001-01-01 00:00:00 +99:00",
        "0000-01-01",
        # A tag asks for a type; PyYAML's constructors then raise KeyError, IndexError,
        # AttributeError on what is not one.
        "!!bool maybe",
        '!!int ""',
        "!!int _",
        "!!timestamp x",
    ],
)
def test_a_scalar_yaml_cannot_build_is_refused_naming_the_line(
    loader: str, tmp_path: Path, value: str
) -> None:
    path = tmp_path / "settings.yaml"
    path.write_text(f"log_level: info\nprobe_interval_s: {value}\n")
    text = _refused(loader, path)
    assert "line 2" in text
    assert value.split()[-1].strip('"')[:20] in text or "digits" in text


@pytest.mark.parametrize(
    "argv",
    [
        ["router", "check", "--config"],
        ["control", "--check", "--config"],
        ["agent", "--check", "--config"],
        ["sim", "--config"],
        ["ctl", "nodes", "--config"],
        ["ctl", "apply", "-f"],
    ],
)
def test_commands_exit_2_with_one_line_not_a_traceback(argv: list[str], tmp_path: Path) -> None:
    for name, data in {
        "latin1.yaml": b"log_level: caf\xe9\n",
        "deep.yaml": b"[" * 20_000,
    }.items():
        path = tmp_path / name
        path.write_bytes(data)
        result = runner.invoke(app, [*argv, str(path)], env={})
        assert result.exit_code == 2, (name, result.output, result.exception)
        assert str(path) in result.output


# ------------------------------------------------------------------------------ any input

SETTING_NAMES = sorted(
    {
        *(f for f in router_config.RouterConfig.__struct_fields__),
        *(f for f in control_config.ControlConfig.__struct_fields__),
        *(f for f in agent_config.AgentConfig.__struct_fields__),
        *(f for f in SimConfig.__struct_fields__),
        "keys",
        "gpus",
        "name",
        "engine",
        "sha256",
        "port",
    }
)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**63 - 2, max_value=2**70)
    | st.floats()
    | st.text(max_size=20)
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(SETTING_NAMES) | st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _loaded_or_refused_everywhere(path: Path) -> None:
    for name, load in LOADERS.items():
        try:
            load(path)
        except REFUSALS:
            pass
        except Exception as exc:  # pragma: no cover - the failure report
            raise AssertionError(f"{name}: {type(exc).__name__}: {exc}") from exc


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=VALUES | st.dictionaries(st.sampled_from(SETTING_NAMES), VALUES, max_size=5))
def test_any_yaml_value_is_loaded_or_refused_with_a_config_error(
    tmp_path: Path, value: Any
) -> None:
    path = tmp_path / "settings.yaml"
    path.write_text(yaml.safe_dump(value))
    _loaded_or_refused_everywhere(path)


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_any_bytes_are_read_or_refused_with_a_config_error(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "settings.yaml"
    path.write_bytes(data)
    _loaded_or_refused_everywhere(path)


def test_a_json_setting_nested_deep_is_refused_in_one_line() -> None:
    # `llmgw sim --kv-events-config '[[[...'` (an engine argument a model profile may carry)
    # ended in a RecursionError traceback from json.loads.
    result = runner.invoke(app, ["sim", "--port", "0", "--kv-events-config", "[" * 100_000])
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 2
    assert "--kv-events-config" in result.output


@pytest.mark.parametrize("service", ["router", "control", "agent", "sim"])
def test_a_misspelt_log_level_is_refused_naming_the_levels(service: str, tmp_path: Path) -> None:
    # `log_level: degub` was read as info: an operator asking for debug lines got none
    # and no word of why.
    path = tmp_path / "settings.yaml"
    path.write_text("log_level: degub\n")
    said = _refused(service, path)
    assert "log_level" in said
    assert "debug|info|warning|error|critical" in said
    # "Info" and "Warning" name a level as logging reads it (in any case): they were
    # honoured before the check, and refused by it.
    for level in ("debug", "WARNING", "error", "Info", "Warning", "warn", "FATAL"):
        path.write_text(f"log_level: {level}\n")
        # A file of only a level lacks what some services need: any refusal is for that.
        said = ""
        with contextlib.suppress(*REFUSALS):
            LOADERS[service](path)
            said = "loaded"
        assert said == "loaded" or "log_level" not in _refused(service, path)


@pytest.mark.parametrize(
    ("level", "shown", "hidden"),
    [("warn", "warning", "info"), ("WARN", "warning", "info"), ("fatal", "critical", "error")],
)
def test_warn_and_fatal_are_the_levels_logging_knows_by_those_names(
    level: str, shown: str, hidden: str
) -> None:
    # Go's tools and many operators write `warn`; logging knows it (and `fatal`) too.
    import logging

    from llmgw import logs

    try:
        logs.setup(level, json=True)
        logger = logging.getLogger("llmgw.test")
        assert logger.isEnabledFor(getattr(logging, shown.upper()))
        assert not logger.isEnabledFor(getattr(logging, hidden.upper()))
    finally:
        logs.setup("info", json=True)


def test_the_nesting_and_expansion_limits_are_exact() -> None:
    # MAX_DEPTH collections deep is the deepest taken; a value whose aliases add more than
    # MAX_VALUES to what the file writes out is refused, and one value fewer is taken.
    value = config.parse_yaml("[" * config.MAX_DEPTH + "]" * config.MAX_DEPTH)
    for _ in range(config.MAX_DEPTH - 1):
        [value] = value
    assert value == []
    with pytest.raises(yaml.YAMLError, match="nested more than 64 levels"):
        config.parse_yaml("[" * (config.MAX_DEPTH + 1) + "]" * (config.MAX_DEPTH + 1))

    def shared(aliases: int) -> str:  # 1,002 values written out, 1,001 more per alias
        return "[&a [" + ", ".join(["x"] * 1000) + "], " + ", ".join(["*a"] * aliases) + "]"

    assert len(config.parse_yaml(shared(999))) == 1000
    with pytest.raises(yaml.YAMLError, match="expands to more than 1,000,000 values"):
        config.parse_yaml(shared(1000))


YAML_TAGS = ["", "!!bool", "!!int", "!!float", "!!timestamp", "!!binary", "!!null", "!!str",
             "!!omap", "!!set", "!!map", "!!merge", "!x"]  # fmt: skip


@settings(max_examples=300)
@given(
    tag=st.sampled_from(YAML_TAGS),
    value=st.text(alphabet="0123456789-:T Z+._xobe,[]{}&*!\"'a", max_size=25),
    before=st.sampled_from(["a: ", "- ", "", "? ", "<<: "]),
)
def test_any_tagged_scalar_is_read_or_refused_as_a_yaml_error(
    tag: str, value: str, before: str
) -> None:
    with contextlib.suppress(yaml.YAMLError):
        config.parse_yaml(f"{before}{tag} {value}\n")

"""Configuration files an operator got wrong, or an attacker wrote: every loader (router,
control, agent, sim, ctl settings, keys files, models.yaml, simulated inventories) answers
with its own error saying what to do, never another exception, a hang, or gigabytes of
memory."""

from __future__ import annotations

import resource
from collections.abc import Callable
from pathlib import Path

import pytest
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
    with pytest.raises(REFUSALS) as info:
        LOADERS[loader](path)
    return str(info.value)


@pytest.fixture(params=sorted(LOADERS))
def loader(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_a_file_that_is_not_utf8_is_refused_naming_the_line(loader: str, tmp_path: Path) -> None:
    path = tmp_path / "settings.yaml"
    path.write_bytes(b"# written on an old editor\nlog_level: caf\xe9\n")
    text = _refused(loader, path)
    assert str(path) in text
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
        assert "directory" in _refused(loader, tmp_path)


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
    }.items():
        path = tmp_path / name
        path.write_bytes(data)
        result = runner.invoke(app, [*argv, str(path)], env={})
        assert result.exit_code == 2, (name, result.output, result.exception)
        assert str(path) in result.output

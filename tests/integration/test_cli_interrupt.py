"""Ctrl-C while the CLI is still importing, as a real process: quiet, with the right status.

An interrupt at a chosen import is made deterministic by a `sitecustomize` on the child's
PYTHONPATH that sends the process SIGINT when the named module starts to import: the
signal arrives in the middle of that import, as a Ctrl-C on a busy machine does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw import __version__

REPO = Path(__file__).resolve().parents[2]

HOOK = """
import importlib.abc, os, signal, sys

TARGET = os.environ["LLMGW_TEST_INTERRUPT_AT"]


class _Interrupt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == TARGET:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None


sys.meta_path.insert(0, _Interrupt())
"""


def _ignore_sigint() -> None:
    """As a shell starts a background job, or nohup a command."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def interrupted_at(
    tmp_path: Path, module: str, *args: str, sigint_ignored: bool = False
) -> subprocess.CompletedProcess[str]:
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOOK)
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(hook), str(REPO)]),
        "LLMGW_TEST_INTERRUPT_AT": module,
    }
    return subprocess.run(
        [sys.executable, "-m", "llmgw", *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        preexec_fn=_ignore_sigint if sigint_ignored else None,
    )


@pytest.mark.parametrize(
    "module",
    [
        "typer",  # while the CLI imports
        "llmgw.up.running",  # inside `up`'s command, before it has started anything
    ],
)
def test_ctrl_c_while_up_imports_exits_0_quietly(tmp_path: Path, module: str) -> None:
    done = interrupted_at(tmp_path, module, "up", "--state-dir", str(tmp_path / "s"))
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "KeyboardInterrupt" not in done.stderr
    assert not (tmp_path / "s" / "run").exists()  # nothing was started


def test_ctrl_c_while_another_command_imports_exits_130_quietly(tmp_path: Path) -> None:
    done = interrupted_at(tmp_path, "typer", "ctl", "nodes")
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr


def test_a_command_started_with_ctrl_c_ignored_is_not_ended_by_one(tmp_path: Path) -> None:
    """A CLI started with SIGINT ignored (a background job, nohup) leaves it ignored: the
    interrupt during its imports ends nothing, and the command does its work."""
    done = interrupted_at(tmp_path, "typer", "version", sigint_ignored=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == __version__

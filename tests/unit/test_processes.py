"""Process identity and groups from /proc (llmgw.processes): a pid now held by another
process, a zombie, a group of someone else's are never taken for the engine's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from llmgw import processes


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """An engine stand-in leading its own process group."""
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def _until(condition: object, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_fingerprint_holds_the_command_line_as_run(sleeper: subprocess.Popen[bytes]) -> None:
    found = processes.fingerprint(sleeper.pid)
    assert found is not None
    assert found.cmdline == ("sleep", "300")
    assert found.boot_id == processes.boot_id() != ""
    assert processes.mismatch(found) == ""
    # ticks after boot: the sleeper started moments ago (field 22 of stat, not another)
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    started = found.start_time / os.sysconf("SC_CLK_TCK")
    assert uptime - 120 < started <= uptime + 1


def test_a_pid_reused_rebooted_or_running_another_command_is_not_the_engine(
    sleeper: subprocess.Popen[bytes],
) -> None:
    found = processes.fingerprint(sleeper.pid)
    assert found is not None
    earlier = msgspec.structs.replace(found, start_time=found.start_time - 1)
    assert "was reused" in processes.mismatch(earlier)
    other_boot = msgspec.structs.replace(found, boot_id="another-boot")
    assert "rebooted" in processes.mismatch(other_boot)
    other_command = msgspec.structs.replace(found, cmdline=("vllm", "serve"))
    assert "runs 'sleep 300', not the engine" in processes.mismatch(other_command)


def test_an_exited_engine_not_yet_collected_is_not_running_and_reaping_collects_it(
    sleeper: subprocess.Popen[bytes],
) -> None:
    found = processes.fingerprint(sleeper.pid)
    assert found is not None
    os.kill(sleeper.pid, signal.SIGKILL)
    _until(lambda: processes.state(sleeper.pid) == "Z", "the child became a zombie")
    assert processes.mismatch(found) == f"pid {sleeper.pid} is not running"
    assert processes.group_members(sleeper.pid) == []
    processes.reap(sleeper.pid)
    assert processes.state(sleeper.pid) is None
    sleeper.returncode = -9  # collected here, not by Popen


def test_reaping_a_child_that_still_runs_returns_at_once(
    sleeper: subprocess.Popen[bytes],
) -> None:
    began = time.monotonic()
    processes.reap(sleeper.pid)
    assert time.monotonic() - began < 5.0
    assert processes.state(sleeper.pid) in ("S", "R")


def test_a_groups_members_are_those_in_it_alive_not_its_children_elsewhere(
    sleeper: subprocess.Popen[bytes],
) -> None:
    # A child of the engine in the engine's group, and one that left for its own session.
    script = (
        "import subprocess, time; "
        "subprocess.Popen(['sleep', '302'], start_new_session=True); time.sleep(300)"
    )
    engine = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        # Forked, the child is in the engine's group until it leaves for its own session.
        _until(lambda: _left_for_own_session(engine.pid), "the engine's child in its session")
        assert processes.group_members(engine.pid) == [engine.pid]
        assert processes.group_members(sleeper.pid) == [sleeper.pid]
        assert processes.signal_group(engine.pid, signal.SIGKILL) is True
        engine.wait(timeout=30)
        assert processes.signal_group(engine.pid, signal.SIGKILL) is False  # gone
    finally:
        for child in _children(engine.pid):
            os.kill(child, signal.SIGKILL)
        engine.kill()
        engine.wait()


def _left_for_own_session(pid: int) -> bool:
    children = _children(pid)
    try:
        return len(children) == 1 and os.getpgid(children[0]) == children[0]
    except ProcessLookupError:
        return False


def _children(pid: int) -> list[int]:
    path = f"/proc/{pid}/task/{pid}/children"
    try:
        with open(path) as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


@pytest.mark.skipif(os.geteuid() != 0, reason="becomes another user to signal a root's group")
def test_another_users_group_is_never_signalled(sleeper: subprocess.Popen[bytes]) -> None:
    """As a user that may not signal it (a pgid reused by someone else's group): False."""
    code = (
        "import os, signal; from llmgw import processes; os.setuid(65534); "
        f"print(processes.signal_group({sleeper.pid}, signal.SIGTERM))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False"], out.stderr
    assert processes.state(sleeper.pid) in ("S", "R")

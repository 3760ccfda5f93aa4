"""Real subprocesses in tests: one base for every wrapper, and waiting for their lines.

Every process a test starts is one of these (`router_kit.Sim` and `Router`,
`agent_kit.AgentProcess`, `fleet_kit.Service`, `up_kit.Up`), so stopping, killing and
reading the log behave the same everywhere: a stop is SIGTERM, then SIGKILL when it has
not exited within the timeout; a kill is SIGKILL now (a crash); neither raises for a
process already gone. (`llmgw.sim.testing.SimProcess`, which the package ships for its
users' tests, stays apart: `router_kit.Sim` wraps it.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

from llmgw import processes
from llmgw.sim.testing import wait_for_line

__all__ = ["Proc", "killpg", "pid_alive", "wait_for_line"]


class Proc:
    """A started subprocess (or one not started yet: `proc` None) and its log file."""

    proc: subprocess.Popen[bytes] | None
    log_path: Path | None

    def __init__(self, proc: subprocess.Popen[bytes] | None, log_path: Path | None = None):
        self.proc = proc
        self.log_path = log_path

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait up to `timeout`, then SIGKILL; the exit code (None if never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(10)

    def kill(self) -> None:
        """SIGKILL now, as a crash would end it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(10)

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs (llmgw's own reading of /proc)."""
    return processes.fingerprint(pid) is not None


def killpg(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a process started in a session of its own, and everything in its group."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    proc.wait(10)

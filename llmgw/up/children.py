"""The processes `llmgw up` starts, and the ones a previous run left behind.

Each child runs in its own session (its own process group), so a Ctrl-C on the terminal
reaches only `up`, which then stops the children in order (router, agents, engines,
control, nats) instead of all at once. Each child asks the kernel to SIGTERM it when `up`
dies (PR_SET_PDEATHSIG), so even `kill -9` of `up` leaves no service running; engines are
the agents' children in groups of their own, which agents leave running on purpose, so
`up` stops them from the agents' pid files (`llmgw.pidfiles`). A pid file of `up`
holds the process fingerprint (`llmgw.processes.Fingerprint`), so a later run stops
what is really left over and never a process that merely got the same pid.
Used by `llmgw.up.running`.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import msgspec

from llmgw import pidfiles, processes

PR_SET_PDEATHSIG = 1


class UpError(RuntimeError):
    """Something `llmgw up` cannot get past; the message says what to do."""


def python_env(base: Mapping[str, str], search_path: Sequence[str] | None = None) -> dict[str, str]:
    """The environment of the `python -m llmgw` children: their working directory is not
    on sys.path, and they import the very llmgw that runs `up`.

    `python -m` puts the working directory first on sys.path, so `up` run from a directory
    holding a folder named `llmgw` (or `nats`, `yaml`...) would have run that code in every
    service and, through the agents' environment, every simulated engine. PYTHONSAFEPATH
    drops it, for the children and everything they start. The directory this llmgw comes
    from goes first on PYTHONPATH, as an absolute path, unless it is on sys.path beyond
    its first entry already (site-packages): so a checkout found through the working
    directory, or an editable install, is still the code the children run.
    """
    env = dict(base)
    env["PYTHONSAFEPATH"] = "1"
    root = str(Path(__file__).resolve().parents[2])
    found = search_path if search_path is not None else sys.path[1:]
    importable = {str(Path(p).resolve()) for p in found if p}
    if root not in importable:
        env["PYTHONPATH"] = os.pathsep.join(
            [root, *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
        )
    return env


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: no locks, no allocation-heavy work.
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join("    " + line for line in text.splitlines()[-lines:])


class Child:
    """One service process (`sys.executable -m llmgw ...` or nats-server), logged to a file."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log_path: Path,
        pid_file: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = tuple(argv)
        self.log_path = log_path
        self.pid_file = pid_file
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_start = 0

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._log_start = log.tell()
            log.write(f"---- llmgw up: {' '.join(self.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # preexec_fn is unsafe only with threads, and `up` runs none.
                preexec_fn=_die_with_parent,
                env=self.env,
                cwd=self.cwd,
            )
        fingerprint = processes.fingerprint(self.proc.pid)
        if fingerprint is not None:
            self.pid_file.parent.mkdir(parents=True, exist_ok=True)
            self.pid_file.write_bytes(msgspec.json.encode(fingerprint))

    def wait_for(self, pattern: str, timeout_s: float, abort: Callable[[], bool]) -> re.Match[str]:
        """Wait until this run's log shows a line matching `pattern` (the ready line each
        llmgw service prints), failing with the log's tail if the process exits first."""
        regex = re.compile(pattern, re.MULTILINE)
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(OSError), open(self.log_path, "rb") as log:
                log.seek(self._log_start)
                found = regex.search(log.read().decode(errors="replace"))
                if found is not None:
                    return found
            if not self.running:
                raise UpError(
                    f"{self.name} exited while starting (log {self.log_path}):\n"
                    + log_tail(self.log_path)
                )
            if abort():
                raise UpError(f"stopped while {self.name} was starting")
            if time.monotonic() > deadline:
                raise UpError(
                    f"{self.name} did not become ready within {timeout_s:.0f} s "
                    f"(log {self.log_path}):\n" + log_tail(self.log_path)
                )
            time.sleep(0.05)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the child's group, SIGKILL it after `timeout_s`; then forget the pid file."""
        if self.proc is not None:
            pgid = self.proc.pid
            if self.proc.poll() is None:
                processes.signal_group(pgid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    processes.signal_group(pgid, signal.SIGKILL)
                    self.proc.wait()
            # Anything the child started in its group and left behind (router workers).
            if processes.group_members(pgid):
                processes.signal_group(pgid, signal.SIGKILL)
        with contextlib.suppress(FileNotFoundError):
            self.pid_file.unlink()


def _wait_gone(alive: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


_fingerprint_decoder = msgspec.json.Decoder(processes.Fingerprint)


def recorded(pid_file: Path) -> processes.Fingerprint | None:
    """The process a pid file names, if it still runs (the very same process)."""
    try:
        fingerprint = _fingerprint_decoder.decode(pid_file.read_bytes())
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    return fingerprint if not processes.mismatch(fingerprint) else None


def stop_recorded(pid_file: Path, timeout_s: float = 10.0) -> int | None:
    """Stop the process (and its group) that `pid_file` records, if it is still the one
    recorded; remove the file. Returns the pid stopped, or None."""
    fingerprint = recorded(pid_file)
    with contextlib.suppress(FileNotFoundError):
        pid_file.unlink()
    if fingerprint is None:
        return None
    pid = fingerprint.pid
    group = os.getpgid(pid) if _exists(pid) else pid
    # Only a group the process leads is ours to signal; otherwise signal the process alone.
    if group == pid:
        processes.signal_group(pid, signal.SIGTERM)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    if not _wait_gone(lambda: not processes.mismatch(fingerprint), timeout_s):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if group == pid and processes.group_members(pid):
        processes.signal_group(pid, signal.SIGKILL)
    return pid


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _group_alive(pgid: int) -> bool:
    return bool(processes.group_members(pgid))


def engine_records(agent_state: Path) -> list[tuple[Path, pidfiles.ShardRecord]]:
    return [(path, rec) for path, rec in pidfiles.load_all(agent_state) if rec is not None]


def stop_engines(agent_states: Sequence[Path], timeout_s: float = 10.0) -> list[int]:
    """Stop every engine the agents' pid files record that still runs; remove the files.

    Agents leave their engines running when they stop (a restarted agent adopts them), so
    this is how `up` leaves no process behind. SIGTERM to each engine's process group,
    SIGKILL after `timeout_s`; never to a group that is not the engine's own
    (`pidfiles.foreign_group`). Returns the pids of the engines that were stopped.
    """
    live: list[tuple[Path, pidfiles.ShardRecord]] = []
    for state in agent_states:
        for path, rec in engine_records(state):
            if processes.mismatch(rec.process):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            elif not pidfiles.foreign_group(rec):
                live.append((path, rec))
                processes.signal_group(rec.pgid, signal.SIGTERM)
            # A file naming a group that is not its engine's was edited: signalling it could
            # stop anything; it stays, and the agent reports it when it starts.
    for path, rec in live:
        if not _wait_gone(functools.partial(_group_alive, rec.pgid), timeout_s):
            processes.signal_group(rec.pgid, signal.SIGKILL)
            _wait_gone(functools.partial(_group_alive, rec.pgid), 5.0)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return [rec.process.pid for _, rec in live]

"""Engine processes as the kernel sees them: identity, process groups, signals (Linux /proc).

A pid alone does not identify a process: pids are reused. A `Fingerprint`
adds the boot id, the start time in clock ticks since boot (field 22 of
/proc/<pid>/stat) and the command line, so that a restarted agent adopts its
own orphaned engines and never an unrelated process that got the same pid.
Used by `llmgw.agent.supervisor`, and by `llmgw.up` to stop what a previous run left.
Outside the agent because both shells read it, and shells never import each other.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import msgspec

PROC = Path("/proc")


class Fingerprint(msgspec.Struct, frozen=True, kw_only=True):
    pid: int
    start_time: int
    """Clock ticks after boot at which the process started: unique per pid within one boot."""
    boot_id: str
    cmdline: tuple[str, ...]


def boot_id() -> str:
    try:
        return (PROC / "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name, which may itself hold spaces and ')'."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    _, _, rest = text.rpartition(")")
    return rest.split()


def start_time(pid: int) -> int | None:
    fields = _stat_fields(pid)
    # rest[0] is field 3 (state); field 22 (starttime) is rest[19].
    return int(fields[19]) if fields and len(fields) > 19 else None


def state(pid: int) -> str | None:
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def cmdline(pid: int) -> tuple[str, ...] | None:
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return None
    return tuple(part.decode(errors="replace") for part in raw.split(b"\0")[:-1])


def fingerprint(pid: int, *, settle_s: float = 0.2) -> Fingerprint | None:
    """The identity of a running process, or None when it is gone.

    A process caught in the middle of exec (its parent's Popen has returned, but the
    kernel has not yet laid out the new argument area) reads an empty command line:
    that is re-read for up to `settle_s`, so a fingerprint taken right after a spawn
    records the engine's command line, not nothing.
    """
    started, argv = start_time(pid), cmdline(pid)
    give_up = time.monotonic() + settle_s
    while argv == () and state(pid) not in (None, "Z") and time.monotonic() < give_up:
        time.sleep(0.001)
        argv = cmdline(pid)
    if started is None or argv is None:
        return None
    return Fingerprint(pid=pid, start_time=started, boot_id=boot_id(), cmdline=argv)


def mismatch(expected: Fingerprint) -> str:
    """Why the process at `expected.pid` is not the one recorded; empty when it is."""
    current = fingerprint(expected.pid)
    if current is None or state(expected.pid) == "Z":
        return f"pid {expected.pid} is not running"
    if current.boot_id != expected.boot_id:
        return "the machine rebooted since the pid file was written"
    if current.start_time != expected.start_time:
        return (
            f"pid {expected.pid} was reused: it started at tick {current.start_time}, "
            f"the engine at tick {expected.start_time}"
        )
    if current.cmdline != expected.cmdline:
        return f"pid {expected.pid} runs {' '.join(current.cmdline)[:200]!r}, not the engine"
    return ""


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group `pgid`."""
    members = []
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        # rest[0] = state (field 3), rest[2] = pgrp (field 5).
        if fields and len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def signal_group(pgid: int, sig: signal.Signals) -> bool:
    """Send `sig` to every process of the group; False when the group no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        # A pgid reused by someone else's group: never signal what is not ours.
        return False
    return True


def reap(pid: int) -> None:
    """Collect an exited child of this process (no-op for anything else)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)

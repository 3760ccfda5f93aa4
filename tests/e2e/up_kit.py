"""Helpers for the end-to-end tests of `llmgw up`: run it as a subprocess, find every process
it started (engines included) through /proc, stream from it with the openai SDK.

Nothing is mocked: `llmgw up` starts a real nats-server, control plane, agents, engines
and router. Teardown kills whatever a failed test left, by fingerprint (pid + start time),
never by name.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from openai import OpenAI

from llmgw import processes
from llmgw.natsd import free_port
from tests.kit.processes import Proc

PY = sys.executable


def children_of() -> dict[int, list[int]]:
    """Parent pid -> child pids, for every live process (Linux /proc)."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        if fields and fields[0] != "Z":
            tree.setdefault(int(fields[1]), []).append(int(entry.name))
    return tree


def descendants(pid: int) -> list[processes.Fingerprint]:
    """Every live process below `pid`, as fingerprints (so a reused pid is not mistaken)."""
    tree = children_of()
    out: list[processes.Fingerprint] = []
    todo = list(tree.get(pid, ()))
    while todo:
        p = todo.pop()
        fp = processes.fingerprint(p)
        if fp is not None:
            out.append(fp)
        todo.extend(tree.get(p, ()))
    return out


def alive(fps: list[processes.Fingerprint]) -> list[processes.Fingerprint]:
    return [fp for fp in fps if not processes.mismatch(fp)]


def kill_all(fps: list[processes.Fingerprint]) -> None:
    for fp in alive(fps):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(fp.pid, signal.SIGKILL)


@dataclass
class Up(Proc):
    """One `llmgw up` subprocess (its output, stdout and stderr, is its log)."""

    proc: subprocess.Popen[bytes]
    state_dir: Path
    port: int
    out_path: Path
    started: float
    seen: list[processes.Fingerprint]

    def __post_init__(self) -> None:
        self.log_path = self.out_path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match[str]:
        regex = re.compile(pattern, re.MULTILINE)
        deadline = time.monotonic() + timeout_s
        while True:
            found = regex.search(self.output())
            if found:
                return found
            if self.proc.poll() is not None:
                raise AssertionError(f"llmgw up exited {self.proc.returncode}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {pattern!r} within {timeout_s} s:\n{self.output()}")
            time.sleep(0.05)

    def snapshot(self) -> list[processes.Fingerprint]:
        """Every process below `up` now; remembered for the final check and teardown."""
        found = descendants(self.proc.pid)
        known = {(f.pid, f.start_time) for f in self.seen}
        self.seen.extend(f for f in found if (f.pid, f.start_time) not in known)
        return found

    def interrupt(self, timeout_s: float = 60.0) -> int:
        self.snapshot()
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout_s)

    def leftovers(self, grace_s: float = 5.0) -> list[processes.Fingerprint]:
        """Processes `up` started that still run (after a short grace for reparenting)."""
        deadline = time.monotonic() + grace_s
        while alive(self.seen) and time.monotonic() < deadline:
            time.sleep(0.1)
        return alive(self.seen)


def start_up(
    tmp: Path,
    *args: str,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    python_args: tuple[str, ...] = (),
) -> Up:
    state = tmp / "state"
    port = free_port()
    out_path = tmp / f"up-{time.monotonic_ns()}.out"
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(
            [PY, *python_args, "-m", "llmgw", "up", "--state-dir", str(state),
             "--port", str(port), *args],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
        )  # fmt: skip
    return Up(proc, state, port, out_path, time.monotonic(), [])


def stream_chat(
    base_url: str,
    model: str,
    *,
    deadline_s: float,
    max_tokens: int = 32,
    prompt: str = "Hello!",
    api_key: str = "none",
) -> tuple[float, float, list[str], str | None]:
    """Retry until a streamed chat completion starts (the fleet may still be coming up),
    then read it whole. Returns (first-token time, last-token time, the content pieces,
    finish_reason); times are time.monotonic()."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=10.0)
    end = time.monotonic() + deadline_s
    last_error: Exception | None = None
    while time.monotonic() < end:
        try:
            stream = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": prompt}],
                stream=True,
                max_tokens=max_tokens,
                temperature=0.0,
            )
            pieces: list[str] = []
            first = last = 0.0
            finish = None
            for chunk in stream:
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                if choice.delta.content:
                    last = time.monotonic()
                    first = first or last
                    pieces.append(choice.delta.content)
                finish = choice.finish_reason or finish
            return first, last, pieces, finish
        except Exception as exc:  # connection refused or 503 while the fleet starts
            last_error = exc
            time.sleep(0.2)
    raise AssertionError(f"no streamed completion within {deadline_s} s: {last_error!r}")

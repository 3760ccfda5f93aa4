"""Start `llmgw sim` as a real subprocess, for tests and benchmarks.

`SimProcess.start(...)` runs `python -m llmgw sim --port 0 ...` exactly as the
agent launches it, waits for the start-up line, and knows the URL; `stop()` sends
SIGTERM and returns the exit status. Shipped in the package (as structlog ships
its test helpers) so that any test suite can run a real simulated engine.
"""

from __future__ import annotations

import json
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

_LINE = re.compile(r"^llmgw sim listening on (http://\S+)$")


def wait_for_line(
    proc: subprocess.Popen[bytes], pattern: re.Pattern[str], what: str, timeout: float
) -> re.Match[str]:
    """Read `proc`'s stdout until a line matches `pattern` (a server announcing where it
    listens). Raises RuntimeError when it exits or `timeout` passes first; the caller
    decides how to end it."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    seen = b""
    # poll, not select: a test process holding a thousand client connections has
    # descriptors beyond select's limit of 1024.
    poller = select.poll()
    poller.register(proc.stdout, select.POLLIN)
    while time.monotonic() < deadline:
        ready = poller.poll(100)
        if ready:
            line = proc.stdout.readline()
            if not line:
                break
            seen += line
            m = pattern.search(line.decode(errors="replace").strip())
            if m:
                return m
        elif proc.poll() is not None:
            break
    try:
        code: int | None = proc.wait(0.5)  # stdout closed: it is exiting
    except subprocess.TimeoutExpired:
        code = None
    if code is not None:
        raise RuntimeError(f"{what} exited ({code}) before announcing itself: stdout={seen!r}")
    raise RuntimeError(f"{what} did not announce itself within {timeout}s: stdout={seen!r}")


class SimProcess:
    """A running `llmgw sim` subprocess."""

    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Any) -> None:
        self.proc = proc
        self.url = url
        self._log = log

    @classmethod
    def start(
        cls, *args: str, model: str = "sim", timeout: float = 20.0, log: Path | None = None
    ) -> SimProcess:
        """Start a sim serving `model` on a free 127.0.0.1 port, with extra CLI `args`;
        its stderr is appended to `log` (a temporary file when None)."""
        cmd = [sys.executable, "-m", "llmgw", "sim", "--host", "127.0.0.1", "--port", "0"]
        cmd += ["--served-model-name", model, "--log-level", "warning", *args]
        # stderr goes to a file: a pipe nobody reads would block the sim once full.
        err = open(log, "a+b") if log else tempfile.TemporaryFile()  # noqa: SIM115 - kept for stderr_text()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err)
        try:
            m = wait_for_line(proc, _LINE, "llmgw sim", timeout)
        except BaseException as exc:  # whatever ended the wait (an interrupt too): no sim left
            proc.kill()
            proc.wait()
            err.seek(0)
            tail = err.read().decode(errors="replace")[-2000:]
            err.close()
            if isinstance(exc, RuntimeError):
                raise RuntimeError(f"{exc} stderr={tail}") from None
            raise
        return cls(proc, m.group(1), err)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def get_json(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=10) as resp:
            return json.loads(resp.read())

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
            text: str = resp.read().decode()
            return text

    def faults(self, **plan: Any) -> Any:
        """Set the fault plan (`POST /sim/faults`); no arguments clears it."""
        if not plan:
            req = urllib.request.Request(self.url + "/sim/faults", method="DELETE")
        else:
            req = urllib.request.Request(
                self.url + "/sim/faults",
                data=json.dumps(plan).encode(),
                method="POST",
                headers={"Content-Type": "application/json"},
            )
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, then the exit status (SIGKILL if it does not stop within `timeout`)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode

    def stderr_text(self) -> str:
        """What the sim logged so far."""
        self._log.seek(0)
        text: str = self._log.read().decode(errors="replace")
        return text

    def __enter__(self) -> SimProcess:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

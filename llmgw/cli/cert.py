"""`llmgw ctl cert`: the fleet's private CA and its certificates, for operators.

`init` creates the CA, the NATS server certificate and the first control-plane and operator
certificates, and renders the authorization nats/llmgw.conf includes; `issue` adds one
client identity (and re-renders, and reloads a running nats-server found through its pid
file); `server` re-issues the server certificate for new hosts; `route` issues a cluster
member's route certificate; `list` shows who is admitted and until when; `remove` takes an
identity out of the authorization; `render` writes the authorization again.
"""

from __future__ import annotations

import datetime as dt
import socket
from pathlib import Path

import typer

from llmgw import natsconf, natsd
from llmgw.core.subjects import check_token
from llmgw.pki.ca import CA_VALIDITY, CertificateAuthority, PkiError, PkiInputError
from llmgw.pki.identity import KINDS, Identity
from llmgw.pki.store import CertDir, expires, utcnow, write_private, write_public

app = typer.Typer(
    help="The fleet's private CA: create it, issue and list client certificates.",
    no_args_is_help=True,
)

DIR_OPTION = typer.Option(
    natsconf.DEFAULT_CONFIG.ca_file.parent,
    "--dir",
    help="Folder of the CA and certificates (nats/llmgw.conf reads nats/certs).",
)
AUTH_OPTION = typer.Option(
    None,
    "--authorization",
    help="Where to render the NATS authorization (default: authorization.conf beside --dir).",
)
PID_OPTION = typer.Option(
    natsconf.DEFAULT_CONFIG.pid_file,
    "--pid-file",
    help="pid file of a running nats-server to reload after a change (from nats/llmgw.conf).",
)


MAX_DAYS = CA_VALIDITY.days
"""A client certificate outliving the CA that signed it verifies no longer than the CA; days
beyond the year 9999 ended in an OverflowError."""


def default_hosts() -> list[str]:
    """What clients on this machine dial: loopback by address and name, and this host."""
    hosts = ["127.0.0.1", "::1", "localhost"]
    for name in (socket.gethostname(), socket.getfqdn()):
        if name and name not in hosts:
            hosts.append(name)
    return hosts


def _fail(exc: Exception) -> typer.Exit:
    """Exit 2 when the command was asked wrongly (the message says how to ask), 1 when a
    certificate operation failed (as `llmgw ctl` does)."""
    if isinstance(exc, OSError):  # --dir under a file, a folder it may not write
        exc = PkiInputError(f"cannot use {exc.filename}: {exc.strerror}; check --dir")
    typer.echo(f"error: {exc}", err=True)
    return typer.Exit(2 if isinstance(exc, PkiInputError) else 1)


def _identity(kind: str, name: str) -> Identity:
    try:
        return Identity(kind, name)  # type: ignore[arg-type]
    except ValueError as exc:
        raise _fail(PkiInputError(str(exc))) from None


def _render_and_reload(certs: CertDir, authorization: Path | None, pid_file: Path | None) -> None:
    try:
        path = certs.write_authorization(authorization)
    except OSError as exc:
        raise _fail(
            PkiInputError(
                f"cannot write the NATS authorization to {exc.filename}: {exc.strerror}; give"
                " --authorization a file in a folder you may write, then run"
                " `llmgw ctl cert render` with it"
            )
        ) from None
    typer.echo(f"rendered {path} ({len(certs.identities())} identities)")
    pid = natsd.reload_from_pid_file(pid_file) if pid_file is not None else None
    if pid is not None:
        typer.echo(f"reloaded nats-server (pid {pid}): the change applies now")
    else:
        # Twice, as reload_from_pid_file does: an account that a reload adds answers
        # requests only after the next one.
        typer.echo(
            "no running nats-server found through the pid file: a server started later reads "
            "it; a running one applies it after two reloads, a second apart "
            "(`nats-server --signal reload=<pid>`, twice, or `systemctl reload llmgw-nats`)"
        )


@app.command("init")
def init(
    dir: Path = DIR_OPTION,
    host: list[str] = typer.Option(
        [],
        "--host",
        help="A host name or IP clients dial to reach NATS (repeat). "
        "Default: 127.0.0.1, ::1, localhost and this machine's names.",
    ),
    control: str = typer.Option("control", "--control", help="Name of the first control plane."),
    operator: str = typer.Option("admin", "--operator", help="Name of the first operator."),
    days: int = typer.Option(
        365, "--days", min=1, max=MAX_DAYS, help="Validity of the client certificates."
    ),
    force: bool = typer.Option(
        False,
        "--force",
        help="Replace an existing CA and keys (every old certificate stops working).",
    ),
    authorization: Path | None = AUTH_OPTION,
) -> None:
    """Create the CA, the NATS server certificate and a control and an operator certificate."""
    certs = CertDir(dir)
    if certs.ca_key.exists() and not force:
        raise _fail(
            PkiInputError(
                f"a CA already exists in {dir}: issue more certificates with "
                "`llmgw ctl cert issue`, or pass --force to replace the CA (every certificate "
                "it signed stops working)"
            )
        )
    identities = [_identity("control", control), _identity("operator", operator)]
    hosts = list(host) or default_hosts()
    now = utcnow()
    try:
        ca = CertificateAuthority.create(now=now)
        server = ca.issue_server(hosts, now=now)
        certs.save_ca(ca, force=force)
        certs.save_server(server, force=force)
        typer.echo(f"CA            {certs.ca_cert}")
        typer.echo(f"server        {certs.server_cert}  (hosts: {', '.join(hosts)})")
        for identity in identities:
            issued = ca.issue_client(identity, now=now, validity=dt.timedelta(days=days))
            certs.save_client(identity, issued, force=force)
            typer.echo(f"{identity.kind:<13} {certs.cert(identity)}")
    except (PkiError, OSError) as exc:
        raise _fail(exc) from None
    _render_and_reload(certs, authorization, None)
    typer.echo("next: nats-server -c nats/llmgw.conf")


@app.command("issue")
def issue(
    kind: str = typer.Argument(..., help=f"One of {', '.join(KINDS)}."),
    name: str = typer.Argument(..., help="The identity's name; for a node, its node id."),
    dir: Path = DIR_OPTION,
    days: int = typer.Option(
        365, "--days", min=1, max=MAX_DAYS, help="Validity of the certificate."
    ),
    force: bool = typer.Option(False, "--force", help="Replace an existing key for this identity."),
    authorization: Path | None = AUTH_OPTION,
    pid_file: Path = PID_OPTION,
) -> None:
    """Issue a client certificate (clientAuth, CN=NAME, OU=KIND) and admit it to NATS."""
    identity = _identity(kind, name)
    certs = CertDir(dir)
    try:
        ca = certs.load_ca()
        issued = ca.issue_client(identity, now=utcnow(), validity=dt.timedelta(days=days))
        certs.save_client(identity, issued, force=force)
    except (PkiError, OSError) as exc:
        raise _fail(exc) from None
    typer.echo(f"certificate   {certs.cert(identity)}")
    typer.echo(f"key           {certs.key(identity)}  (mode 0600: copy it to the host only)")
    until = issued.cert.not_valid_after_utc
    capped = " (the CA's own end)" if until == ca.cert.not_valid_after_utc else ""
    typer.echo(f"subject       {identity.dn}, valid until {until:%Y-%m-%d %H:%M} UTC{capped}")
    _render_and_reload(certs, authorization, pid_file)


@app.command("server")
def server(
    dir: Path = DIR_OPTION,
    host: list[str] = typer.Option(
        [],
        "--host",
        help="Every host name or IP clients dial (repeat); the old list is replaced. "
        "Default: 127.0.0.1, ::1, localhost and this machine's names.",
    ),
    force: bool = typer.Option(False, "--force", help="Replace the existing server key."),
    pid_file: Path = PID_OPTION,
) -> None:
    """Re-issue the NATS server certificate, e.g. for new host names clients dial."""
    certs = CertDir(dir)
    hosts = list(host) or default_hosts()
    try:
        issued = certs.load_ca().issue_server(hosts, now=utcnow())
        certs.save_server(issued, force=force)
    except (PkiError, OSError) as exc:
        raise _fail(exc) from None
    typer.echo(f"server        {certs.server_cert}  (hosts: {', '.join(hosts)})")
    pid = natsd.reload_from_pid_file(pid_file)
    if pid is not None:
        typer.echo(f"reloaded nats-server (pid {pid}): new connections see the new certificate")


@app.command("route")
def route(
    name: str = typer.Argument(..., help="The cluster member, e.g. nats-1."),
    dir: Path = DIR_OPTION,
    host: list[str] = typer.Option(
        [], "--host", help="The host name or IP the other members dial for routes (repeat)."
    ),
    force: bool = typer.Option(False, "--force", help="Replace an existing route key."),
) -> None:
    """Issue a cluster route certificate for one nats-server of a cluster (nats/cluster/)."""
    try:
        check_token(name, "cluster member name")
    except ValueError as exc:
        raise _fail(PkiInputError(str(exc))) from None
    if not host:
        raise _fail(PkiInputError("give the address the other members dial: --host 10.0.0.5"))
    certs = CertDir(dir)
    try:
        issued = certs.load_ca().issue_route(host, now=utcnow())
        cert, key = certs.root / "route" / f"{name}.pem", certs.root / "route" / f"{name}-key.pem"
        write_private(key, issued.key_pem, force=force)
        write_public(cert, issued.cert_pem)
    except (PkiError, OSError) as exc:
        raise _fail(exc) from None
    typer.echo(f"route         {cert}  (hosts: {', '.join(host)})")


@app.command("list")
def list_(dir: Path = DIR_OPTION) -> None:
    """List the identities admitted to NATS and when their certificates expire."""
    certs = CertDir(dir)
    if not certs.ca_cert.exists():
        raise _fail(PkiInputError(f"no CA in {dir}: run `llmgw ctl cert init` first"))
    now = utcnow()
    for identity in certs.identities():
        try:
            until = expires(certs.cert(identity))
        except (OSError, ValueError) as exc:  # one broken file must not hide the others
            why = exc.strerror if isinstance(exc, OSError) else "not a PEM certificate"
            typer.echo(f"{identity.kind:<9} {identity.name:<24} unreadable ({why}): issue it again")
            continue
        state = "EXPIRED" if until <= now else f"{(until - now).days} days left"
        typer.echo(f"{identity.kind:<9} {identity.name:<24} until {until:%Y-%m-%d}  {state}")


@app.command("remove")
def remove(
    kind: str = typer.Argument(..., help=f"One of {', '.join(KINDS)}."),
    name: str = typer.Argument(...),
    dir: Path = DIR_OPTION,
    authorization: Path | None = AUTH_OPTION,
    pid_file: Path = PID_OPTION,
) -> None:
    """Take an identity out of the NATS authorization (deletes its certificate and key here).

    The server refuses its next connection; connections it already holds are closed by the
    reload. NATS maps certificates to users by subject, so this is the only revocation there
    is: issuing the same kind and name again later admits the old certificate too. Give a
    replaced host a new name, or rotate the CA with `init --force`."""
    identity = _identity(kind, name)
    certs = CertDir(dir)
    if not certs.cert(identity).exists():
        raise _fail(
            PkiInputError(f"no certificate for {identity} in {dir}: see `llmgw ctl cert list`")
        )
    certs.cert(identity).unlink()
    certs.key(identity).unlink(missing_ok=True)
    typer.echo(f"removed {identity}")
    _render_and_reload(certs, authorization, pid_file)


@app.command("render")
def render(
    dir: Path = DIR_OPTION,
    authorization: Path | None = AUTH_OPTION,
    pid_file: Path = PID_OPTION,
) -> None:
    """Render the NATS authorization again from the certificates in --dir (and reload)."""
    _render_and_reload(CertDir(dir), authorization, pid_file)

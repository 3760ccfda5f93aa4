"""`llmgw console`: serve the fleet and its history to a browser (llmgw.ctl.console).

It connects to the log as `llmgw ctl` does (the same config file and flags; an operator
certificate, whose identity the page's cordon, uncordon and drain carry), and listens
on 127.0.0.1 by default, where every request must carry the token it prints in the address
to open (another user of the machine reaches 127.0.0.1 too). Listening on any other
address needs `--tls-cert/--tls-key`: HTTPS that admits only operator client certificates
of the fleet's CA. Either way a request head must arrive within `--header-timeout-s` of
the connect, a later one's of its first byte (or 408, and the connection closes), a
malformed request gets a 400 that quotes nothing it sent, and a compressed body (never
inflated) a 415 (llmgw.http_server).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
import signal
from pathlib import Path

import typer

from llmgw import http_server, listeners, logs, operator_https
from llmgw.cli import ctl_common as common
from llmgw.ctl.console.live import LiveFleet
from llmgw.ctl.console.server import build_app, log
from llmgw.ctl.errors import BadInput, CtlError
from llmgw.ctl.session import Session

DEFAULT_PORT = 8300


def _hosts(host: str, port: int, *, tls: bool = False) -> set[str]:
    """The `Host` values the console answers to (empty: any). On plain HTTP (loopback
    only) those a browser sends for a loopback address, so that a DNS name rebound to
    127.0.0.1 gets a 421. Over HTTPS any: the browser checks the console's certificate
    against the name it was given, so a rebound name fails the handshake, and the names
    an operator may use (a DNS name, any address of a wildcard bind) are not known here."""
    if tls:
        return set()
    names = {host, "localhost", "127.0.0.1", "[::1]"} if listeners.loopback(host) else {host}
    names |= {f"[{host}]"} if ":" in host else set()
    # A browser leaves the scheme's default port out of `Host`.
    ports = (f":{port}", "") if port == 80 else (f":{port}",)
    return {name + p for name in names for p in ports}


def opening_address(url: str, token: str) -> str:
    """The address the operator opens: the console's, its token in the fragment, which a
    browser never sends to a server (the page takes it from there)."""
    return f"{url}/#token={token}"


def command(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(
        DEFAULT_PORT, "--port", min=0, max=65535, help="Port to listen on (0: a free one)."
    ),
    tls_cert: str | None = typer.Option(
        None, "--tls-cert", help="Server certificate for HTTPS (needed beyond 127.0.0.1)."
    ),
    tls_key: str | None = typer.Option(None, "--tls-key", help="Its key."),
    header_timeout_s: float = typer.Option(
        10.0,
        "--header-timeout-s",
        help="Longest wait for a request's line and headers, from the connect (a later "
        "request's: from its first byte; slower: 408, and the connection closes).",
    ),
    config: Path | None = common.CONFIG,
    server: list[str] | None = common.SERVER,
    ca: str | None = common.CA,
    cert: str | None = common.CERT,
    key: str | None = common.KEY,
) -> None:
    """The fleet and its whole history in a browser: the GPUs of every node, live events,
    a time slider over the log, and cordon / uncordon / drain."""
    if (tls_cert is None) != (tls_key is None):
        typer.echo("error: give --tls-cert and --tls-key together", err=True)
        raise typer.Exit(2)
    try:
        listeners.refuse_empty_host(host, "--port")
    except listeners.ListenError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if not listeners.loopback(host) and tls_cert is None:
        typer.echo(
            f"error: listening on {host} would show the fleet to anyone who reaches it: give "
            "--tls-cert and --tls-key (browsers then need an operator certificate of the "
            "fleet's CA), or keep --host 127.0.0.1 and reach it through an SSH tunnel",
            err=True,
        )
        raise typer.Exit(2)
    if not 0 < header_timeout_s < math.inf:  # NaN and inf too: no deadline at all
        typer.echo(
            "error: --header-timeout-s must be a number of seconds above 0 (10 is the default)",
            err=True,
        )
        raise typer.Exit(2)
    logs.setup("info")
    conn = common.Conn(config, server, ca, cert, key)
    try:
        asyncio.run(_serve(conn, host, port, tls_cert, tls_key, header_timeout_s))
    except CtlError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


async def _serve(
    conn: common.Conn,
    host: str,
    port: int,
    tls_cert: str | None,
    tls_key: str | None,
    header_timeout_s: float,
) -> None:
    cfg = conn.load()
    try:
        sock = listeners.bind(host, port, setting="--port")
    except OSError as exc:
        raise BadInput(str(exc)) from None
    tls = None
    if tls_cert is not None and tls_key is not None:
        try:
            tls = operator_https.server_tls(tls_cert, tls_key, cfg.ca_file)
        except (OSError, ValueError) as exc:
            raise BadInput(f"cannot load {tls_cert} with key {tls_key}: {exc}") from None
    session = await Session.open(cfg, reconnect_forever=True)
    live = LiveFleet(session)
    live.start()
    bound = sock.getsockname()[1]
    # Without HTTPS no certificate says who asks: a token this process made does. A client
    # that leaves ends its request (handler_cancellation): a scan of the log stops with it.
    token = "" if tls else secrets.token_urlsafe(24)
    rules = http_server.Rules(header_timeout_s, log)
    runner = http_server.app_runner(
        build_app(live, _hosts(host, bound, tls=tls is not None), token),
        rules=rules,
        access_log=None,
        handler_cancellation=True,
    )
    await runner.setup()
    await http_server.start_site(runner, sock, rules=rules, ssl_context=tls)
    url = listeners.url("https" if tls else "http", sock)
    opening = f": open {opening_address(url, token)}" if token else ""
    print(f"llmgw console at {url} as {session.identity}{opening}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(runner.cleanup(), 5)
        await live.close()
        await session.close()

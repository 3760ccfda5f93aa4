"""Shared by the `llmgw ctl` commands: connection options, running a command, one-line errors.

`run(conn, body)` opens a `llmgw.ctl.session.Session` from the settings (file,
environment, flags), runs the command's coroutine, closes, and turns a `CtlError`
(and any failure of the log or the connection) into one line on stderr with its exit
code: 0 ok, 1 operational failure, 2 bad input. Used by llmgw.cli.ctl_fleet (views,
mutations), llmgw.cli.ctl_history (events, replay) and llmgw.cli.ctl_status (status).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import nats.errors
import structlog
import typer

from llmgw import bus, logs
from llmgw.core import state
from llmgw.ctl import history, operations, render, settings
from llmgw.ctl import session as session_
from llmgw.ctl.errors import BadInput, CtlError
from llmgw.ctl.session import Session

CONFIG = typer.Option(
    None, "--config", help=f"ctl settings YAML (default: ${settings.CONFIG_ENV}, else built-in)."
)
SERVER = typer.Option(None, "--server", "-s", help="NATS URL (repeat for a cluster).")
CA = typer.Option(None, "--ca", help="The fleet's CA certificate (default: nats/certs/ca.pem).")
CERT = typer.Option(
    None, "--cert", help="Your operator certificate (default: nats/certs/operator/admin.pem)."
)
KEY = typer.Option(None, "--key", help="Its key (default: NAME-key.pem beside the certificate).")
JSON = typer.Option(False, "--json", help="Machine-readable JSON instead of a table.")


class Conn(msgspec.Struct, frozen=True):
    config: Path | None
    servers: list[str] | None
    ca: str | None
    cert: str | None
    key: str | None
    control_url: str | None = None

    def load(self) -> settings.CtlConfig:
        return settings.load(
            self.config,
            overrides={
                "servers": self.servers,
                "ca_file": self.ca,
                "cert_file": self.cert,
                "key_file": self.key,
                "control_url": self.control_url,
            },
        )


class _Stderr:
    """Whatever sys.stderr is when a line is logged (not when logging was configured)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def quiet_logs() -> None:
    """Library logs only when critical, on stderr: stdout carries the answer (`--json` must
    stay parseable), and what went wrong is ctl's own one-line error (a permission
    violation the bus logs is reported by `Session.publish` with what to do)."""
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            logs.EscapingConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL),
        logger_factory=structlog.PrintLoggerFactory(file=_Stderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
    # asyncio warns "returning true from eof_received() has no effect when using ssl"
    # whenever a TLS connection to NATS closes: noise on an operator's terminal.
    logging.getLogger("asyncio").setLevel(logging.ERROR)


class StdoutClosed(Exception):
    """stdout's reader went away. Told apart from an EPIPE of the NATS connection, which
    `run` reports as the connection's failure."""

    def __init__(self, pipe: BrokenPipeError) -> None:
        super().__init__(str(pipe))
        self.pipe = pipe


def run(conn: Conn, body: Callable[[Session], Awaitable[int | None]]) -> None:
    """Connect, run `body`, close; CtlError -> one line on stderr and its exit code."""
    quiet_logs()

    async def main() -> int:
        session = await Session.open(conn.load())
        try:
            return (await body(session)) or 0
        finally:
            await session.close()

    try:
        code = asyncio.run(main())
    except StdoutClosed as exc:
        # Whoever read the output stopped (`llmgw ctl events | head`): neither the log nor
        # the connection failed. typer's main ends a command on a closed pipe quietly, and
        # llmgw.cli.entry with a closed pipe's status.
        raise exc.pipe from None
    except CtlError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(exc.exit_code) from None
    except (bus.ReaderError, bus.PublishError, nats.errors.Error, OSError) as exc:
        # The log or the connection failed mid-command: still one line, exit 1.
        detail = str(exc) or type(exc).__name__
        typer.echo(f"error: {detail}; check that NATS is up and retry", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    if code:
        raise typer.Exit(code)


def out(text: str) -> None:
    try:
        typer.echo(text)
    except BrokenPipeError as exc:
        raise StdoutClosed(exc) from exc


def colour() -> bool:
    return render.use_colour(sys.stdout)


async def current(s: Session, *, progress: bool = True) -> history.Rebuilt:
    bar = render.ProgressBar(label="reading the log") if progress else None
    try:
        return await history.rebuild(s.nc, progress=bar)
    finally:
        if bar is not None:
            bar.close()


require_node = operations.require_node  # shared with the console


def require_model(st: state.ClusterState, model: str) -> None:
    if model not in st.models:
        known = ", ".join(sorted(st.models)[:8]) or "none declared"
        raise BadInput(
            f"unknown model {model!r} (declared: {known}): see `llmgw ctl models`, or declare "
            "it with `llmgw ctl apply -f models.yaml`"
        )


publish_checked = session_.publish_checked  # shared with the console

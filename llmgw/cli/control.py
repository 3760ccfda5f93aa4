"""`llmgw control --config FILE`: run one control-plane instance until SIGTERM / SIGINT.

Loads the ControlConfig (YAML, then `LLMGW_CONTROL__*` environment overrides),
prints one line `llmgw control NAME admin http://HOST:PORT` to stdout once the
admin listener accepts connections (the real port when 0 was configured), and on
SIGTERM or SIGINT releases the leader lease so a standby takes over at once.
`--check` validates the config and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from pathlib import Path

import typer

from llmgw import config, logs, openfiles, sdnotify, tasks, wording


def command(
    config_path: Path = typer.Option(..., "--config", "-c", help="Control-plane YAML config."),
    check: bool = typer.Option(False, "--check", help="Validate the config and exit."),
) -> None:
    """Run the control plane: fold the log, lead by lease, place replicas, send commands."""
    from llmgw.control import config as control_config

    try:
        cfg = control_config.load(config_path)
    except config.ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    if check:
        # The files, too: --check must not say ok about a service that could not connect.
        problems = control_config.file_problems(cfg)
        if problems:
            typer.echo("\n".join(f"{config_path}: {p}" for p in problems), err=True)
            raise typer.Exit(2)
        typer.echo(
            f"{config_path}: control plane {cfg.name!r}, "
            f"{wording.count(len(cfg.models), 'model')}: ok"
        )
        return
    logs.setup(cfg.log_level)
    openfiles.at_start()
    import uvloop

    from llmgw import bus

    try:
        uvloop.run(_serve(cfg))
    # A certificate path, or a stream that exists with another configuration: the
    # message says what to do, and restarting would not help.
    except (FileNotFoundError, bus.ProvisionConflict) as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None


async def _serve(cfg: object) -> None:
    from llmgw.control.config import ControlConfig
    from llmgw.control.service import ControlService

    assert isinstance(cfg, ControlConfig)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    tasks.until_stopped(loop, stop, "control plane")
    svc = ControlService(cfg)
    run = asyncio.create_task(svc.run(stop))
    ready = asyncio.create_task(svc.ready.wait())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait([run, ready, stopped], return_when=asyncio.FIRST_COMPLETED)
    if svc.ready.is_set():
        sys.stdout.write(f"llmgw control {cfg.name} admin {svc.admin_url}\n")
        sys.stdout.flush()
        sdnotify.ready()
    elif stop.is_set() and not run.done():
        # Still waiting for NATS (it reconnects forever): a signal must end that too.
        # nats-py's wait_for can swallow a cancel (Python 3.11): tasks.stop cancels again.
        await tasks.stop([run], timeout_s=2.0, who=f"control {cfg.name}")
        if not run.done():
            # Nothing is held yet (no lease, no log written): leave rather than hang.
            sys.stderr.write("llmgw control: still connecting after SIGTERM, exiting\n")
            os._exit(1)
    ready.cancel()
    stopped.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await run

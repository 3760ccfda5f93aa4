"""`llmgw`: the entry point. Each command group lives in its own module and is added here
only once it works, so `llmgw --help` never lists a stub."""

from __future__ import annotations

from pathlib import Path

import typer

from llmgw import __version__, schemas
from llmgw.cli import agent as agent_cli
from llmgw.cli import console as console_cli
from llmgw.cli import control as control_cli
from llmgw.cli import ctl as ctl_cli
from llmgw.cli import router as router_cli
from llmgw.cli import sim as sim_cli
from llmgw.cli import up as up_cli

app = typer.Typer(
    name="llmgw",
    help="Run a fleet of GPU nodes serving LLMs behind one OpenAI-compatible endpoint.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(__version__)
        raise typer.Exit()


@app.callback()
def _root(
    _version: bool = typer.Option(
        False,
        "--version",
        help="Print llmgw's version and exit.",
        callback=_print_version,
        is_eager=True,
    ),
) -> None:
    """Typer adds --install-completion and --show-completion (bash, zsh, fish, PowerShell)."""


@app.command("version")
def version() -> None:
    """Print llmgw's version."""
    typer.echo(__version__)


@app.command("schemas")
def schemas_cmd(
    write: bool = typer.Option(False, "--write", help="Regenerate the files instead of checking."),
    folder: Path = typer.Option(Path("schemas"), "--dir", help="Where the schema files live."),
) -> None:
    """Check (or with --write regenerate) the JSON Schema of events and configs in schemas/."""
    if write:
        try:
            written = schemas.write(folder)
        except OSError as exc:  # a path under a file, a folder it may not write
            typer.echo(f"cannot write {exc.filename}: {exc.strerror}; check --dir", err=True)
            raise typer.Exit(2) from None
        for path in written:
            typer.echo(f"wrote {path}")
        return
    problems = schemas.drift(folder)
    if problems:
        typer.echo(
            f"{folder} is out of date ({', '.join(problems)}): run `llmgw schemas --write`",
            err=True,
        )
        raise typer.Exit(1)
    typer.echo(f"{folder} matches the code")


app.add_typer(agent_cli.app, name="agent")
app.add_typer(router_cli.app, name="router")
app.add_typer(ctl_cli.app, name="ctl")
app.command("sim")(sim_cli.command)
app.command("control")(control_cli.command)
app.command("up")(up_cli.command)
app.command("console")(console_cli.command)


def main() -> None:
    app()

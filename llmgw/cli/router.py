"""`llmgw router`: run the OpenAI-compatible router, check its config, make API keys.

`llmgw router --config router.yaml [--workers N]` serves (as the systemd unit runs
it); `llmgw router check --config ...` validates; `llmgw router hash-key` makes keys.
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import typer

from llmgw import config, logs, openfiles, wording
from llmgw.router import config as router_config
from llmgw.router.config import RouterConfig

app = typer.Typer(
    help="The OpenAI-compatible router in front of the engines: with no command, serve.",
    invoke_without_command=True,
    add_completion=False,
)


def _load(path: Path | None, workers: int | None) -> RouterConfig:
    try:
        cfg = router_config.load(path)
    except config.ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    if workers is not None:
        cfg = msgspec.structs.replace(cfg, workers=workers)
        problems = router_config.validate(cfg, where="--workers")
        if problems:
            typer.echo("\n".join(problems), err=True)
            raise typer.Exit(2)
    return cfg


@app.callback()
def run(
    ctx: typer.Context,
    config_path: Path = typer.Option(None, "--config", "-c", help="Router YAML config."),
    workers: int = typer.Option(
        None, "--workers", help="Processes sharing the port (overrides the config)."
    ),
) -> None:
    """Serve the OpenAI API on the configured port until SIGTERM."""
    if ctx.invoked_subcommand is not None:
        return
    from llmgw.router import server

    cfg = _load(config_path, workers)
    logs.setup(cfg.log_level)
    openfiles.at_start()
    if cfg.auth.keys_file:
        # Fail here, once, with the keys file's own message, rather than in every worker.
        from llmgw.router import auth

        try:
            auth.load_keys(cfg.auth.keys_file, 0.0)
        except config.ConfigError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(2) from None
    try:
        # Before anything starts: a taken port is said once, not as a worker's traceback.
        claimed = server.claim(cfg)
    except OSError as exc:
        typer.echo(f"llmgw router: {exc}", err=True)
        raise typer.Exit(1) from None
    server.run(cfg, claimed)


@app.command("check")
def check(
    config_path: Path = typer.Option(..., "--config", "-c", help="Router YAML config."),
) -> None:
    """Validate a router config (and its keys file) and say what to change."""
    from llmgw.router import auth

    cfg = _load(config_path, None)
    problems = cfg.log.file_problems("log") if cfg.log is not None else []
    if problems:
        typer.echo("\n".join(f"{config_path}: {p}" for p in problems), err=True)
        raise typer.Exit(2)
    if cfg.auth.keys_file:
        try:
            keys = auth.load_keys(cfg.auth.keys_file, 0.0)
        except config.ConfigError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(2) from None
        typer.echo(wording.count(len(keys.by_digest), "API key"))
    names = sum(1 + len(m.aliases) for m in cfg.models)
    typer.echo(
        f"{config_path}: {wording.count(len(cfg.models), 'model')} "
        f"({wording.count(names, 'name')}), {wording.count(len(cfg.endpoints), 'endpoint')}: ok"
    )


@app.command("hash-key")
def hash_key(
    name: str = typer.Option(..., "--name", help="Who the key is for (shown in logs)."),
    model: list[str] = typer.Option(
        ["*"], "--model", "-m", help="Model the key may use; repeat; '*' for all."
    ),
    stdin: bool = typer.Option(
        False, "--stdin", help="Hash a key read from stdin instead of making a new one."
    ),
) -> None:
    """Make an API key (or hash one from stdin) and print its keys-file entry.

    The key is printed once, to stderr; only its SHA-256 goes in the keys file. Appended
    to a file (`>> router-keys.yaml`), the entry goes under the file's `keys:`, which it
    writes first into a new, empty file.
    """
    from llmgw.router import auth

    header = _keys_header()

    if stdin:
        key = sys.stdin.readline().strip()
        if not key:
            typer.echo("no key on stdin: pipe the key in, or leave out --stdin", err=True)
            raise typer.Exit(2)
    else:
        key = auth.new_key()
        typer.echo(f"API key for {name} (shown once, give it to them): {key}", err=True)
    typer.echo(header + auth.entry_yaml(name, key, tuple(model)), nl=False)


def _keys_header() -> str:
    """`keys:\n` when stdout is a new, empty file; exit 2 when it is a file the entry
    cannot be appended to (no `keys:` list at its end); "" otherwise (a terminal, a pipe)."""
    import os
    import stat

    try:
        st = os.fstat(sys.stdout.fileno())
    except (OSError, ValueError):
        return ""
    if not stat.S_ISREG(st.st_mode):
        return ""
    if st.st_size == 0:
        return "keys:\n"
    try:
        text = Path(f"/proc/self/fd/{sys.stdout.fileno()}").read_text(errors="replace")
    except OSError:
        return ""  # cannot look: trust the operator
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    top = [ln for ln in lines if not ln[:1].isspace()]
    if not top or top[-1].split("#", 1)[0].strip() != "keys:":
        typer.echo(
            "the file this entry is appended to does not end with a `keys:` list: an entry "
            "appended there would not be a key. Add a line `keys:` at its end (or append to "
            "a new file, which gets one)",
            err=True,
        )
        raise typer.Exit(2)
    return ""

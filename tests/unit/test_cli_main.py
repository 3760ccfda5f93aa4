"""`llmgw` itself: --version, and shell completion that knows the commands."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
import typer.rich_utils
from typer.testing import CliRunner

from llmgw import __version__
from llmgw.cli.main import app


def test_version_flag_and_command_print_the_version() -> None:
    runner = CliRunner()
    for args in (["--version"], ["version"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        assert result.output.strip() == __version__


def test_bash_completion_completes_commands() -> None:
    """What the script `llmgw --install-completion` installs runs: the completion protocol,
    in a real process, offers llmgw's commands for `llmgw c`."""
    env = {
        **os.environ,
        "_LLMGW_COMPLETE": "complete_bash",
        "COMP_WORDS": "llmgw c",
        "COMP_CWORD": "1",
    }
    # The console script pip installed beside this interpreter: completion is keyed by the
    # program's name.
    script = Path(sys.executable).with_name("llmgw")
    out = subprocess.run(
        [str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert set(out.stdout.split()) == {"console", "ctl", "control"}, (out.stdout, out.stderr)


def test_show_completion_prints_a_script_for_the_shell() -> None:
    result = CliRunner().invoke(app, ["--show-completion", "bash"])
    assert result.exit_code == 0, result.output
    assert "_llmgw_completion" in result.output


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan"])
def test_the_console_needs_a_head_deadline(value: str) -> None:
    # No deadline at all (inf) would let a client hold a connection by sending its request
    # head a byte at a time; config files refuse it too.
    result = CliRunner().invoke(app, ["console", "--header-timeout-s", value])
    assert result.exit_code == 2, result.output
    assert "--header-timeout-s must be a number of seconds above 0" in result.output


def _commands(group: Any, path: list[str]) -> list[tuple[list[str], Any]]:
    """Every command under `group` (typer's own click), with the words that name it."""
    out: list[tuple[list[str], Any]] = []
    for name, command in getattr(group, "commands", {}).items():
        out += [([*path, name], command), *_commands(command, [*path, name])]
    return out


def test_every_commands_help_shows_every_options_help(monkeypatch: pytest.MonkeyPatch) -> None:
    # Typer renders help with rich markup: `[/sys/class/infiniband]` in a help text made
    # `llmgw agent inventory --help` a MarkupError traceback, and `[default: beside --dir,
    # authorization.conf]` vanished from `llmgw ctl cert issue --help`.
    monkeypatch.setattr(typer.rich_utils, "MAX_WIDTH", 1000)  # no wrapping, no "…"
    runner = CliRunner()
    for path, command in _commands(typer.main.get_command(app), []):
        result = runner.invoke(app, [*path, "--help"])
        assert result.exit_code == 0, (path, result.exception)
        shown = " ".join(result.output.replace("│", " ").split())  # the panels' borders
        for param in command.params:
            text = getattr(param, "help", None)
            if text:
                assert " ".join(text.split()) in shown, (path, param.name, text)


BROKEN_CONNECTION = """
import errno, sys
import typer
import llmgw.cli.main
from llmgw.cli import entry

app = typer.Typer()


@app.command()
def send() -> None:
    print("sending")
    raise BrokenPipeError(errno.EPIPE, "Broken pipe")  # a socket's peer closed it


llmgw.cli.main.main = app
sys.argv = ["llmgw"]
entry.main()
"""


def test_a_closed_connection_is_an_error_not_a_reader_gone() -> None:
    """A command whose write to a connection (not its stdout) meets a closed peer failed:
    its stdout's reader is still there, so it says so and ends with 1, rather than quietly
    with 141 as if its output's reader had left."""
    out = subprocess.run(
        [sys.executable, "-c", BROKEN_CONNECTION], capture_output=True, timeout=120, check=False
    )
    assert out.returncode == 1, out
    assert out.stdout == b"sending\n"
    assert b"Broken pipe" in out.stderr


def test_a_closed_connection_with_stdout_on_dev_null_from_the_start_is_still_an_error() -> None:
    """Stdout that was /dev/null before the command began (a cron job, `> /dev/null`) is no
    reader that went away: a connection the command wrote to that closed is a failure."""
    out = subprocess.run(
        [sys.executable, "-c", BROKEN_CONNECTION],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        timeout=120,
        check=False,
    )
    assert out.returncode == 1, out
    assert b"Broken pipe" in out.stderr


def test_stdout_on_a_socket_whose_reader_left_ends_quietly_as_sigpipe_would() -> None:
    """Stdout may be a socket (an inetd-style service, a socket-activated unit): its peer
    closing is a reader gone, as a closed pipe is."""
    ours, theirs = socket.socketpair()
    theirs.close()
    with ours:
        out = subprocess.run(
            [str(Path(sys.executable).with_name("llmgw")), "version"],
            stdout=ours.fileno(),
            stderr=subprocess.PIPE,
            timeout=120,
            check=False,
        )
    assert (out.returncode, out.stderr) == (141, b"")


PRINTS_AS_IT_ENDS = """
import sys
import typer
import llmgw.cli.main
from llmgw.cli import entry

app = typer.Typer()


@app.command()
def send() -> None:
    print("sending")


llmgw.cli.main.main = app
sys.argv = ["llmgw"]
entry.main()
"""


def _buffered_command(stdout: int) -> subprocess.CompletedProcess[bytes]:
    """A command whose output is buffered, as stdout to a pipe or a file is by default, so
    that it is written only as the command ends."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return subprocess.run(
        [sys.executable, "-c", PRINTS_AS_IT_ENDS],
        env=env,
        stdout=stdout,
        stderr=subprocess.PIPE,
        timeout=120,
        check=False,
    )


def test_buffered_output_whose_reader_left_ends_quietly_as_sigpipe_would() -> None:
    """What is left to write when the reader is gone is dropped: Python's own last flush at
    exit would print "Exception ignored ... BrokenPipeError" and end with status 120."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        out = _buffered_command(write_end)
    finally:
        os.close(write_end)
    assert (out.returncode, out.stderr) == (141, b"")


def test_output_lost_to_a_full_disk_is_not_taken_for_a_reader_gone() -> None:
    """Stdout's last flush failing for another reason than a closed pipe (a full disk) is a
    failure that says what happened, not the quiet status of a reader that left."""
    with open("/dev/full", "wb") as full:
        out = _buffered_command(full.fileno())
    assert out.returncode not in (0, 141), out
    assert b"No space left on device" in out.stderr


def test_a_command_started_with_stdout_closed_ends_with_its_own_status() -> None:
    """`llmgw version >&-`: Python gives such a process no sys.stdout, and the check for a
    reader gone after the command raised AttributeError (a traceback, status 1)."""
    out = subprocess.run(
        [str(Path(sys.executable).with_name("llmgw")), "version"],
        preexec_fn=lambda: os.close(1),
        stderr=subprocess.PIPE,
        timeout=120,
        check=False,
    )
    assert (out.returncode, out.stderr) == (0, b"")


CLOSES_ITS_STDOUT = PRINTS_AS_IT_ENDS.replace(
    '    print("sending")', '    print("sending")\n    sys.stdout.close()'
)


def test_a_command_that_closes_its_stdout_ends_with_its_own_status() -> None:
    out = subprocess.run(
        [sys.executable, "-c", CLOSES_ITS_STDOUT], capture_output=True, timeout=120, check=False
    )
    assert (out.returncode, out.stdout, out.stderr) == (0, b"sending\n", b"")


def test_schemas_write_then_check(tmp_path: Path) -> None:
    """`llmgw schemas --write` says only what it wrote; a check of the folder then agrees."""
    runner = CliRunner()
    written = runner.invoke(app, ["schemas", "--write", "--dir", str(tmp_path)])
    assert written.exit_code == 0, written.output
    lines = written.output.splitlines()
    assert lines
    assert all(line.startswith(f"wrote {tmp_path}") for line in lines), lines
    checked = runner.invoke(app, ["schemas", "--dir", str(tmp_path)])
    assert (checked.exit_code, checked.output) == (0, f"{tmp_path} matches the code\n")


def test_llmgw_alone_shows_its_help() -> None:
    result = CliRunner().invoke(app, [])
    assert "Run a fleet of GPU nodes" in result.output
    assert "Missing command" not in result.output
    for command in ("agent", "router", "ctl", "sim", "control", "up", "console", "schemas"):
        assert f" {command} " in result.output, command

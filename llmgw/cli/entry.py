"""The `llmgw` script and `python -m llmgw`: the CLI, and what Ctrl-C does before a command
has taken over the signal.

Importing the CLI takes a good part of a second (NATS, aiohttp, cryptography). An interrupt
that comes then has stopped nothing, since nothing was started: it ends the process at once
and quietly, instead of with a traceback from some import (or typer's status 130 from a
command's own imports), with `llmgw up`'s status for a stop by a signal (0) and the shell's
(130) for the other commands. This module imports only the standard library, so the quiet
handler is in place within the first milliseconds; `llmgw up` keeps it until it installs
its own (which stops what it started), every other command gets Python's usual
KeyboardInterrupt back once the CLI is imported.

A command whose reader goes away (`llmgw ctl events | head`) ends as a tool killed by
SIGPIPE does in a shell, as `yes | head` does: quietly, with status 141. Python ignores
SIGPIPE (a write to a closed socket must be an error, not the process's death), so the
closed pipe comes as a BrokenPipeError, which typer turns into a quiet exit of status 1;
that exit, or the last flush of stdout failing so, is told apart here and given the
shell's status. A closed pipe or connection that is not stdout's (a server that closed a
socket the command wrote to) is a failure: typer's quiet 1 then says what happened.
"""

from __future__ import annotations

import errno
import os
import select
import signal
import sys
from types import FrameType
from typing import NoReturn

CLOSED_PIPE_STATUS = 128 + signal.SIGPIPE
"""A shell's status for a process killed by SIGPIPE: 141."""
STDOUT_FD = 1


def _interrupted() -> int:
    return 0 if sys.argv[1:2] == ["up"] else 130


def _quit_quietly(signum: int, frame: FrameType | None) -> None:
    # Nothing runs yet that needs stopping or flushing: leave without unwinding imports.
    os._exit(_interrupted())


def _broken_pipe(exc: BaseException | None) -> bool:
    return isinstance(exc, OSError) and exc.errno == errno.EPIPE


def _file_id(fd: int | str) -> tuple[int, int] | None:
    try:
        st = os.stat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _stdout_closed(at_start: tuple[int, int] | None) -> bool:
    """Whether nobody reads stdout any more: the other end of its pipe or socket is closed
    (a write would fail with EPIPE), or stdout went to /dev/null since the command started
    (`at_start`: what it was then), as rich sends it when its output's pipe closes."""
    now = _file_id(STDOUT_FD)
    if now != at_start and now == _file_id(os.devnull):
        return True
    poller = select.poll()
    poller.register(STDOUT_FD, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _reader_gone(exit_: SystemExit, stdout_at_start: tuple[int, int] | None) -> bool:
    """Whether the command's end came of stdout's closed pipe: typer exits while handling
    the BrokenPipeError of a write (its context) and stdout's reader is gone (typer takes
    any closed pipe for stdout's), or what is left to flush meets it."""
    if _broken_pipe(exit_.__context__) and _stdout_closed(stdout_at_start):
        return True
    if sys.stdout is None:  # started with stdout closed (`>&-`): Python gave it none
        return False
    try:
        sys.stdout.flush()
    except OSError as exc:
        return _broken_pipe(exc)
    except ValueError:  # stdout closed by the command itself: nothing to flush
        return False
    return False


def _end_on_closed_pipe() -> NoReturn:
    # Python flushes stdout once more as it exits, and its failure would be printed
    # ("Exception ignored ... BrokenPipeError"): what is left goes to /dev/null instead.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, STDOUT_FD)
    os.close(devnull)
    sys.exit(CLOSED_PIPE_STATUS)


def main() -> None:
    # An ignored SIGINT (a background job, nohup) stays ignored.
    quiet = signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
    stdout_at_start = _file_id(STDOUT_FD)
    if quiet:
        signal.signal(signal.SIGINT, _quit_quietly)
    try:
        from llmgw.cli.main import main as run

        if quiet and sys.argv[1:2] != ["up"]:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        run()
    except KeyboardInterrupt:
        sys.exit(_interrupted())
    except SystemExit as exit_:
        if _reader_gone(exit_, stdout_at_start):
            _end_on_closed_pipe()
        if _broken_pipe(exit_.__context__):
            print(f"error: the other end of a pipe or connection this command wrote to closed"
                  f" it ({exit_.__context__}): check the server or process it talks to, and run"
                  " it again", file=sys.stderr)  # fmt: skip
        raise

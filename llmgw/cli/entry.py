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
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType


def _interrupted() -> int:
    return 0 if sys.argv[1:2] == ["up"] else 130


def _quit_quietly(signum: int, frame: FrameType | None) -> None:
    # Nothing runs yet that needs stopping or flushing: leave without unwinding imports.
    os._exit(_interrupted())


def main() -> None:
    # An ignored SIGINT (a background job, nohup) stays ignored.
    quiet = signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
    if quiet:
        signal.signal(signal.SIGINT, _quit_quietly)
    try:
        from llmgw.cli.main import main as run

        if quiet and sys.argv[1:2] != ["up"]:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        run()
    except KeyboardInterrupt:
        sys.exit(_interrupted())

"""The `llmgw` script and `python -m llmgw`: the CLI, and what Ctrl-C does before a command
has taken over the signal.

Importing the CLI takes a good part of a second (NATS, aiohttp, cryptography). An interrupt
that comes then, or before a command installs its own handler, has stopped nothing, since
nothing was started: it ends the process quietly instead of with a traceback from some
import, with `llmgw up`'s status for a stop by a signal (0) and the shell's (130) for the
other commands.
"""

from __future__ import annotations

import sys


def _interrupted() -> int:
    return 0 if sys.argv[1:2] == ["up"] else 130


def main() -> None:
    try:
        from llmgw.cli.main import main as run

        run()
    except KeyboardInterrupt:
        sys.exit(_interrupted())

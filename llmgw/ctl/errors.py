"""The two ways a `llmgw ctl` command fails, each with its exit code.

`BadInput` (exit 2): what the operator typed cannot be right (an unknown node or
model, a time before the log begins, a malformed models.yaml). `Failed` (exit 1):
the request was fine but the fleet or the log did not cooperate (NATS unreachable,
the server refused a write). Both carry one line that says what to do next.
"""

from __future__ import annotations


class CtlError(Exception):
    exit_code = 1


class BadInput(CtlError):
    """The operator's input is wrong: exit 2."""

    exit_code = 2


class Failed(CtlError):
    """An operational failure: exit 1."""

    exit_code = 1

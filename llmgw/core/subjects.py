"""NATS subjects of the llmgw log, built in one place.

Every writer owns a namespace (DESIGN.md, invariant 4), and the server enforces
it by subject. An identifier that smuggled a `.`, `*` or `>` into a subject
would let a node write into another's namespace or a wildcard swallow a whole
tree, so every identifier that becomes a token is checked here. Pure.
"""

from __future__ import annotations

import re

STREAM = "llmgw-events"
EVENTS_ROOT = "llmgw.events"
COMMANDS_ROOT = "llmgw.cmd"
STREAM_SUBJECTS = (f"{EVENTS_ROOT}.>", f"{COMMANDS_ROOT}.>")

NODE_EVENTS_ALL = f"{EVENTS_ROOT}.node.>"
OPERATOR_EVENTS_ALL = f"{EVENTS_ROOT}.operator.>"
CONTROL_EVENTS_ALL = f"{EVENTS_ROOT}.control.>"
COMMANDS_ALL = f"{COMMANDS_ROOT}.>"

# Letters, digits, '_' and '-': what hostnames, replica ids and event kinds need,
# and nothing a NATS subject or a shell would read as syntax.
_TOKEN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,127}")


class SubjectTokenError(ValueError):
    """An identifier that cannot be used as one token of a NATS subject."""


def check_token(value: str, what: str = "identifier") -> str:
    """Return `value` if it is safe as a single subject token, else raise SubjectTokenError."""
    if not isinstance(value, str) or not _TOKEN.fullmatch(value):
        raise SubjectTokenError(
            f"{what} {value!r} cannot be used in a NATS subject: use 1-128 letters, digits, "
            "'_' or '-' (no dots, '*', '>', whitespace; not empty), e.g. the short hostname "
            "'gpu-node-07' rather than 'gpu-node-07.example.com'"
        )
    return value


def node_event(node: str, kind: str) -> str:
    """`llmgw.events.node.<node>.<kind>`: written only by that node's agent."""
    return f"{EVENTS_ROOT}.node.{check_token(node, 'node id')}.{check_token(kind, 'event kind')}"


def node_events(node: str) -> str:
    """Every subject one node's agent may write: `llmgw.events.node.<node>.>`."""
    return f"{EVENTS_ROOT}.node.{check_token(node, 'node id')}.>"


def operator_event(kind: str) -> str:
    """`llmgw.events.operator.<kind>`: written only by operators (`llmgw ctl`)."""
    return f"{EVENTS_ROOT}.operator.{check_token(kind, 'event kind')}"


def control_event(kind: str) -> str:
    """`llmgw.events.control.<kind>`: written only by the control-plane leader."""
    return f"{EVENTS_ROOT}.control.{check_token(kind, 'event kind')}"


def command(node: str) -> str:
    """`llmgw.cmd.<node>`: commands for one node, read only by that node's agent."""
    return f"{COMMANDS_ROOT}.{check_token(node, 'node id')}"


def node_of(subject: str) -> str | None:
    """The node a node-event or command subject belongs to, or None for other subjects."""
    parts = subject.split(".")
    if len(parts) == 5 and parts[:3] == ["llmgw", "events", "node"]:
        return parts[3]
    if len(parts) == 3 and parts[:2] == ["llmgw", "cmd"]:
        return parts[2]
    return None

"""NATS subjects of the llmgw log, built in one place.

Every writer owns a namespace (docs/design.md, invariant 4), and the server enforces
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

# The engines' KV-cache blocks, relayed by their nodes' agents: high-volume, short-lived,
# in a stream of their own so they never crowd the replayable history (docs/design.md,
# "Routing to the cache").
KV_STREAM = "llmgw-kv"
KV_ROOT = "llmgw.kv"
KV_SUBJECTS = (f"{KV_ROOT}.>",)

# The routers' load reports, for the autoscaler: seconds-lived, in a stream of their own
# (docs/design.md, "An elastic fleet").
SIGNALS_STREAM = "llmgw-signals"
SIGNALS_ROOT = "llmgw.signals"
SIGNALS_SUBJECTS = (f"{SIGNALS_ROOT}.>",)
MAX_ROUTER_WORKERS = 1024
"""Worker processes of one router: its load reports are read from `w0`..`w1023` only,
since its certificate lets it write any token there and the leader keeps one report per
subject (a new token per message would grow that with the router's message rate)."""
_WORKER = re.compile(r"w(0|[1-9][0-9]{0,3})")

# Tenants' fleet-wide counters, kept by the server (JetStream counters, `Nats-Incr`): the
# requests and tokens of each key's current rate windows (seconds-lived), and its usage by
# hour and by budget period (kept for months). Outside the log: they grow with traffic
# (docs/design.md, "The front door").
LIMITS_STREAM = "llmgw-limits"
LIMITS_ROOT = "llmgw.limits"
LIMITS_SUBJECTS = (f"{LIMITS_ROOT}.>",)
USAGE_STREAM = "llmgw-usage"
USAGE_ROOT = "llmgw.usage"
USAGE_SUBJECTS = (f"{USAGE_ROOT}.>",)

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


# The token that puts a control plane's own operator events (the models of its config file)
# in a namespace of their own: `llmgw.events.operator.control.<instance>.<kind>` has one token
# more than any operator's `llmgw.events.operator.<operator>.<kind>`, so an operator named
# "control" (whose permission is `llmgw.events.operator.control.*`) cannot write there.
CONTROL_WRITER = "control"


def operator_event(operator: str, kind: str) -> str:
    """`llmgw.events.operator.<operator>.<kind>`: written only by that operator (`llmgw ctl`).

    The operator's name is part of the subject, and the server lets each operator
    certificate write only under its own name, so the recorded author of an operator
    event is what the server enforced, not what the event says.
    """
    op = check_token(operator, "operator name")
    return f"{EVENTS_ROOT}.operator.{op}.{check_token(kind, 'event kind')}"


def operator_events(operator: str) -> str:
    """Every subject one operator may write: `llmgw.events.operator.<operator>.*`."""
    return f"{EVENTS_ROOT}.operator.{check_token(operator, 'operator name')}.*"


def control_operator_event(instance: str, kind: str) -> str:
    """`llmgw.events.operator.control.<instance>.<kind>`: an operator event (a model of its
    config file) written by the control-plane instance `instance`."""
    name = check_token(instance, "control-plane name")
    return f"{EVENTS_ROOT}.operator.{CONTROL_WRITER}.{name}.{check_token(kind, 'event kind')}"


def operator_event_kind(kind: str) -> tuple[str, ...]:
    """Filters for one kind of operator event, whoever wrote it: operators, control planes,
    and logs written before the author became part of the subject."""
    k = check_token(kind, "event kind")
    root = f"{EVENTS_ROOT}.operator"
    return (f"{root}.*.{k}", f"{root}.{CONTROL_WRITER}.*.{k}", f"{root}.{k}")


def operator_author(subject: str) -> tuple[str, str, str] | None:
    """(writer kind, writer name, event kind) of an operator-event subject: ("operator",
    name, kind), ("control", instance, kind), or ("", "", kind) for the pre-author form
    `llmgw.events.operator.<kind>` of older logs. None for other subjects."""
    parts = subject.split(".")
    if parts[:3] != ["llmgw", "events", "operator"]:
        return None
    rest = parts[3:]
    if len(rest) == 1:
        return ("", "", rest[0])
    if len(rest) == 2:
        return ("operator", rest[0], rest[1])
    if len(rest) == 3 and rest[0] == CONTROL_WRITER:
        return ("control", rest[1], rest[2])
    return None


def control_event(kind: str) -> str:
    """`llmgw.events.control.<kind>`: written only by the control-plane leader."""
    return f"{EVENTS_ROOT}.control.{check_token(kind, 'event kind')}"


def command(node: str) -> str:
    """`llmgw.cmd.<node>`: commands for one node, read only by that node's agent."""
    return f"{COMMANDS_ROOT}.{check_token(node, 'node id')}"


def kv_updates(node: str, endpoint: str) -> str:
    """`llmgw.kv.<node>.<endpoint>`: the KV blocks of one engine, written only by its node."""
    return f"{KV_ROOT}.{check_token(node, 'node id')}.{check_token(endpoint, 'endpoint id')}"


def kv_node(node: str) -> str:
    """Every KV subject one node's agent may write: `llmgw.kv.<node>.*`."""
    return f"{KV_ROOT}.{check_token(node, 'node id')}.*"


def kv_owner(subject: str) -> tuple[str, str] | None:
    """(node, endpoint) of a KV subject, or None for any other subject."""
    parts = subject.split(".")
    if len(parts) == 4 and parts[:2] == ["llmgw", "kv"] and all(parts[2:]):
        return parts[2], parts[3]
    return None


def router_signals(router: str, worker: int) -> str:
    """`llmgw.signals.router.<router>.w<worker>`: one router process's load reports."""
    return f"{SIGNALS_ROOT}.router.{check_token(router, 'router name')}.w{int(worker)}"


def router_signals_all(router: str) -> str:
    """Every load-report subject one router may write: `llmgw.signals.router.<router>.*`."""
    return f"{SIGNALS_ROOT}.router.{check_token(router, 'router name')}.*"


def node_signals(node: str) -> str:
    """`llmgw.signals.node.<node>`: the load of one node's engines, as its agent reads it."""
    return f"{SIGNALS_ROOT}.node.{check_token(node, 'node id')}"


def signals_owner(subject: str) -> tuple[str, str] | None:
    """(`router` or `node`, its name) of a load-report subject, or None for any other."""
    parts = subject.split(".")
    if parts[:2] != ["llmgw", "signals"] or not all(parts[2:]):
        return None
    if len(parts) == 5 and parts[2] == "router":
        worker = _WORKER.fullmatch(parts[4])
        if worker is None or int(worker[1]) >= MAX_ROUTER_WORKERS:
            return None
        return "router", parts[3]
    if len(parts) == 4 and parts[2] == "node":
        return "node", parts[3]
    return None


_NODE_EVENTS_PREFIX = NODE_EVENTS_ALL[:-1]  # "llmgw.events.node."


def writing_node(subject: str) -> str | None:
    """The node that alone may write `subject` of the log, or None: `llmgw.events.node.<node>`
    and any subject below it, as the node's permission reaches (`node_events`)."""
    if not subject.startswith(_NODE_EVENTS_PREFIX):
        return None
    node, dot, rest = subject[len(_NODE_EVENTS_PREFIX) :].partition(".")
    if not dot or not rest or not _TOKEN.fullmatch(node):
        return None
    return node


def node_of(subject: str) -> str | None:
    """The node a node-event or command subject belongs to, or None for other subjects."""
    parts = subject.split(".")
    if len(parts) == 5 and parts[:3] == ["llmgw", "events", "node"]:
        return parts[3]
    if len(parts) == 3 and parts[:2] == ["llmgw", "cmd"]:
        return parts[2]
    return None


def limit_counter(key: str, kind: str, window: int) -> str:
    """`llmgw.limits.<key>.<r|t>.<window>`: a key's requests (r) or tokens (t) in one window."""
    return f"{LIMITS_ROOT}.{check_token(key, 'key name')}.{kind}.{int(window)}"


def usage_counter(key: str, hour: int, model: str, what: str) -> str:
    """`llmgw.usage.<key>.h.<hour>.<model>.<in|out|req>`: a key's usage of one model in one
    hour (UNIX hours); the model's name escaped to one token (`escape`)."""
    return f"{USAGE_ROOT}.{check_token(key, 'key name')}.h.{int(hour)}.{escape(model)}.{what}"


def budget_counter(key: str, period: str) -> str:
    """`llmgw.usage.<key>.b.<period>`: the tokens a key used in one budget period."""
    return f"{USAGE_ROOT}.{check_token(key, 'key name')}.b.{check_token(period, 'period')}"


def usage_parts(subject: str) -> tuple[str, int, str, str] | None:
    """(key, hour, model, in|out|req) of an hourly usage subject, or None."""
    parts = subject.split(".")
    if len(parts) != 7 or parts[:2] != ["llmgw", "usage"] or parts[3] != "h":
        return None
    if not parts[4].isdigit() or parts[6] not in ("in", "out", "req"):
        return None
    return parts[2], int(parts[4]), unescape(parts[5]), parts[6]


_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


def escape(name: str) -> str:
    """Any name as one subject token: letters, digits, '_' and '-' as they are, every other
    byte of its UTF-8 as `%XX` (`meta-llama/Llama-3.1` -> `meta-llama%2FLlama-3%2E1`)."""
    if name and all(c in _SAFE for c in name):
        return name
    out = "".join(c if c in _SAFE else "".join(f"%{b:02X}" for b in c.encode()) for c in name)
    return out or "%"


def unescape(token: str) -> str:
    """Inverse of `escape`."""
    if "%" not in token:
        return token
    if token == "%":
        return ""
    raw = bytearray()
    i = 0
    while i < len(token):
        if token[i] == "%" and _hex(token[i + 1 : i + 3]):
            raw.append(int(token[i + 1 : i + 3], 16))
            i += 3
        else:
            raw += token[i].encode()
            i += 1
    return raw.decode("utf-8", "replace")


def _hex(pair: str) -> bool:
    return len(pair) == 2 and all(c in "0123456789ABCDEFabcdef" for c in pair)

"""What each llmgw identity may do on NATS, and its rendering as the nats-server `accounts`
block that `nats/llmgw.conf` includes (docs/security.md explains the design).

Invariant 4 of docs/design.md (every writer owns a namespace, enforced by NATS) lives
here. Two layers:

**Accounts.** The JetStream streams (the log `llmgw-events`, the lease and snapshot buckets)
live in the account `LOG`, where no client connects. Every identity has an account of its
own (`NODE_gpu-01`, `ROUTER_router-1`, ...) that imports from `LOG`, as services, exactly the
subjects that identity may publish. JetStream answers a request on the request's reply
subject; a request that crossed a service import is answered through the server's response
mapping (`_R_...` in `LOG`) and arrives in the requester's own account, where nothing stores
it. So no reply subject can make the server store a message on a subject of the log: a
`$JS.API.DIRECT.GET` answered "to" `llmgw.cmd.<other node>`, a pull request, any API call, all
land in the requester's account. Push consumers deliver inside `LOG`, where no client has
interest, so they deliver nothing: llmgw reads only by requests (pull consumers, message
gets). No account imports a stream: nats-server (2.11 to 2.15 at least) crashes when a
reload races a subscription in an account with stream imports, and every new certificate
is a reload.

**Permissions.** Inside its account each user may publish only what its role needs:

- a **node** publishes only `llmgw.events.node.<its id>.>`, its engines' KV blocks on
  `llmgw.kv.<its id>.*` and their load on `llmgw.signals.node.<its id>`, and consumes only
  `llmgw.cmd.<its id>`, through one durable consumer named `cmd-<its id>` that it may create
  only with exactly that filter (the filtered create subject
  `$JS.API.CONSUMER.CREATE.<stream>.<consumer>.<filter>` lets the server check the filter);
  it may read its own last events and commands and the leader lease;
- a **router** reads: ephemeral/ordered consumers over the streams (the log and
  `llmgw-kv`), direct gets, and read-only access to the lease and snapshot buckets; it
  writes nothing of the log, only its load reports on `llmgw.signals.router.<its name>.*`
  (the stream `llmgw-signals`, which the autoscaler reads);
- an **operator** reads like a router and writes `llmgw.events.operator.<its name>.*`, so the
  author of every operator event is in its subject, enforced by the server;
- the **control** plane manages the stream and the `llmgw-lease` / `llmgw-snapshots` buckets
  (KV or object store), writes `llmgw.events.control.>` and `llmgw.cmd.>` (and the
  `operator.control.<its name>.model_*` events of the models its config file declares), and
  reads all.

Every identity subscribes only to its own inbox namespace `_INBOX.<kind>.<name>.>` (JetStream
replies arrive there), so one client cannot read another's replies. The rules are pure
data (`permissions`, `accounts`); `render` turns them into config text.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from llmgw.core import subjects
from llmgw.pki.identity import Identity

STREAM = subjects.STREAM
KV_STREAM = subjects.KV_STREAM
SIGNALS_STREAM = subjects.SIGNALS_STREAM
LIMITS_STREAM = subjects.LIMITS_STREAM
USAGE_STREAM = subjects.USAGE_STREAM
LEASE_BUCKET = "llmgw-lease"
SNAPSHOT_BUCKET = "llmgw-snapshots"
API = "$JS.API"
# Operator-event kinds the control plane may also write: its config file's models.
CONTROL_MODEL_EVENTS = ("model_declared", "model_changed", "model_removed")
# The account holding the JetStream streams. No client connects to it in a fleet (the test
# harness puts its all-powerful administrator there).
LOG_ACCOUNT = "LOG"
# Requests answered with more than one message: a pull request gets up to a batch of them.
STREAMED_RESPONSES = (f"{API}.CONSUMER.MSG.NEXT.",)


def command_consumer(node: str) -> str:
    """The durable consumer through which node `node` reads `llmgw.cmd.<node>`."""
    return f"cmd-{subjects.check_token(node, 'node id')}"


@dataclass(frozen=True)
class Permissions:
    """Subjects one NATS user may publish to and subscribe to."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    publish_deny: tuple[str, ...] = field(default=())


def _bucket_streams() -> list[str]:
    """The JetStream streams behind the lease and snapshot buckets, KV or object store."""
    return [f"KV_{LEASE_BUCKET}", f"KV_{SNAPSHOT_BUCKET}", f"OBJ_{SNAPSHOT_BUCKET}"]


def _common(identity: Identity) -> tuple[list[str], list[str]]:
    publish = [f"{API}.INFO", f"{API}.STREAM.NAMES", f"{API}.STREAM.INFO.{STREAM}"]
    subscribe = [f"{identity.inbox_prefix}.>"]
    return publish, subscribe


def _read_stream(stream: str) -> list[str]:
    """What a reader needs to replay `stream`: ephemeral or ordered consumers (created without
    or with a name), pull requests, acks and flow-control replies, and direct/last-message gets."""
    return [
        f"{API}.STREAM.INFO.{stream}",
        f"{API}.CONSUMER.CREATE.{stream}",
        f"{API}.CONSUMER.CREATE.{stream}.>",
        f"{API}.CONSUMER.INFO.{stream}.*",
        f"{API}.CONSUMER.MSG.NEXT.{stream}.*",
        # llmgw.bus.Reader deletes its ephemeral consumer when it closes or starts over.
        f"{API}.CONSUMER.DELETE.{stream}.*",
        f"{API}.DIRECT.GET.{stream}",
        f"{API}.DIRECT.GET.{stream}.>",
        f"{API}.STREAM.MSG.GET.{stream}",
        f"$JS.ACK.{stream}.>",
        f"$JS.FC.{stream}.>",
    ]


def _manage_stream(stream: str) -> list[str]:
    """What the control plane needs of a stream it provisions. Not UPDATE (a republish or
    subject transform would write where the control plane may not), not SNAPSHOT or RESTORE
    (a snapshot is sent to a deliver subject of the requester's choosing), not DELETE."""
    return [
        f"{API}.STREAM.CREATE.{stream}",
        f"{API}.STREAM.INFO.{stream}",
        # Object-store writes purge the chunks they replace.
        f"{API}.STREAM.PURGE.{stream}",
        f"{API}.STREAM.MSG.GET.{stream}",
        f"{API}.STREAM.MSG.DELETE.{stream}",
        f"{API}.CONSUMER.*.{stream}",  # CREATE (ephemeral), LIST, NAMES
        f"{API}.CONSUMER.*.{stream}.>",  # CREATE, INFO, DELETE, PAUSE of a named consumer
        f"{API}.CONSUMER.DURABLE.CREATE.{stream}.*",
        f"{API}.CONSUMER.MSG.NEXT.{stream}.*",
        f"{API}.DIRECT.GET.{stream}",
        f"{API}.DIRECT.GET.{stream}.>",
        f"$JS.ACK.{stream}.>",
        f"$JS.FC.{stream}.>",
    ]


def permissions(identity: Identity, nodes: Sequence[str] = ()) -> Permissions:
    """The permissions of `identity`. Purely computational, no side effects.

    `nodes` are the node ids known when rendering: readers other than the node itself are
    denied acking or creating that node's command consumer, so a router cannot swallow a
    node's commands by acknowledging them.
    """
    publish, subscribe = _common(identity)
    deny: list[str] = []
    match identity.kind:
        case "node":
            publish += _node_publish(identity.name)
        case "router" | "operator":
            publish += _reader_publish(identity)
            deny += _others_commands(nodes)
            if identity.kind == "router":
                publish.append(subjects.router_signals_all(identity.name))
                # Tenants' counters: every router adds to the same key's (llmgw.core.quota).
                publish += [f"{subjects.LIMITS_ROOT}.>", f"{subjects.USAGE_ROOT}.>"]
        case "control":
            publish += _control_publish(identity.name)
    return Permissions(
        publish=tuple(dict.fromkeys(publish)),
        subscribe=tuple(dict.fromkeys(subscribe)),
        publish_deny=tuple(dict.fromkeys(deny)),
    )


def _node_publish(node: str) -> list[str]:
    """A node's own: its events, its command consumer, its last messages, the lease."""
    consumer = command_consumer(node)
    return [
        subjects.node_events(node),
        # The KV blocks of its own engines (llmgw.agent.kvrelay), into the stream llmgw-kv.
        subjects.kv_node(node),
        # Its engines' load (llmgw.agent.loads), into the stream llmgw-signals.
        subjects.node_signals(node),
        # Only the filtered form: the server refuses it unless the consumer's
        # filter_subject is exactly llmgw.cmd.<node>.
        f"{API}.CONSUMER.CREATE.{STREAM}.{consumer}.{subjects.command(node)}",
        f"{API}.CONSUMER.INFO.{STREAM}.{consumer}",
        f"{API}.CONSUMER.DELETE.{STREAM}.{consumer}",
        f"{API}.CONSUMER.MSG.NEXT.{STREAM}.{consumer}",
        f"$JS.ACK.{STREAM}.{consumer}.>",
        f"$JS.FC.{STREAM}.{consumer}.>",
        # Its own last events and commands (an agent restarting reads where it was).
        f"{API}.DIRECT.GET.{STREAM}.{subjects.node_events(node)}",
        f"{API}.DIRECT.GET.{STREAM}.{subjects.command(node)}",
        # The leader lease (its bucket holds that one key): an agent obeys no epoch
        # beyond the current leader's. Not a direct get: buckets made before llmgw
        # enabled direct gets on them answer only this.
        f"{API}.STREAM.MSG.GET.KV_{LEASE_BUCKET}",
    ]


def _reader_publish(identity: Identity) -> list[str]:
    """A router's or operator's: reading the log and the buckets; an operator also
    writes its own events."""
    # `nats stream ls` (the operator's view of the log with the nats CLI).
    publish = [f"{API}.STREAM.LIST"]
    publish += _read_stream(STREAM)
    # The engines' KV blocks: routers index them (llmgw.router.kvfeed).
    publish += _read_stream(KV_STREAM)
    for bucket in _bucket_streams():
        publish += _read_stream(bucket)
    if identity.kind == "operator":
        # The routers' load reports: `llmgw ctl explain-scaling` shows the signals now.
        publish += _read_stream(SIGNALS_STREAM)
        # Tenants' usage and rate windows: `llmgw ctl usage`.
        publish += _read_stream(USAGE_STREAM)
        publish += _read_stream(LIMITS_STREAM)
        publish.append(subjects.operator_events(identity.name))
    return publish


def _others_commands(nodes: Sequence[str]) -> list[str]:
    """What a reader may not do to a node's command consumer: ack, create, pull, delete."""
    deny: list[str] = []
    for node in nodes:
        consumer = command_consumer(node)
        deny += [
            f"$JS.ACK.{STREAM}.{consumer}.>",
            f"{API}.CONSUMER.CREATE.{STREAM}.{consumer}",
            f"{API}.CONSUMER.CREATE.{STREAM}.{consumer}.>",
            f"{API}.CONSUMER.MSG.NEXT.{STREAM}.{consumer}",
            f"{API}.CONSUMER.DELETE.{STREAM}.{consumer}",
        ]
    return deny


def _control_publish(name: str) -> list[str]:
    """The control plane's: managing the streams, its decisions and commands, its config
    file's models, the lease and the snapshots."""
    publish = [f"{API}.STREAM.LIST"]
    for stream in [
        STREAM,
        KV_STREAM,
        SIGNALS_STREAM,
        LIMITS_STREAM,
        USAGE_STREAM,
        *_bucket_streams(),
    ]:
        publish += _manage_stream(stream)
    publish += [
        subjects.CONTROL_EVENTS_ALL,
        subjects.COMMANDS_ALL,
        # The models of the control plane's config file become operator events
        # (llmgw.control.models); only these three kinds, never cordon or drain.
        *(subjects.control_operator_event(name, k) for k in CONTROL_MODEL_EVENTS),
        f"$KV.{LEASE_BUCKET}.>",
        f"$KV.{SNAPSHOT_BUCKET}.>",
        f"$O.{SNAPSHOT_BUCKET}.>",
    ]
    return publish


@dataclass(frozen=True)
class User:
    """One user of an account: a certificate DN and what it may do."""

    dn: str
    permissions: Permissions | None  # None: everything (test-only administrators)


def account_name(identity: Identity) -> str:
    """The NATS account of one identity: `NODE_gpu-01`, `OPERATOR_alice`, ... The kind has no
    `_` and comes first, so two identities never share an account."""
    return f"{identity.kind.upper()}_{identity.name}"


@dataclass(frozen=True)
class Account:
    """One identity's account: its user and what it imports from `LOG`.

    `services` are the subjects of `LOG` it may publish to (JetStream API requests and the
    subjects of its own events). Nothing is imported as a stream (see the module's doc)."""

    name: str
    user: User
    services: tuple[str, ...]


def _imports(perms: Permissions) -> tuple[str, ...]:
    # Everything a user may publish is a subject of LOG: the events it writes and the API
    # requests it makes. Its denials are enforced by its own permissions, before any import.
    return perms.publish


def accounts(identities: Iterable[Identity]) -> list[Account]:
    """One account per identity, sorted by kind and name. Pure."""
    ids = sorted(set(identities), key=lambda i: (i.kind, i.name))
    nodes = [i.name for i in ids if i.kind == "node"]
    out = []
    for identity in ids:
        perms = permissions(identity, nodes)
        out.append(
            Account(
                name=account_name(identity),
                user=User(identity.dn, perms),
                services=_imports(perms),
            )
        )
    return out


def exports(accounts_: Sequence[Account]) -> list[tuple[str, tuple[str, ...]]]:
    """`LOG`'s service exports: each subject some account imports, with exactly the accounts
    that import it. Exports are keyed by the very subject imported: nats-server approves an
    import by an export of the same subject first, and among overlapping wildcard exports it
    would take whichever its map yields first."""
    by_subject: dict[str, list[str]] = {}
    for account in accounts_:
        for subject in account.services:
            by_subject.setdefault(subject, []).append(account.name)
    return [(subject, tuple(names)) for subject, names in sorted(by_subject.items())]


def users(identities: Iterable[Identity], *, superusers: Iterable[str] = ()) -> list[User]:
    """Every user, of every account (superusers last)."""
    out = [a.user for a in accounts(identities)]
    out += [User(dn, None) for dn in superusers]
    return out


def _list(items: Iterable[str]) -> str:
    # JSON strings are valid NATS config strings, and quoting keeps `$JS...` from being read
    # as a variable reference.
    return "[" + ", ".join(json.dumps(s) for s in items) + "]"


def _user_lines(user: User, indent: str) -> list[str]:
    lines = [f"{indent}{{", f"{indent}  user: {json.dumps(user.dn)}"]
    perms = user.permissions
    if perms is None:
        lines.append(f'{indent}  permissions: {{ publish: ">", subscribe: ">" }}')
    else:
        lines.append(f"{indent}  permissions: {{")
        lines.append(f"{indent}    publish: {{ allow: {_list(perms.publish)}")
        if perms.publish_deny:
            lines.append(f"{indent}               deny: {_list(perms.publish_deny)}")
        lines.append(f"{indent}    }}")
        lines.append(f"{indent}    subscribe: {{ allow: {_list(perms.subscribe)} }}")
        lines.append(f"{indent}  }}")
    lines.append(f"{indent}}}")
    return lines


def _from_log(subject: str) -> str:
    return f"{{ account: {LOG_ACCOUNT}, subject: {json.dumps(subject)} }}"


def _streamed(subject: str) -> bool:
    return subject.startswith(STREAMED_RESPONSES)


def render(
    identities: Iterable[Identity], *, superusers: Iterable[str] = (), source: str = ""
) -> str:
    """The text of the accounts file for nats-server's `include`. Pure.

    `superusers` are DNs allowed everything inside `LOG`: only the test harness uses them,
    to publish raw garbage and inspect anything.
    """
    accts = accounts(identities)
    lines = [
        "# Rendered by llmgw from the client certificates"
        + (f" in {source}" if source else "")
        + ": do not edit.",
        "# Issue or remove a certificate with `llmgw ctl cert`, which renders this file again;",
        "# then apply it without a restart by reloading twice, a second apart (a new identity's",
        "# account answers only after the second): nats-server --signal reload=<pid> (SIGHUP).",
        "# The streams live in the account LOG, which no client of the fleet joins; each",
        "# identity has its own account importing only what it may publish (docs/security.md).",
        "accounts {",
        f"  {LOG_ACCOUNT}: {{",
        "    jetstream: enabled",
        "    users: [",
    ]
    for dn in superusers:
        lines += _user_lines(User(dn, None), "      ")
    lines += ["    ]", "    exports: ["]
    for subject, names in exports(accts):
        response = ", response_type: stream" if _streamed(subject) else ""
        lines.append(
            f"      {{ service: {json.dumps(subject)}, accounts: {_list(names)}{response} }}"
        )
    lines += ["    ]", "  }"]
    for account in accts:
        lines.append(f"  {json.dumps(account.name)}: {{")
        lines.append("    users: [")
        lines += _user_lines(account.user, "      ")
        lines.append("    ]")
        lines.append("    imports: [")
        for subject in account.services:
            lines.append(f"      {{ service: {_from_log(subject)} }}")
        lines += ["    ]", "  }"]
    lines += ["}", ""]
    return "\n".join(lines)

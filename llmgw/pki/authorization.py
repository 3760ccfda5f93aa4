"""What each llmgw identity may do on NATS, and its rendering as a nats-server `authorization`
block (the file `nats/llmgw.conf` includes).

DESIGN.md invariant 4 — every writer owns a namespace, enforced by NATS — lives here:

- a **node** publishes only `llmgw.events.node.<its id>.>` and consumes only
  `llmgw.cmd.<its id>`, through one durable consumer named `cmd-<its id>` that it may create
  only with exactly that filter (the filtered create subject
  `$JS.API.CONSUMER.CREATE.<stream>.<consumer>.<filter>` lets the server check the filter);
- a **router** only reads: ephemeral/ordered consumers over the stream, direct gets, and
  read-only access to the lease and snapshot buckets;
- an **operator** reads like a router and writes `llmgw.events.operator.>`;
- the **control** plane manages the stream and the `llmgw-lease` / `llmgw-snapshots` buckets
  (KV or object store), writes `llmgw.events.control.>` and `llmgw.cmd.>` (and the
  `operator.model_*` events of the models its config file declares), and reads all.

Every identity subscribes only to its own inbox namespace `_INBOX.<kind>.<name>.>` (JetStream
replies and push-consumer deliveries arrive there), so one client cannot read another's
replies. The rules are pure data (`permissions`); `render` turns them into config text.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from llmgw.core import subjects
from llmgw.pki.identity import Identity

STREAM = subjects.STREAM
LEASE_BUCKET = "llmgw-lease"
SNAPSHOT_BUCKET = "llmgw-snapshots"
API = "$JS.API"
# Operator-event kinds the control plane may also write: its config file's models.
CONTROL_MODEL_EVENTS = ("model_declared", "model_changed", "model_removed")


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
    return [
        f"{API}.STREAM.*.{stream}",  # CREATE, UPDATE, INFO, DELETE, PURGE
        f"{API}.STREAM.MSG.*.{stream}",  # GET, DELETE
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
            node = identity.name
            consumer = command_consumer(node)
            publish += [
                subjects.node_events(node),
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
                # The leader lease: a command's epoch must not exceed the current holder's.
                "$JS.API.DIRECT.GET.KV_llmgw-lease.$KV.llmgw-lease.leader",
            ]
        case "router" | "operator":
            publish += _read_stream(STREAM)
            for bucket in _bucket_streams():
                publish += _read_stream(bucket)
            if identity.kind == "operator":
                publish.append(subjects.OPERATOR_EVENTS_ALL)
            for node in nodes:
                consumer = command_consumer(node)
                deny += [
                    f"$JS.ACK.{STREAM}.{consumer}.>",
                    f"{API}.CONSUMER.CREATE.{STREAM}.{consumer}",
                    f"{API}.CONSUMER.CREATE.{STREAM}.{consumer}.>",
                    f"{API}.CONSUMER.MSG.NEXT.{STREAM}.{consumer}",
                    f"{API}.CONSUMER.DELETE.{STREAM}.{consumer}",
                ]
        case "control":
            publish.append(f"{API}.STREAM.LIST")
            for stream in [STREAM, *_bucket_streams()]:
                publish += _manage_stream(stream)
            publish += [
                subjects.CONTROL_EVENTS_ALL,
                subjects.COMMANDS_ALL,
                # The models of the control plane's config file become operator events
                # (llmgw.control.models); only these three kinds, never cordon or drain.
                *(subjects.operator_event(k) for k in CONTROL_MODEL_EVENTS),
                f"$KV.{LEASE_BUCKET}.>",
                f"$KV.{SNAPSHOT_BUCKET}.>",
                f"$O.{SNAPSHOT_BUCKET}.>",
            ]
    return Permissions(
        publish=tuple(dict.fromkeys(publish)),
        subscribe=tuple(dict.fromkeys(subscribe)),
        publish_deny=tuple(dict.fromkeys(deny)),
    )


@dataclass(frozen=True)
class User:
    """One `authorization.users` entry: a certificate DN and what it may do."""

    dn: str
    permissions: Permissions | None  # None: everything (test-only administrators)


def users(identities: Iterable[Identity], *, superusers: Iterable[str] = ()) -> list[User]:
    ids = sorted(set(identities), key=lambda i: (i.kind, i.name))
    nodes = [i.name for i in ids if i.kind == "node"]
    out = [User(i.dn, permissions(i, nodes)) for i in ids]
    out += [User(dn, None) for dn in superusers]
    return out


def _list(items: Iterable[str]) -> str:
    # JSON strings are valid NATS config strings, and quoting keeps `$JS...` from being read
    # as a variable reference.
    return "[" + ", ".join(json.dumps(s) for s in items) + "]"


def render(
    identities: Iterable[Identity], *, superusers: Iterable[str] = (), source: str = ""
) -> str:
    """The text of the authorization file for nats-server's `include`. Pure.

    `superusers` are DNs allowed everything: only the test harness uses them, to publish
    raw garbage and inspect anything.
    """
    lines = [
        "# Rendered by llmgw from the client certificates"
        + (f" in {source}" if source else "")
        + ": do not edit.",
        "# Issue or remove a certificate with `llmgw ctl cert`, which renders this file again;",
        "# then apply it without a restart: nats-server --signal reload=<pid> (or SIGHUP).",
        "authorization {",
        "  users = [",
    ]
    for user in users(identities, superusers=superusers):
        lines.append("    {")
        lines.append(f"      user: {json.dumps(user.dn)}")
        perms = user.permissions
        if perms is None:
            lines.append('      permissions: { publish: ">", subscribe: ">" }')
        else:
            lines.append("      permissions: {")
            lines.append(f"        publish: {{ allow: {_list(perms.publish)}")
            if perms.publish_deny:
                lines.append(f"                   deny: {_list(perms.publish_deny)}")
            lines.append("        }")
            lines.append(f"        subscribe: {{ allow: {_list(perms.subscribe)} }}")
            lines.append("      }")
        lines.append("    }")
    lines += ["  ]", "}", ""]
    return "\n".join(lines)

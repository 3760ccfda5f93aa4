"""Who may publish and subscribe where: docs/design.md invariant 4 checked on the permission data
for any identity names (Hypothesis), with NATS's own wildcard semantics. The real server
enforcing these rules is tests/integration/test_auth.py."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llmgw.core import subjects
from llmgw.pki import authorization
from llmgw.pki.authorization import Permissions, permissions
from llmgw.pki.identity import KINDS, Identity

names = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,20}", fullmatch=True)
kinds_of_events = st.from_regex(r"[a-z_]{1,12}", fullmatch=True) | st.sampled_from(
    ["heartbeat", "model_declared", "node_cordoned", "node_drain_requested", "leader_elected"]
)
STREAM = subjects.STREAM


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` is one whole token, `>` one or more trailing tokens."""
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(p) == len(s)


def may_publish(perms: Permissions, subject: str) -> bool:
    allowed = any(matches(p, subject) for p in perms.publish)
    return allowed and not any(matches(p, subject) for p in perms.publish_deny)


def may_subscribe(perms: Permissions, subject: str) -> bool:
    return any(matches(p, subject) for p in perms.subscribe)


def test_matches_follows_nats_wildcards() -> None:
    assert matches("a.*.c", "a.b.c")
    assert not matches("a.*", "a.b.c")
    assert matches("a.>", "a.b.c")
    assert not matches("a.>", "a")
    assert not matches("router-*", "router-1")  # wildcards are whole tokens only
    assert matches("a.b", "a.b")
    assert not matches("a.b", "a.b.c")


@given(a=names, b=names, kind=kinds_of_events)
def test_a_node_writes_only_its_own_events(a: str, b: str, kind: str) -> None:
    perms = permissions(Identity("node", a), nodes=[a, b])
    assert may_publish(perms, subjects.node_event(a, kind))
    if a != b:
        assert not may_publish(perms, subjects.node_event(b, kind))
    assert not may_publish(perms, subjects.command(a))
    assert not may_publish(perms, subjects.command(b))
    assert not may_publish(perms, subjects.control_event(kind))
    assert not may_publish(perms, subjects.operator_event(a, kind))


@given(a=names, b=names)
def test_a_node_consumes_only_its_own_commands(a: str, b: str) -> None:
    perms = permissions(Identity("node", a), nodes=[a, b])
    mine = authorization.command_consumer(a)
    # The only consumer it may create carries its own filter in the create subject.
    creates = [p for p in perms.publish if p.startswith("$JS.API.CONSUMER.CREATE.")]
    assert creates == [f"$JS.API.CONSUMER.CREATE.{STREAM}.{mine}.{subjects.command(a)}"]
    assert not any("DURABLE" in p for p in perms.publish)
    assert may_publish(perms, f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.{mine}")
    assert may_publish(perms, f"$JS.ACK.{STREAM}.{mine}.1.5.5.1700000000.0")
    if a != b:
        theirs = authorization.command_consumer(b)
        assert not may_publish(perms, f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.{theirs}")
        assert not may_publish(perms, f"$JS.ACK.{STREAM}.{theirs}.1.5.5.1700000000.0")
        assert not may_publish(perms, f"$JS.API.DIRECT.GET.{STREAM}.{subjects.command(b)}")
        assert not may_publish(
            perms, f"$JS.API.CONSUMER.CREATE.{STREAM}.{mine}.{subjects.command(b)}"
        )
    # No ordered or ephemeral consumer over the stream, which could filter on anything.
    assert not may_publish(perms, f"$JS.API.CONSUMER.CREATE.{STREAM}")
    assert not may_subscribe(perms, subjects.command(a))


@given(kind=st.sampled_from(KINDS), name=names, other=names)
def test_everyone_subscribes_only_in_their_own_inbox(kind: str, name: str, other: str) -> None:
    identity = Identity(kind, name)  # type: ignore[arg-type]
    perms = permissions(identity)
    assert all(p.startswith(f"{identity.inbox_prefix}.") for p in perms.subscribe)
    assert may_subscribe(perms, f"{identity.inbox_prefix}.abc.def")
    if other != name:
        assert not may_subscribe(perms, f"_INBOX.{kind}.{other}.abc")
    assert not may_subscribe(perms, "_INBOX.abc")
    assert not may_subscribe(perms, "llmgw.events.node.x.heartbeat")


@given(name=names, node=names, kind=kinds_of_events)
def test_a_router_writes_nothing_in_the_log(name: str, node: str, kind: str) -> None:
    perms = permissions(Identity("router", name), nodes=[node])
    for subject in (
        subjects.node_event(node, kind),
        subjects.operator_event(name, kind),
        subjects.control_event(kind),
        subjects.command(node),
        f"$KV.{authorization.LEASE_BUCKET}.leader",
        f"$O.{authorization.SNAPSHOT_BUCKET}.C.x",
        f"$JS.API.STREAM.PURGE.{STREAM}",
        f"$JS.API.STREAM.DELETE.{STREAM}",
        f"$JS.API.STREAM.MSG.DELETE.{STREAM}",
        f"$JS.API.STREAM.UPDATE.{STREAM}",
    ):
        assert not may_publish(perms, subject), subject
    # Reading: ordered consumers, pulls, direct gets, the lease.
    assert may_publish(perms, f"$JS.API.CONSUMER.CREATE.{STREAM}")
    assert may_publish(perms, f"$JS.API.DIRECT.GET.{STREAM}")
    assert may_publish(perms, f"$JS.API.DIRECT.GET.KV_{authorization.LEASE_BUCKET}.$KV.x.y")
    # Nor can it consume a node's commands through that node's consumer.
    theirs = authorization.command_consumer(node)
    assert not may_publish(perms, f"$JS.ACK.{STREAM}.{theirs}.1.5.5.1700000000.0")
    assert not may_publish(perms, f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.{theirs}")
    assert not may_publish(perms, f"$JS.API.CONSUMER.CREATE.{STREAM}.{theirs}.x")
    assert not may_publish(perms, f"$JS.API.CONSUMER.DELETE.{STREAM}.{theirs}")
    # Its own readers' consumers it may delete (llmgw.bus.Reader does when it stops).
    assert may_publish(perms, f"$JS.API.CONSUMER.DELETE.{STREAM}.reader-0a1b2c")


@given(
    name=names,
    kind=kinds_of_events | st.sampled_from(authorization.CONTROL_MODEL_EVENTS),
    node=names,
)
def test_only_operators_write_operator_events(name: str, kind: str, node: str) -> None:
    subject = subjects.operator_event(name, kind)
    for who in KINDS:
        perms = permissions(Identity(who, name))  # type: ignore[arg-type]
        assert may_publish(perms, subject) == (who == "operator"), who
        # The one exception: the control plane publishes the models of its config file as
        # operator.model_* events, in a namespace of its own; nothing else of the operator's
        # (cordon, drain...).
        own = subjects.control_operator_event(name, kind)
        allowed = who == "control" and kind in authorization.CONTROL_MODEL_EVENTS
        assert may_publish(perms, own) == allowed, who
    operator = permissions(Identity("operator", name))
    # Each operator writes under its own name only, and never in a control plane's namespace
    # (an operator named "control" included: the control plane's subjects are one token
    # longer).
    assert not may_publish(operator, subjects.operator_event(f"{name}x", kind))
    assert not may_publish(operator, f"llmgw.events.operator.{kind}")
    assert not may_publish(operator, subjects.control_operator_event(name, kind))
    if name == "control":
        assert not may_publish(operator, subjects.control_operator_event("c1", kind))
    assert not may_publish(operator, subjects.control_event(kind))
    assert not may_publish(operator, subjects.command(node))
    assert not may_publish(operator, subjects.node_event(node, kind))


@given(name=names, kind=kinds_of_events, node=names)
def test_only_control_writes_decisions_commands_and_the_lease(
    name: str, kind: str, node: str
) -> None:
    for subject in (
        subjects.control_event(kind),
        subjects.command(node),
        f"$KV.{authorization.LEASE_BUCKET}.leader",
        f"$JS.API.STREAM.CREATE.{STREAM}",
        f"$JS.API.STREAM.CREATE.KV_{authorization.LEASE_BUCKET}",
        f"$JS.API.STREAM.CREATE.OBJ_{authorization.SNAPSHOT_BUCKET}",
    ):
        for who in KINDS:
            perms = permissions(Identity(who, name))  # type: ignore[arg-type]
            assert may_publish(perms, subject) == (who == "control"), (who, subject)
    control = permissions(Identity("control", name))
    assert not may_publish(control, subjects.node_event(node, kind))
    assert not may_publish(control, subjects.operator_event(name, kind))
    assert may_publish(control, subjects.control_operator_event(name, kind)) == (
        kind in authorization.CONTROL_MODEL_EVENTS
    )
    assert not may_publish(control, "$JS.API.STREAM.CREATE.other")


def test_render_lists_every_identity_and_the_superusers() -> None:
    ids = [Identity("node", "n1"), Identity("router", "r1"), Identity("node", "n1")]
    text = authorization.render(ids, superusers=["CN=admin,OU=test,O=llmgw-test"])
    assert text.count('user: "CN=n1,OU=node,O=llmgw"') == 1
    assert 'user: "CN=r1,OU=router,O=llmgw"' in text
    assert 'user: "CN=admin,OU=test,O=llmgw-test"' in text
    assert '"$JS.ACK.llmgw-events.cmd-n1.>"' in text  # the router's deny list
    # One account each, and the streams' account with the superuser only.
    assert "accounts {" in text
    assert '"NODE_n1": {' in text
    assert '"ROUTER_r1": {' in text
    assert text.count("jetstream: enabled") == 1
    # Each user is rendered with its own permissions, and each export only to the accounts
    # that import it.
    assert 'subscribe: { allow: ["_INBOX.node.n1.>"] }' in text
    assert '{ service: "llmgw.events.node.n1.>", accounts: ["NODE_n1"] }' in text


@given(st.lists(st.tuples(st.sampled_from(KINDS), names), min_size=1, max_size=6))
def test_no_account_imports_or_exports_a_stream(ids: list[tuple[str, str]]) -> None:
    """nats-server crashes when a reload races a subscription in an account that imports a
    stream (docs/security.md), and every issued certificate is a reload: only services."""
    text = authorization.render([Identity(k, n) for k, n in ids])  # type: ignore[arg-type]
    assert "{ stream:" not in text
    assert text.count("{ service:") >= 2 * len({(k, n) for k, n in ids})


@given(name=names, node=names, who=st.sampled_from(["router", "operator"]))
def test_no_reader_can_consume_a_nodes_commands(name: str, node: str, who: str) -> None:
    perms = permissions(Identity(who, name), nodes=[node])  # type: ignore[arg-type]
    theirs = authorization.command_consumer(node)
    for subject in (
        f"$JS.ACK.{STREAM}.{theirs}.1.5.5.1700000000.0",
        f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.{theirs}",
        f"$JS.API.CONSUMER.CREATE.{STREAM}.{theirs}",
        f"$JS.API.CONSUMER.CREATE.{STREAM}.{theirs}.{subjects.command(node)}",
        f"$JS.API.CONSUMER.DELETE.{STREAM}.{theirs}",
    ):
        assert not may_publish(perms, subject), subject


@given(a=names, b=names)
def test_kv_blocks_and_load_reports_are_written_only_by_their_own_writer(a: str, b: str) -> None:
    node, router = permissions(Identity("node", a)), permissions(Identity("router", a))
    assert may_publish(node, subjects.kv_updates(a, "engine-1"))
    assert may_publish(node, subjects.node_signals(a))
    assert may_publish(router, subjects.router_signals(a, 0))
    if a != b:
        assert not may_publish(node, subjects.kv_updates(b, "engine-1"))
        assert not may_publish(node, subjects.node_signals(b))
        assert not may_publish(router, subjects.router_signals(b, 0))
    for who in KINDS:
        perms = permissions(Identity(who, a))  # type: ignore[arg-type]
        assert may_publish(perms, subjects.kv_updates(a, "e")) == (who == "node"), who
        assert may_publish(perms, subjects.node_signals(a)) == (who == "node"), who
        assert may_publish(perms, subjects.router_signals(a, 1)) == (who == "router"), who


@given(name=names)
def test_the_control_plane_cannot_rewrite_remove_or_copy_out_a_stream(name: str) -> None:
    """Not UPDATE (a republish or subject transform would write where it may not), DELETE,
    SNAPSHOT or RESTORE (a snapshot goes to a deliver subject of the requester's choosing)."""
    control = permissions(Identity("control", name))
    buckets = (authorization.LEASE_BUCKET, authorization.SNAPSHOT_BUCKET)
    streams = [STREAM, subjects.KV_STREAM, subjects.SIGNALS_STREAM, subjects.LIMITS_STREAM]
    streams += [subjects.USAGE_STREAM, *(f"KV_{b}" for b in buckets), f"OBJ_{buckets[1]}"]
    for stream in streams:
        assert may_publish(control, f"$JS.API.STREAM.CREATE.{stream}")
        for action in ("UPDATE", "DELETE", "SNAPSHOT", "RESTORE"):
            assert not may_publish(control, f"$JS.API.STREAM.{action}.{stream}"), action
    # Its config file's models only under its own name.
    assert may_publish(control, subjects.control_operator_event(name, "model_declared"))
    assert not may_publish(control, subjects.control_operator_event(f"{name}x", "model_declared"))

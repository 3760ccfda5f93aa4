"""Every writer owns a namespace, enforced by NATS (docs/design.md invariant 4): tests against
a real nats-server with mutual TLS and the authorization rendered from the issued
certificates.

A refused publish surfaces in nats-py only as a timeout; each test therefore also checks that
the server itself reported the permissions violation (through error_cb), so a test cannot
pass merely because something was slow.
"""

from __future__ import annotations

import asyncio
import json

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy

from llmgw import bus
from llmgw.core import events, subjects
from llmgw.pki import authorization
from llmgw.pki.identity import Identity
from tests.harness import Connector, TestNatsServer

STREAM = subjects.STREAM
REFUSED = 0.5  # seconds to wait for the ack of a publish the server is expected to refuse


async def provision(nc: Client) -> None:
    """The stream, as the control plane creates it (llmgw.bus owns the real provisioning)."""
    js = nc.jetstream()
    await js.add_stream(
        name=STREAM, subjects=list(subjects.STREAM_SUBJECTS), allow_direct=True, max_age=0
    )


def heartbeat(node: str, seq: int = 1) -> events.Heartbeat:
    return events.Heartbeat(id=f"hb-{node}-{seq}", ts=1_700_000_000.0 + seq, node=node, seq=seq)


async def js_publish(nc: Client, event: events.Event, subject: str | None = None) -> int:
    ack = await nc.jetstream().publish(
        subject or events.subject_of(event),
        events.encode(event),
        headers={"Nats-Msg-Id": event.id},
        timeout=REFUSED if subject else 5,
    )
    return ack.seq


async def refused(connect: Connector, nc: Client, kind: str, name: str, subject: str) -> str:
    """Publish to `subject` through JetStream, expect no ack and the server's violation."""
    before = len(connect.violations(kind, name))
    with pytest.raises(nats.errors.TimeoutError):
        await nc.jetstream().publish(subject, b"{}", timeout=REFUSED)
    message = await connect.violation(kind, name)
    assert len(connect.violations(kind, name)) > before
    # nats-py lower-cases the server's error text.
    assert subject.lower() in message
    assert "publish" in message.lower()
    return message


async def test_node_publishes_its_own_heartbeat(connect: Connector) -> None:
    await provision(await connect("control", "control-1"))
    node = await connect("node", "node-a")
    event = heartbeat("node-a")
    seq = await js_publish(node, event)
    assert seq == 1

    admin = await connect.admin()
    msg = await admin.jetstream().get_msg(STREAM, seq)
    assert msg.subject == "llmgw.events.node.node-a.heartbeat"
    assert events.decode(msg.data) == event
    assert connect.errors[("node", "node-a")] == []


async def test_node_cannot_write_outside_its_namespace(connect: Connector) -> None:
    await provision(await connect("control", "control-1"))
    node = await connect("node", "node-a")
    await refused(connect, node, "node", "node-a", subjects.node_event("node-b", "heartbeat"))
    await refused(connect, node, "node", "node-a", subjects.control_event("leader_elected"))
    own_name = subjects.operator_event("node-a", "node_cordoned")
    await refused(connect, node, "node", "node-a", own_name)
    # Not even its own command subject: only the control plane writes commands.
    await refused(connect, node, "node", "node-a", subjects.command("node-a"))
    # Nor the stream itself.
    with pytest.raises(nats.errors.TimeoutError):
        await node.jetstream(timeout=REFUSED).purge_stream(STREAM)
    assert "$js.api.stream.purge" in await connect.violation("node", "node-a")

    # Nothing of that reached the stream; the node still writes its own subjects.
    admin = await connect.admin()
    assert (await admin.jetstream().stream_info(STREAM)).state.messages == 0
    assert await js_publish(node, heartbeat("node-a")) == 1


async def test_node_reads_only_its_own_commands(connect: Connector) -> None:
    control = await connect("control", "control-1")
    await provision(control)
    cjs = control.jetstream()
    await cjs.publish(subjects.command("node-a"), b'{"for":"node-a"}')
    await cjs.publish(subjects.command("node-b"), b'{"for":"node-b"}')

    node = await connect("node", "node-a")
    js = node.jetstream()
    # Its own durable command consumer, created with exactly its filter: allowed.
    sub = await js.pull_subscribe(
        subjects.command("node-a"), durable=authorization.command_consumer("node-a"), stream=STREAM
    )
    msgs = await sub.fetch(5, timeout=2)
    assert [m.data for m in msgs] == [b'{"for":"node-a"}']
    await msgs[0].ack_sync()
    assert connect.errors[("node", "node-a")] == []

    # Another node's commands, through every door: the server refuses each.
    attempts = [
        # its own consumer name, another node's filter
        ConsumerConfig(
            name="cmd-node-a", durable_name="cmd-node-a", filter_subject="llmgw.cmd.node-b"
        ),
        # the other node's consumer
        ConsumerConfig(
            name="cmd-node-b", durable_name="cmd-node-b", filter_subject="llmgw.cmd.node-b"
        ),
        # an unnamed ephemeral consumer, as an ordered consumer would create
        ConsumerConfig(filter_subject="llmgw.cmd.node-b", deliver_policy=DeliverPolicy.ALL),
        # a legacy durable create, whose subject does not carry the filter
        ConsumerConfig(durable_name="sneaky", filter_subject="llmgw.cmd.node-b"),
    ]
    for config in attempts:
        before = len(connect.violations("node", "node-a"))
        with pytest.raises(nats.errors.TimeoutError):
            await js.add_consumer(STREAM, config=config, timeout=REFUSED)
        await connect.violation("node", "node-a")
        assert len(connect.violations("node", "node-a")) > before, config

    # A plain subscription to the other node's command subject is refused too.
    await node.subscribe(subjects.command("node-b"))
    await node.flush()
    message = await connect.violation("node", "node-a")
    assert "subscription" in message
    assert "llmgw.cmd.node-b" in message

    # And the other node's messages cannot be fetched by direct get of its subject.
    with pytest.raises(nats.errors.TimeoutError):
        await node.jetstream(timeout=REFUSED).get_last_msg(
            STREAM, subjects.command("node-b"), direct=True
        )


async def test_router_reads_everything_and_writes_nothing(connect: Connector) -> None:
    control = await connect("control", "control-1")
    await provision(control)
    node = await connect("node", "node-a")
    for i in range(1, 4):
        await js_publish(node, heartbeat("node-a", i))

    router = await connect("router", "router-1")
    js = router.jetstream()
    # Reads go by request (pull consumers, message gets): push consumers deliver nothing to a
    # client (docs/security.md).
    got = [events.decode((await js.get_msg(STREAM, seq)).data) for seq in (1, 2, 3)]
    assert [e.seq for e in got if isinstance(e, events.Heartbeat)] == [1, 2, 3]
    last = await js.get_last_msg(STREAM, subjects.node_event("node-a", "heartbeat"), direct=True)
    assert events.decode(last.data) == heartbeat("node-a", 3)

    for subject in (
        subjects.node_event("node-a", "heartbeat"),
        subjects.operator_event("router-1", "model_declared"),
        subjects.control_event("endpoint_up"),
        subjects.command("node-a"),
    ):
        await refused(connect, router, "router", "router-1", subject)
    # Nor may it swallow a node's commands through that node's consumer.
    with pytest.raises(nats.errors.TimeoutError):
        await js.add_consumer(
            STREAM,
            config=ConsumerConfig(
                name="cmd-node-a", durable_name="cmd-node-a", filter_subject="llmgw.cmd.node-a"
            ),
            timeout=REFUSED,
        )
    assert "cmd-node-a" in await connect.violation("router", "router-1")


async def test_operator_writes_operator_subjects_only(connect: Connector) -> None:
    await provision(await connect("control", "control-1"))
    operator = await connect("operator", "alice")
    cordon = events.NodeCordoned(id="op-1", ts=1.0, operator="alice", node="node-a")
    assert await js_publish(operator, cordon) == 1
    assert events.decode((await operator.jetstream().get_msg(STREAM, 1)).data) == cordon
    # What the nats CLI does for `stream ls`, `stream info` and `stream get --last-for`.
    js = operator.jetstream()
    assert STREAM in [info.config.name for info in await js.streams_info()]
    assert (await js.stream_info(STREAM)).state.messages == 1
    last = await js.get_last_msg(STREAM, events.subject_of(cordon))
    assert events.decode(last.data) == cordon
    await refused(connect, operator, "operator", "alice", subjects.control_event("replica_placed"))
    await refused(connect, operator, "operator", "alice", subjects.command("node-a"))
    await refused(connect, operator, "operator", "alice", subjects.node_event("node-a", "shard"))


async def test_control_manages_stream_and_buckets(connect: Connector) -> None:
    control = await connect("control", "control-1")
    await provision(control)
    js = control.jetstream()
    elected = events.LeaderElected(id="le-1", ts=1.0, leader="control-1", epoch=1)
    assert await js_publish(control, elected) == 1
    await js.publish(subjects.command("node-a"), b"{}")
    lease = await js.create_key_value(bucket=authorization.LEASE_BUCKET, history=1)
    await lease.put("leader", b"control-1")
    assert (await lease.get("leader")).value == b"control-1"
    await js.create_object_store(bucket=authorization.SNAPSHOT_BUCKET)
    await (await bus.SnapshotStore.open(js)).save(b"x" * 300_000, 7)

    # Readers may read the lease and the snapshots, not write them.
    router = await connect("router", "router-1")
    rjs = router.jetstream()
    assert (await (await rjs.key_value(authorization.LEASE_BUCKET)).get("leader")).value == (
        b"control-1"
    )
    assert await (await bus.SnapshotStore.open(rjs)).load() == bus.Snapshot(7, b"x" * 300_000)
    await refused(connect, router, "router", "router-1", f"$KV.{authorization.LEASE_BUCKET}.leader")

    # Control writes no node or operator events.
    await refused(
        connect, control, "control", "control-1", subjects.node_event("node-a", "heartbeat")
    )
    await refused(
        connect,
        control,
        "control",
        "control-1",
        subjects.operator_event("control-1", "node_cordoned"),
    )
    # And creates no other stream.
    with pytest.raises(nats.errors.TimeoutError):
        await control.jetstream(timeout=REFUSED).add_stream(name="other", subjects=["other.>"])
    assert "$js.api.stream.create.other" in await connect.violation("control", "control-1")


async def test_identities_cannot_read_each_others_inboxes(connect: Connector) -> None:
    node = await connect("node", "node-a")
    await node.subscribe("_INBOX.node.node-b.>")
    await node.subscribe("_INBOX.>")
    await node.flush()
    await asyncio.sleep(0.05)
    assert len(connect.violations("node", "node-a")) == 2


# -- who may connect at all ---------------------------------------------------------------


async def cannot_connect(nats_server: TestNatsServer, tls: object, reason: str) -> None:
    """Connect once with `tls`: the server must refuse, and log `reason` for it (the client
    side only sees an SSL alert or a reset, which could have other causes)."""
    before = nats_server.log_path.read_text().count(reason)
    try:
        nc = await nats.connect(nats_server.url, tls=tls, allow_reconnect=False, connect_timeout=2)
    except Exception:
        pass
    else:
        await bus.close(nc)
        raise AssertionError("the server accepted a client it should have refused")
    for _ in range(200):
        if nats_server.log_path.read_text().count(reason) > before:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"server log does not say {reason!r}:\n{nats_server.log_tail(5)}")


async def test_a_certificate_from_another_ca_cannot_connect(
    connect: Connector, nats_server: TestNatsServer
) -> None:
    await connect("node", "node-a")  # the identity itself is fine
    await cannot_connect(
        nats_server, nats_server.pki.foreign_tls("node", "node-a"), "signed by unknown authority"
    )


async def test_a_client_without_certificate_cannot_connect(nats_server: TestNatsServer) -> None:
    await cannot_connect(
        nats_server, nats_server.pki.anonymous_tls(), "didn't provide a certificate"
    )


async def test_an_expired_certificate_cannot_connect(
    connect: Connector, nats_server: TestNatsServer
) -> None:
    await connect("node", "node-expired")
    await cannot_connect(
        nats_server, nats_server.pki.expired_tls("node", "node-expired"), "certificate has expired"
    )


async def test_a_new_identity_connects_after_a_reload_without_restart(
    connect: Connector, nats_server: TestNatsServer
) -> None:
    pki = nats_server.pki
    await provision(await connect("control", "control-1"))
    old = await connect("node", "node-a")
    pid = nats_server.pid

    fresh = Identity("node", "node-late")
    pki.issue(fresh, reload=False)
    ctx = pki.client_tls("node", "node-late")
    # Issued and rendered, but the server has not re-read its authorization yet.
    await cannot_connect(nats_server, ctx, "authentication error")

    nats_server.reload()
    late = await connect("node", "node-late")
    assert await js_publish(late, heartbeat("node-late")) == 1
    # Same process, and the connection made before the reload still works.
    assert nats_server.pid == pid
    assert old.is_connected
    assert await js_publish(old, heartbeat("node-a")) == 2


async def _page(nc: Client, name: str, inbox: str, page: int) -> list[Msg]:
    """The JetStream API calls of `nats stream view llmgw-events` (the nats CLI's stream
    pager, from jsm.go): a named pull consumer over the stream, one no-wait batch of a
    page into the client's own inbox, an ack for each message, the consumer deleted."""
    config = {
        "stream_name": STREAM,
        "config": {
            "name": name,
            "durable_name": name,
            "description": "JSM Stream Pager",
            "deliver_policy": "all",
            "ack_policy": "explicit",
            "ack_wait": 30_000_000_000,
            "replay_policy": "instant",
            "inactive_threshold": 3_600_000_000_000,
            "mem_storage": True,
            "num_replicas": 1,
        },
    }
    created = await nc.request(
        f"{authorization.API}.CONSUMER.CREATE.{STREAM}.{name}",
        json.dumps(config).encode(),
        timeout=2,
    )
    assert "error" not in json.loads(created.data), created.data
    sub = await nc.subscribe(inbox)
    await nc.publish(
        f"{authorization.API}.CONSUMER.MSG.NEXT.{STREAM}.{name}",
        json.dumps({"batch": page, "no_wait": True}).encode(),
        reply=inbox,
    )
    got: list[Msg] = []
    while True:
        msg = await sub.next_msg(timeout=2)
        if msg.headers and msg.headers.get("Status") in ("404", "408"):
            break
        if not msg.data and msg.headers:  # another status (a terminal one) ends the page
            break
        got.append(msg)
        await msg.ack()
        if len(got) == page:
            break
    await sub.unsubscribe()
    deleted = await nc.request(
        f"{authorization.API}.CONSUMER.DELETE.{STREAM}.{name}", b"", timeout=2
    )
    assert json.loads(deleted.data).get("success") is True, deleted.data
    return got


async def test_an_operator_pages_the_log_as_nats_stream_view_does(connect: Connector) -> None:
    """The nats CLI reads by request too (its `stream view` is a pull consumer), so it works
    without push deliveries; a node, whose permissions name only its own consumer, cannot."""
    await provision(await connect("control", "control-1"))
    node = await connect("node", "node-a")
    for i in range(1, 31):
        await js_publish(node, heartbeat("node-a", i))
    operator = await connect("operator", "alice")
    page = await _page(operator, "stream_pager_1", "_INBOX.operator.alice.pager", 25)
    assert [events.decode(m.data).seq for m in page] == list(range(1, 26))  # type: ignore[union-attr]
    assert page[0].metadata.sequence.stream == 1
    assert connect.violations("operator", "alice") == []

    with pytest.raises(nats.errors.TimeoutError):
        await node.request(
            f"{authorization.API}.CONSUMER.CREATE.{STREAM}.stream_pager_2",
            b"{}",
            timeout=REFUSED,
        )
    assert "stream_pager_2" in await connect.violation("node", "node-a")

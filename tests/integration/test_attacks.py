"""The attacks that broke an earlier llmgw, each replayed the way it was done, against a real
nats-server with the rendered accounts: a node, a router or an operator makes the server copy
a message of its choosing onto a subject it does not own, or writes under another's name.
tests/integration/test_log_integrity.py tries every request at every subject; these name
the harm each one did and check it with the reader that acted on it."""

from __future__ import annotations

import asyncio

import nats.errors
import pytest
from nats.aio.client import Client

from llmgw import bus
from llmgw.core import events, subjects
from llmgw.core.profile import LaunchSpec
from llmgw.pki import authorization
from tests.harness import Connector, signed_headers
from tests.integration.test_log_integrity import fleet, settle, stored_subjects

pytestmark = pytest.mark.slow

STREAM = subjects.STREAM
DIRECT = f"$JS.API.DIRECT.GET.{STREAM}"


async def read_all(nc: Client, filters: list[str]) -> bus.Reader:
    reader = bus.Reader(nc, subjects_filter=filters, follow=False)
    async with reader:
        async for _batch in reader.batches():
            pass
    return reader


async def events_on(admin: Client, subject: str) -> list[events.AnyEvent]:
    reader = bus.Reader(admin, subjects_filter=[subject], follow=False)
    out: list[events.AnyEvent] = []
    async with reader:
        async for batch in reader.batches():
            out += [r.event for r in batch]
    return out


async def copy_to(nc: Client, source_subject: str, target: str) -> None:
    """Ask for the last message on `source_subject`, answered "to" `target`."""
    await nc.publish(f"{DIRECT}.{source_subject}", b"", reply=target)
    await nc.publish(DIRECT, b'{"last_by_subj": "%s"}' % source_subject.encode(), reply=target)
    await nc.flush()


async def test_a_node_cannot_put_a_start_shard_on_another_nodes_commands(
    connect: Connector,
) -> None:
    """The forged StartShard whose launch env ran a shell command as root on node-b."""
    await fleet(connect)
    node = await connect("node", "node-a")
    forged = events.StartShard(
        id="forged-1",
        ts=1.0,
        node="node-b",
        replica_id="r-evil",
        generation=1,
        epoch=1,
        launch=LaunchSpec(
            engine="sim",
            model="demo",
            served_name="demo",
            port=8000,
            gpus=(0,),
            env={"LD_PRELOAD": "/tmp/x.so"},
            engine_args=("--port", "1"),
        ),
    )
    # The payload is stored on the node's own subject (which it may write)...
    own = subjects.node_event("node-a", "shard")
    payload = events.encode(forged)
    await node.jetstream().publish(own, payload, headers=signed_headers(node, own, payload, "f1"))
    admin = await connect.admin()
    before = await stored_subjects(admin)
    # ...then copied, as the answer to a direct get, to node-b's command subject.
    await copy_to(node, own, subjects.command("node-b"))
    after = await settle(admin)
    assert after[STREAM].get(subjects.command("node-b")) == before[STREAM].get(
        subjects.command("node-b")
    )
    # node-b's own command consumer (what its agent reads) has only the real command.
    victim = await connect("node", "node-b")
    delivered: list[events.AnyEvent] = []
    reader = bus.Reader(
        victim,
        subjects_filter=[subjects.command("node-b")],
        consumer_name=authorization.command_consumer("node-b"),
        follow=False,
    )
    async with reader:
        async for batch in reader.batches():
            delivered += [r.event for r in batch]
    assert [type(c).__name__ for c in delivered] == ["StopShard"]


async def test_a_node_cannot_announce_an_endpoint_for_the_router(connect: Connector) -> None:
    """The forged EndpointUp that sent users' prompts to the attacker's server."""
    await fleet(connect)
    node = await connect("node", "node-a")
    hijack = events.EndpointUp(
        id="hj-1", ts=1.0, replica_id="r-1", model="demo", url="http://attacker:8000", epoch=1
    )
    own = subjects.node_event("node-a", "registered")
    payload = events.encode(hijack)
    await node.jetstream().publish(own, payload, headers=signed_headers(node, own, payload, "hj"))
    await copy_to(node, own, subjects.control_event("endpoint_up"))
    admin = await connect.admin()
    await settle(admin)
    assert await events_on(admin, subjects.CONTROL_EVENTS_ALL) == []
    # And the router's reader refuses the copy the node could make on its own subject:
    # its content is a control decision, not a node's event.
    router = await connect("router", "router-1")
    reader = await read_all(router, list(subjects.STREAM_SUBJECTS))
    assert reader.undecodable >= 1
    assert any(s.subject == own for s in reader.skipped)


async def test_an_operator_is_recorded_under_its_certificates_name_only(
    connect: Connector,
) -> None:
    """The free-text audit trail: bob publishing `"operator": "alice"` was recorded as alice."""
    await fleet(connect)
    bob = await connect("operator", "bob")
    as_alice = events.NodeCordoned(id="c-bob", ts=1.0, operator="alice", node="node-a")
    # On alice's subject the server refuses it...
    with pytest.raises(nats.errors.TimeoutError):  # how nats-py reports a refused publish
        await bob.jetstream().publish(
            subjects.operator_event("alice", "node_cordoned"), events.encode(as_alice), timeout=0.5
        )
    assert "llmgw.events.operator.alice" in await connect.violation("operator", "bob")
    # ...and on his own the readers refuse it: the subject names bob, the event alice.
    # (Signed by bob: the signature holds, the content check refuses it.)
    own, payload = subjects.operator_event("bob", "node_cordoned"), events.encode(as_alice)
    ack = await bob.jetstream().publish(
        own, payload, headers=signed_headers(bob, own, payload, as_alice.id)
    )
    honest = events.NodeCordoned(id="c-bob-2", ts=2.0, operator="bob", node="node-a")
    await bus.Publisher(bob.jetstream()).publish(honest)
    router = await connect("router", "router-1")
    reader = await read_all(router, [subjects.OPERATOR_EVENTS_ALL])
    assert [s.seq for s in reader.skipped] == [ack.seq]
    admin = await connect.admin()
    folded = await events_on(admin, subjects.OPERATOR_EVENTS_ALL)
    assert [e.operator for e in folded if isinstance(e, events.NodeCordoned)] == ["bob"]


async def test_a_router_cannot_replay_a_nodes_old_registration(connect: Connector) -> None:
    """A read-only router copied a node's old registration back onto the node's subject,
    and the control plane restarted that node's replicas."""
    await fleet(connect)
    router = await connect("router", "router-1")
    admin = await connect.admin()
    before = await stored_subjects(admin)
    source = subjects.node_event("node-a", "heartbeat")
    await copy_to(router, source, subjects.node_event("node-a", "registered"))
    await copy_to(router, source, source)
    await router.publish(DIRECT, b'{"seq": 1}', reply=subjects.node_event("node-a", "shard"))
    await router.flush()
    assert await settle(admin) == before


async def test_nobody_but_the_control_plane_touches_the_lease_or_the_snapshots(
    connect: Connector,
) -> None:
    """The lease overwritten (no leader while `ctl status` named one) and a forged snapshot
    that a cold-starting control plane loaded."""
    await fleet(connect)
    admin = await connect.admin()
    lease_stream = f"KV_{authorization.LEASE_BUCKET}"
    lease_key = f"$KV.{authorization.LEASE_BUCKET}.leader"
    lease = (await admin.jetstream().get_last_msg(lease_stream, lease_key)).data
    before = await stored_subjects(admin)
    for kind, name in (("node", "node-a"), ("router", "router-1"), ("operator", "alice")):
        nc = await connect(kind, name)
        source = subjects.node_event("node-a", "heartbeat")
        await copy_to(nc, source, lease_key)
        await copy_to(nc, source, f"$O.{authorization.SNAPSHOT_BUCKET}.M.c3RhdGU")
        await copy_to(nc, source, f"$O.{authorization.SNAPSHOT_BUCKET}.C.forged")
        await nc.publish(lease_key, b'{"holder":"evil","epoch":999}')
        await nc.flush()
    await asyncio.sleep(0.2)
    assert await settle(admin) == before
    assert (await admin.jetstream().get_last_msg(lease_stream, lease_key)).data == lease

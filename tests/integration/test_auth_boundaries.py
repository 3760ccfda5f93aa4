"""A node's commands reach it through its own durable consumer, and no other identity may
touch that consumer (docs/security.md): another node, a router or an operator that pulled
from it, acknowledged its messages, recreated it or deleted it would swallow the node's
commands. Tested against a real nats-server with the rendered accounts, with the node's
command in flight (delivered, not yet acknowledged) while the other identity tries each."""

from __future__ import annotations

import asyncio
import json
import time

import nats.errors
import pytest

from llmgw import bus
from llmgw.bus import counters
from llmgw.core import loadreport, subjects
from llmgw.pki import authorization
from llmgw.pki.identity import Identity
from tests.harness import Connector
from tests.integration.test_auth import provision, refused

STREAM = subjects.STREAM
VICTIM = "node-b"
CONSUMER = authorization.command_consumer(VICTIM)
API = authorization.API


@pytest.mark.parametrize(
    ("kind", "name"), [("router", "router-1"), ("operator", "alice"), ("node", "node-a")]
)
async def test_another_identity_cannot_pull_ack_recreate_or_delete_a_nodes_command_consumer(
    connect: Connector, kind: str, name: str
) -> None:
    control = await connect("control", "control-1")
    await provision(control)
    await control.jetstream().publish(subjects.command(VICTIM), b'{"for":"node-b"}')
    victim = await connect("node", VICTIM)
    sub = await victim.jetstream().pull_subscribe(
        subjects.command(VICTIM), durable=CONSUMER, stream=STREAM
    )
    [in_flight] = await sub.fetch(1, timeout=5)
    assert in_flight.reply.startswith(f"$JS.ACK.{STREAM}.{CONSUMER}.")

    other = await connect(kind, name)
    inbox = f"{Identity(kind, name).inbox_prefix}.x"  # type: ignore[arg-type]
    config = {"stream_name": STREAM, "config": {"durable_name": CONSUMER, "name": CONSUMER}}
    tries = [
        # the acknowledgement of the message the node is working on, as the node would send it
        (in_flight.reply, b"+ACK"),
        (f"{API}.CONSUMER.MSG.NEXT.{STREAM}.{CONSUMER}", b'{"batch": 10, "no_wait": true}'),
        (f"{API}.CONSUMER.DELETE.{STREAM}.{CONSUMER}", b""),
        (f"{API}.CONSUMER.CREATE.{STREAM}.{CONSUMER}", json.dumps(config).encode()),
        (
            f"{API}.CONSUMER.CREATE.{STREAM}.{CONSUMER}.{subjects.command(VICTIM)}",
            json.dumps(config).encode(),
        ),
    ]
    for subject, body in tries:
        await other.publish(subject, body, reply=inbox)
        await other.flush()
        refused = await connect.violation(kind, name)
        assert subject.lower() in refused, (subject, refused)
        assert "publish" in refused

    # The node still holds its consumer and its command: handed back, it is delivered again.
    info = await victim.jetstream().consumer_info(STREAM, CONSUMER)
    assert info.config.filter_subject == subjects.command(VICTIM)
    await in_flight.nak()
    [again] = await sub.fetch(1, timeout=5)
    assert again.data == b'{"for":"node-b"}'
    assert again.metadata.num_delivered == 2


async def test_a_node_reads_the_lease_but_no_other_message_by_sequence(connect: Connector) -> None:
    """A node may get the leader lease by sequence (what its agent reads); any other stream's
    message get would hand it another node's commands, whose launch carries their secrets."""
    control = await connect("control", "control-1")
    await provision(control)
    js = control.jetstream()
    seq = (await js.publish(subjects.command(VICTIM), b'{"for":"node-b"}')).seq
    lease = await js.create_key_value(bucket=authorization.LEASE_BUCKET, history=1)
    await lease.put("leader", b"control-1")
    node = await connect("node", "node-a")
    got = await node.jetstream().get_last_msg(
        f"KV_{authorization.LEASE_BUCKET}", f"$KV.{authorization.LEASE_BUCKET}.leader"
    )
    assert got.data == b"control-1"
    with pytest.raises(nats.errors.TimeoutError):
        await node.jetstream(timeout=0.5).get_msg(STREAM, seq)
    refused = await connect.violation("node", "node-a")
    assert f"{API}.stream.msg.get.{STREAM}".lower() in refused


async def test_an_operator_adds_to_no_counter_and_reports_no_load(connect: Connector) -> None:
    """Tenants' counters and load reports are the routers' to write, not an operator's."""
    operator = await connect("operator", "alice")
    for subject in (
        subjects.limit_counter("some-key", "r", 1),
        subjects.usage_counter("some-key", 1, "m", "in"),
        subjects.router_signals("alice", 0),
    ):
        await refused(connect, operator, "operator", "alice", subject)


async def test_an_operator_reads_the_load_reports_and_the_tenants_counters(
    connect: Connector,
) -> None:
    """What `llmgw ctl explain-scaling` and `llmgw ctl usage` read, as the operator."""
    await bus.provision((await connect("control", "control-1")).jetstream())
    router = await connect("router", "router-1")
    await bus.SignalsPublisher(router, "router-1").publish(loadreport.LoadReport(ts=time.time()))
    await router.flush()
    rate = subjects.limit_counter("some-key", "r", 1)
    usage = subjects.usage_counter("some-key", 1, "m", "in")
    adder = counters.Counters(router, timeout_s=5)
    assert await adder.add(rate, 3) == 3
    assert await adder.add(usage, 7) == 7
    operator = await connect("operator", "alice")
    deadline = time.monotonic() + 30
    while True:
        reader = bus.SignalsReader(operator, since=0.0, follow=False, name="t")
        got: list[bus.Record] = []
        async with reader:
            async for batch in reader.batches():
                got.extend(batch)
        if got or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert [r.subject for r in got] == [subjects.router_signals("router-1", 0)]
    assert await counters.totals(operator, subjects.LIMITS_STREAM, ">") == {rate: 3}
    assert await counters.totals(operator, subjects.USAGE_STREAM, ">") == {usage: 7}
    assert connect.violations("operator", "alice") == []

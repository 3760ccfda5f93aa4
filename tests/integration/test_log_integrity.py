"""No identity can make the server store a message where it may not publish: every JetStream
API endpoint, the KV and object-store subjects, consumers' deliver subjects and pull
requests, tried by every kind of identity against every protected namespace, on a real
nats-server with the rendered accounts (docs/security.md, "The log's integrity").

JetStream answers a request on its reply subject, and a stream that captures that subject
stores the answer: inside one account, `$JS.API.DIRECT.GET.<stream>.<subject>` with reply
`llmgw.cmd.<other node>` copies a stored message onto the other node's commands. The test
first shows that this happens where it can (the test administrator lives in the streams'
account), so that the detector is known to work, then that no fleet identity can make it
happen: each attacker fires every request it can form at every target, and afterwards the
stored subjects may have grown only inside the attacker's own namespace.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from nats.aio.client import Client

from llmgw import bus
from llmgw.bus import counters
from llmgw.core import events, kvblocks, loadreport, subjects
from llmgw.pki import authorization
from llmgw.pki.identity import Identity
from tests.harness import Connector
from tests.unit.test_pki_authorization import matches

pytestmark = pytest.mark.slow

STREAM = subjects.STREAM
LEASE = f"KV_{authorization.LEASE_BUCKET}"
SNAPS = f"OBJ_{authorization.SNAPSHOT_BUCKET}"
KV = subjects.KV_STREAM
SIGNALS = subjects.SIGNALS_STREAM
# The tenants' counters hold one message per subject whose total is what matters, so their
# totals are compared, not counts. (A direct get's answer copied onto one is refused by the
# server in any account: it has a payload, which no increment may have.)
COUNTERS = (subjects.LIMITS_STREAM, subjects.USAGE_STREAM)
STREAMS = (STREAM, KV, SIGNALS, LEASE, SNAPS, *COUNTERS)
VICTIM_KEY = "victim-key"
VICTIM_RATE = subjects.limit_counter(VICTIM_KEY, "r", 1)
VICTIM_BUDGET = subjects.budget_counter(VICTIM_KEY, "d20261202")
# The snapshot store may also be a KV bucket (older deployments): attacked though absent.
ATTACKED_STREAMS = (*STREAMS, f"KV_{authorization.SNAPSHOT_BUCKET}")
LEASE_KEY = f"$KV.{authorization.LEASE_BUCKET}.leader"
VICTIM = "node-b"

ATTACKERS = (
    Identity("node", "node-a"),
    Identity("router", "router-1"),
    Identity("operator", "alice"),
    Identity("control", "control-1"),
)

# Where a forged message would do harm: another node's commands and events, the leader's
# decisions, each operator's and the control plane's operator events, the pre-author operator
# form, the lease, the snapshots.
TARGETS = (
    subjects.command(VICTIM),
    subjects.command("node-a"),
    subjects.node_event(VICTIM, "heartbeat"),
    subjects.node_event(VICTIM, "registered"),
    subjects.node_event("node-a", "shard"),
    subjects.control_event("endpoint_up"),
    subjects.control_event("leader_elected"),
    subjects.operator_event("alice", "node_cordoned"),
    subjects.operator_event("bob", "node_drain_requested"),
    subjects.control_operator_event("control-1", "model_declared"),
    "llmgw.events.operator.node_cordoned",
    subjects.kv_updates(VICTIM, "e1"),
    subjects.kv_updates("node-a", "e9"),
    subjects.router_signals("router-2", 0),
    subjects.node_signals(VICTIM),
    subjects.router_signals("router-1", 3),
    VICTIM_RATE,
    VICTIM_BUDGET,
    subjects.usage_counter(VICTIM_KEY, 1, "m", "in"),
    LEASE_KEY,
    f"$O.{authorization.SNAPSHOT_BUCKET}.M.c3RhdGU",
    f"$O.{authorization.SNAPSHOT_BUCKET}.C.forged",
)


def owns(identity: Identity, subject: str) -> bool:
    """Who may write a subject, said independently of the permissions under test."""
    parts = subject.split(".")
    if identity.kind == "node":
        if parts[:2] == ["llmgw", "kv"]:
            return len(parts) == 4 and parts[2] == identity.name
        if parts[:3] == ["llmgw", "signals", "node"]:
            return len(parts) == 4 and parts[3] == identity.name
        return parts[:4] == ["llmgw", "events", "node", identity.name]
    if identity.kind == "router":
        if parts[:2] in (["llmgw", "limits"], ["llmgw", "usage"]):
            return True  # every router adds to every key's counters
        return parts[:4] == ["llmgw", "signals", "router", identity.name] and len(parts) == 5
    if identity.kind == "operator":
        return parts[:4] == ["llmgw", "events", "operator", identity.name] and len(parts) == 5
    if identity.kind == "control":
        if parts[:3] in (["llmgw", "events", "control"], ["llmgw", "cmd", parts[2]]):
            return True
        if subject.startswith(("$KV.", "$O.")):
            return True
        return parts[:5] == ["llmgw", "events", "operator", "control", identity.name]
    return False


# Every endpoint of the JetStream API (nats-server 2.15's jetstream_api.go), with `{s}` a
# stream, `{c}` a consumer and `{f}` a subject. Each is requested with a reply subject that
# is a target, and where the body names a destination (push consumers, snapshots), with that
# destination too.
API_ENDPOINTS = (
    "$JS.API.INFO",
    "$JS.API.STREAM.CREATE.{s}",
    "$JS.API.STREAM.UPDATE.{s}",
    "$JS.API.STREAM.NAMES",
    "$JS.API.STREAM.LIST",
    "$JS.API.STREAM.INFO.{s}",
    "$JS.API.STREAM.DELETE.{s}",
    "$JS.API.STREAM.PURGE.{s}",
    "$JS.API.STREAM.SNAPSHOT.{s}",
    "$JS.API.STREAM.RESTORE.{s}",
    "$JS.API.STREAM.MSG.DELETE.{s}",
    "$JS.API.STREAM.MSG.GET.{s}",
    "$JS.API.STREAM.PEER.REMOVE.{s}",
    "$JS.API.STREAM.PEER.EVACUATE.{s}",
    "$JS.API.STREAM.CANCEL_MOVE.{s}",
    "$JS.API.STREAM.LEADER.STEPDOWN.{s}",
    "$JS.API.CONSUMER.CREATE.{s}",
    "$JS.API.CONSUMER.CREATE.{s}.{c}.{f}",
    "$JS.API.CONSUMER.CREATE.{s}.{c}",
    "$JS.API.CONSUMER.DURABLE.CREATE.{s}.{c}",
    "$JS.API.CONSUMER.NAMES.{s}",
    "$JS.API.CONSUMER.LIST.{s}",
    "$JS.API.CONSUMER.INFO.{s}.{c}",
    "$JS.API.CONSUMER.DELETE.{s}.{c}",
    "$JS.API.CONSUMER.PAUSE.{s}.{c}",
    "$JS.API.CONSUMER.MSG.NEXT.{s}.{c}",
    "$JS.API.CONSUMER.RESET.{s}.{c}",
    "$JS.API.CONSUMER.UNPIN.{s}.{c}",
    "$JS.API.CONSUMER.LEADER.STEPDOWN.{s}.{c}",
    "$JS.API.META.LEADER.STEPDOWN",
    "$JS.API.SERVER.REMOVE",
    "$JS.API.SERVER.EVACUATE",
    "$JS.API.META.RESCUE",
    "$JS.API.ACCOUNT.PURGE.{a}",
    "$JS.API.ACCOUNT.STREAM.MOVE.{s}.{a}",
    "$JS.API.ACCOUNT.STREAM.CANCEL_MOVE.{s}.{a}",
    "$JS.API.DIRECT.GET.{s}",
    "$JS.API.DIRECT.GET.{s}.{f}",
)


@dataclass(frozen=True)
class Attempt:
    subject: str
    body: bytes
    reply: str


def _bodies(endpoint: str, stream: str, target: str, consumer: str) -> list[dict[str, object]]:
    """Request bodies worth trying at `endpoint`: those that name a destination name
    `target`, those that select a message select one that is stored."""
    push = {"deliver_policy": "all", "ack_policy": "none", "deliver_subject": target}
    if ".CONSUMER.CREATE." in endpoint or ".DURABLE.CREATE." in endpoint:
        named = {**push, "name": consumer, "durable_name": consumer}
        return [
            {"stream_name": stream, "config": push},
            {"stream_name": stream, "config": named},
            {"stream_name": stream, "config": {**named, "filter_subject": ">"}},
            {"stream_name": stream, "action": "create", "config": {**push, "name": consumer}},
        ]
    if ".MSG.NEXT." in endpoint:
        return [{"batch": 50, "expires": 300_000_000}, {"batch": 50, "no_wait": True}]
    if ".DIRECT.GET." in endpoint or ".MSG.GET." in endpoint:
        return [
            {"seq": 1},
            {"seq": 2},
            {"last_by_subj": subjects.node_event("node-a", "heartbeat")},
            {"last_by_subj": LEASE_KEY},
            {"last_by_subj": VICTIM_RATE},
            {"seq": 1, "batch": 20},
            {"multi_last": [">"], "batch": 20},
        ]
    if ".MSG.DELETE." in endpoint:
        return [{"seq": 1}, {"seq": 2}, {"seq": 1, "no_erase": True}]
    if ".STREAM.SNAPSHOT." in endpoint:
        return [{"deliver_subject": target, "chunk_size": 1024}]
    if ".STREAM.RESTORE." in endpoint:
        return [{"config": {"name": stream, "subjects": [target]}}]
    if ".STREAM.CREATE." in endpoint or ".STREAM.UPDATE." in endpoint:
        return [
            {"name": stream, "subjects": [target]},
            {
                "name": stream,
                "subjects": list(subjects.STREAM_SUBJECTS),
                "republish": {"src": ">", "dest": target},
            },
        ]
    return [{}]


def attempts(identity: Identity) -> Iterator[Attempt]:
    """Every request `identity` can form, aimed at every target it does not own."""
    targets = [t for t in TARGETS if not owns(identity, t)]
    if identity.kind == "node":
        own = subjects.node_event(identity.name, "heartbeat")
    elif identity.kind == "router":
        own = subjects.router_signals(identity.name, 0)
    else:
        own = subjects.operator_event(identity.name, "node_cordoned")
    filters = (subjects.command(VICTIM), ">", own, subjects.command(identity.name))
    consumers = (
        authorization.command_consumer(VICTIM),
        authorization.command_consumer(identity.name),
        f"evil-{identity.name}",
    )
    for target in targets:
        for endpoint in API_ENDPOINTS:
            for stream in ATTACKED_STREAMS:
                for consumer in consumers:
                    for f in filters if "{f}" in endpoint else ("",):
                        subject = endpoint.format(s=stream, c=consumer, f=f, a="LOG")
                        for body in _bodies(endpoint, stream, target, consumer):
                            yield Attempt(subject, json.dumps(body).encode(), target)
                    if "{c}" not in endpoint:
                        break
                if "{s}" not in endpoint:
                    break
        # Its own subject, with the target as the reply: the acknowledgement goes there.
        yield Attempt(own, b'{"type":"node.heartbeat"}', target)
        # Acknowledgements and flow-control replies of any consumer.
        for stream in ATTACKED_STREAMS:
            yield Attempt(f"$JS.ACK.{stream}.cmd-{VICTIM}.1.1.1.1.0", b"", target)
            yield Attempt(f"$JS.FC.{stream}.x", b"", target)
        # Writing the target itself, and the KV and object-store subjects directly.
        yield Attempt(target, b"forged", target)


Stored = dict[str, dict[str, tuple[int, int]]]
"""Per stream, per subject: how many messages it holds and the sequence of its last (of a
counter stream: its total, twice)."""


async def stored_subjects(admin: Client) -> Stored:
    """What each stream holds, per subject (`Stored`). The last message's sequence shows a
    write where a stream keeps one message per subject (the lease, the load reports): there
    a stolen write replaces what was, and the count stays."""
    js = admin.jetstream()
    out: Stored = {}
    for stream in STREAMS:
        if stream in COUNTERS:
            totals = await counters.totals(admin, stream, ">")
            out[stream] = {subject: (n, n) for subject, n in totals.items()}
            continue
        info = await js.stream_info(stream, subjects_filter=">")
        out[stream] = {
            subject: (n, int((await js.get_last_msg(stream, subject)).seq or 0))
            for subject, n in (info.state.subjects or {}).items()
        }
    return out


def grown(before: Stored, after: Stored) -> set[str]:
    """Subjects with more messages than before or a later last one, or a counter whose
    total moved at all."""
    return {
        subject
        for stream, held in after.items()
        for subject, (n, last) in held.items()
        if n > before.get(stream, {}).get(subject, (0, 0))[0]
        or last > before.get(stream, {}).get(subject, (0, 0))[1]
        or (stream in COUNTERS and n != before.get(stream, {}).get(subject, (0, 0))[0])
    }


def shrunk(before: Stored, after: Stored) -> set[str]:
    """Subjects of the log and the buckets holding fewer messages than before. (The derived
    streams age their messages out within a minute, so they may shrink on their own.)"""
    return {
        subject
        for stream, held in before.items()
        if stream in (STREAM, LEASE, SNAPS)
        for subject, (n, _) in held.items()
        if after.get(stream, {}).get(subject, (0, 0))[0] < n
    }


async def fleet(connect: Connector) -> Client:
    """The log with something in every stream, as a fleet has it: a node's events, a command
    for the victim, the victim's durable command consumer, the lease and a snapshot."""
    control = await connect("control", "control-1")
    js = control.jetstream()
    await bus.provision(js)
    node = await connect("node", "node-a")
    beat = events.Heartbeat(id="hb-1", ts=1.0, node="node-a", seq=1)
    # Raw, without a Nats-Msg-Id or signature: a copy of it is not a duplicate.
    await node.jetstream().publish(events.subject_of(beat), events.encode(beat))
    # Something in the engines' KV stream too, to be copied if anything could copy it.
    await bus.KvPublisher(node, "node-a").publish(
        kvblocks.KvUpdate(
            endpoint="e9",
            model="m",
            block_size=16,
            instance="i",
            seq=1,
            full=True,
            stored=[1, 2, 3],
        )
    )
    # And a router's load report in llmgw-signals.
    router = await connect("router", "router-1")
    await bus.SignalsPublisher(router, "router-1").publish(loadreport.LoadReport(ts=1.0))
    # And a key's counters, which a copy would add to.
    for subject in (VICTIM_RATE, VICTIM_BUDGET):
        assert await counters.Counters(router, timeout_s=5).add(subject, 5) == 5
    stop = events.StopShard(id="c-1", ts=1.0, node=VICTIM, replica_id="r", generation=1)
    await bus.Publisher(js).publish(stop)
    lease = await js.key_value(authorization.LEASE_BUCKET)
    await lease.put("leader", b'{"holder":"control-1","epoch":1}')
    store = await js.object_store(authorization.SNAPSHOT_BUCKET)
    await store.put("state", b"snapshot" * 1000)
    victim = await connect("node", VICTIM)
    await bus.Reader(
        victim,
        subjects_filter=[subjects.command(VICTIM)],
        consumer_name=authorization.command_consumer(VICTIM),
        follow=False,
    ).start()
    return control


async def fire(nc: Client, identity: Identity) -> int:
    count = 0
    for attempt in attempts(identity):
        await nc.publish(attempt.subject, attempt.body, reply=attempt.reply)
        count += 1
        if count % 500 == 0:
            await nc.flush()
    await nc.flush()
    return count


async def settle(admin: Client) -> Stored:
    """The stored subjects once what was fired has been handled: the same twice in a row,
    half a second apart, after pull requests of 0.3 s have expired."""
    await asyncio.sleep(0.5)
    last = await stored_subjects(admin)
    for _ in range(20):
        await asyncio.sleep(0.5)
        now = await stored_subjects(admin)
        if now == last:
            return now
        last = now
    return last


async def test_inside_the_streams_account_a_reply_subject_writes_to_the_log(
    connect: Connector,
) -> None:
    """The mechanism the accounts close, shown where it still works: the administrator shares
    the streams' account, so its direct get answered "to" a node's commands is stored there."""
    await fleet(connect)
    admin = await connect.admin()
    before = await stored_subjects(admin)
    await admin.publish(
        f"$JS.API.DIRECT.GET.{STREAM}.{subjects.node_event('node-a', 'heartbeat')}",
        b"",
        reply=subjects.command(VICTIM),
    )
    await admin.flush()
    after = await settle(admin)
    assert grown(before, after) == {subjects.command(VICTIM)}
    # What the server stored there is not what any control plane signed: the victim's
    # agent reads only the real command and refuses the copy.
    victim = await connect("node", VICTIM)
    reader = bus.Reader(
        victim,
        subjects_filter=[subjects.command(VICTIM)],
        consumer_name=authorization.command_consumer(VICTIM),
        follow=False,
    )
    delivered: list[events.AnyEvent] = []
    async with reader:
        async for batch in reader.batches():
            delivered += [r.event for r in batch]
    assert [type(c).__name__ for c in delivered] == ["StopShard"]
    assert reader.refused == 1


@pytest.mark.parametrize("attacker", ATTACKERS, ids=str)
async def test_no_identity_makes_the_server_store_where_it_may_not_write(
    connect: Connector, attacker: Identity
) -> None:
    await fleet(connect)
    admin = await connect.admin()
    lease_before = await admin.jetstream().get_last_msg(LEASE, LEASE_KEY)
    nc = await connect(attacker.kind, attacker.name)
    before = await stored_subjects(admin)
    fired = await fire(nc, attacker)
    assert fired > 1000  # the enumeration is not empty
    after = await settle(admin)
    foreign = {s for s in grown(before, after) if not owns(attacker, s)}
    assert not foreign, f"{attacker} made the server store on {sorted(foreign)}"
    if attacker.kind != "control":  # the control plane manages the streams: it may delete
        lost = shrunk(before, after)
        assert not lost, f"{attacker} removed messages on {sorted(lost)}"
    if attacker.kind != "control":  # the control plane owns the lease, and may purge it
        lease_after = await admin.jetstream().get_last_msg(LEASE, LEASE_KEY)
        assert lease_after.data == lease_before.data
    # The stream and the buckets are all still there, and but for the control plane (which
    # manages consumers) nobody removed the victim's command consumer.
    js = admin.jetstream()
    for stream in STREAMS:
        await js.stream_info(stream)
    if attacker.kind != "control":
        await js.consumer_info(STREAM, authorization.command_consumer(VICTIM))


@pytest.mark.parametrize("attacker", ATTACKERS, ids=str)
def test_the_enumeration_exercises_every_api_an_identity_may_call(attacker: Identity) -> None:
    """Each JetStream API permission of each identity is hit by some attempt, so an API
    added to the permissions is attacked too (or this fails until it is)."""
    perms = authorization.permissions(attacker, nodes=["node-a", VICTIM])
    tried = {a.subject for a in attempts(attacker)}
    for pattern in perms.publish:
        if pattern.startswith("$JS.API."):
            assert any(matches(pattern, s) for s in tried), pattern


async def test_the_detector_sees_a_write_that_replaces_a_subjects_only_message(
    connect: Connector,
) -> None:
    """Where a stream keeps one message per subject (the load reports, the lease), a stolen
    write replaces what was there: the count stays, the last sequence shows it."""
    await fleet(connect)
    admin = await connect.admin()
    js = admin.jetstream()
    subject = subjects.node_signals("node-a")
    await js.publish(subject, b"first", stream=SIGNALS)
    before = await stored_subjects(admin)
    assert before[SIGNALS][subject][0] == 1
    await js.publish(subject, b"second", stream=SIGNALS)
    after = await stored_subjects(admin)
    assert after[SIGNALS][subject][0] == 1
    assert grown(before, after) == {subject}
    assert not shrunk(before, after)

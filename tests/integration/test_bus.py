"""The bus against a real nats-server with mutual TLS and the rendered authorization.

Identities are used the way production uses them: the control plane provisions,
holds the lease and writes fenced decisions; a node publishes its own events and
heartbeats; a router replays. Only the test administrator publishes raw garbage.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import nats.js.errors
import pytest
import structlog.testing
from nats.js import api
from structlog.testing import capture_logs

from llmgw import bus
from llmgw.bus import counters, provisioning
from llmgw.bus import lease as lease_module
from llmgw.core import events, subjects
from llmgw.pki.identity import Identity
from tests.harness import Connector, TestNatsServer
from tests.kit.events import shard_report

BusConnect = Callable[..., Awaitable[bus.BusClient]]


@pytest.fixture
async def bus_connect(nats_server: TestNatsServer) -> AsyncIterator[BusConnect]:
    """Connect through `llmgw.bus.connect`, as production does, with the harness's TLS."""
    clients: list[bus.BusClient] = []

    async def make(kind: str, name: str, **options: Any) -> bus.BusClient:
        ctx = await asyncio.to_thread(nats_server.pki.client_tls, kind, name)
        nc = await bus.connect(
            nats_server.url,
            tls=ctx,
            identity=Identity(kind, name),  # type: ignore[arg-type]
            name=f"test-{kind}-{name}",
            max_reconnect_attempts=options.pop("max_reconnect_attempts", 50),
            keys=await asyncio.to_thread(nats_server.pki.keys, kind, name),
            **options,
        )
        clients.append(nc)
        return nc

    yield make
    for nc in clients:
        # As services close theirs: nats-py's own close raises from a TLS transport the
        # server left mid-reconnect (a test that stopped the server leaves one so).
        await bus.close(nc)


@pytest.fixture
async def provisioned(bus_connect: BusConnect) -> bus.BusClient:
    control = await bus_connect("control", "control-a")
    await bus.provision(control.jetstream())
    return control


def heartbeat(node: str, i: int) -> events.Heartbeat:
    return events.Heartbeat(id=f"{node}-hb-{i}", ts=1_800_000_000.0 + i, node=node, seq=i)


async def read_all(reader: bus.Reader) -> list[bus.Record]:
    out: list[bus.Record] = []
    async with reader:
        async for batch in reader.batches():
            out.extend(batch)
    return out


async def wait_until(check: Callable[[], Awaitable[bool]], within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {within_s} s")
        await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def following(
    reader: bus.Reader, *, entered: bool = True
) -> AsyncIterator[tuple[list[bus.Record], asyncio.Task[None]]]:
    """`reader` followed in a task (opened and closed by it when `entered`, else already
    started by the test), each record kept in the list; the task cancelled at the end."""
    got: list[bus.Record] = []

    async def consume() -> None:
        async with contextlib.AsyncExitStack() as stack:
            if entered:
                await stack.enter_async_context(reader)
            async for record in reader:
                got.append(record)

    task = asyncio.create_task(consume())
    try:
        yield got, task
    finally:
        task.cancel()


async def until_kept(got: list[bus.Record], count: int, what: str) -> None:
    """Wait (15 s at most) until a follower has kept `count` records."""

    async def kept() -> bool:
        return len(got) == count

    await wait_until(kept, 15.0, what)


# --------------------------------------------------------------------------- provisioning


async def test_provisioning_twice_is_a_no_op(bus_connect: BusConnect) -> None:
    control = await bus_connect("control", "control-a")
    js = control.jetstream()
    first = await bus.provision(js)
    assert set(first.created) == {
        subjects.STREAM,
        subjects.KV_STREAM,
        subjects.SIGNALS_STREAM,
        subjects.LIMITS_STREAM,
        subjects.USAGE_STREAM,
        bus.LEASE_BUCKET,
        bus.SNAPSHOT_BUCKET,
    }
    for counted in (subjects.LIMITS_STREAM, subjects.USAGE_STREAM):
        cfg = (await js.stream_info(counted)).config
        assert cfg.allow_msg_counter
        assert cfg.max_msgs_per_subject == 1
    info = await js.stream_info(subjects.STREAM)
    second = await bus.provision(js)
    assert second.created == ()
    assert set(second.existing) == set(first.created)
    again = await js.stream_info(subjects.STREAM)
    assert again.config.subjects == info.config.subjects == list(subjects.STREAM_SUBJECTS)
    assert again.config.storage == api.StorageType.FILE
    assert again.config.allow_direct
    assert again.config.allow_msg_ttl
    assert again.config.duplicate_window == 120.0
    # The engines' KV blocks: derived, short-lived, in memory, bounded.
    kv = await js.stream_info(subjects.KV_STREAM)
    assert kv.config.subjects == list(subjects.KV_SUBJECTS)
    assert kv.config.storage == api.StorageType.MEMORY
    assert 0 < (kv.config.max_age or 0) <= 300
    assert (kv.config.max_bytes or 0) > 0
    # The routers' load reports likewise, for seconds.
    sig = await js.stream_info(subjects.SIGNALS_STREAM)
    assert sig.config.subjects == list(subjects.SIGNALS_SUBJECTS)
    assert sig.config.storage == api.StorageType.MEMORY
    assert 0 < (sig.config.max_age or 0) <= 60
    assert (sig.config.max_bytes or 0) > 0


async def test_a_conflicting_stream_is_refused_with_what_differs(
    bus_connect: BusConnect, connect: Connector
) -> None:
    admin = await connect.admin()
    await admin.jetstream().add_stream(
        name=subjects.STREAM,
        subjects=list(subjects.STREAM_SUBJECTS),
        storage=api.StorageType.MEMORY,
        duplicate_window=10,
    )
    control = await bus_connect("control", "control-a")
    with pytest.raises(bus.ProvisionConflict) as refused:
        await bus.provision(control.jetstream())
    text = str(refused.value)
    assert "storage is 'memory' (llmgw needs 'file')" in text
    assert "duplicate_window is 10s" in text
    assert "allow_msg_ttl is False" in text
    assert "To fix" in text
    # Refused, not changed: the existing stream is as the administrator left it.
    info = await admin.jetstream().stream_info(subjects.STREAM)
    assert info.config.storage == api.StorageType.MEMORY


async def test_a_derived_stream_on_other_subjects_is_refused_and_left_alone(
    bus_connect: BusConnect, connect: Connector
) -> None:
    admin = await connect.admin()
    await admin.jetstream().add_stream(
        name=subjects.KV_STREAM, subjects=["llmgw.elsewhere.>"], storage=api.StorageType.MEMORY
    )
    control = await bus_connect("control", "control-a")
    with pytest.raises(bus.ProvisionConflict, match=f"stream {subjects.KV_STREAM} exists with"):
        await bus.provision(control.jetstream())
    info = await admin.jetstream().stream_info(subjects.KV_STREAM)
    assert info.config.subjects == ["llmgw.elsewhere.>"]


async def test_a_lease_bucket_whose_entries_cannot_expire_is_refused(
    bus_connect: BusConnect, connect: Connector
) -> None:
    admin = await connect.admin()
    bucket = provisioning.LEASE_BUCKET  # as a client that predates per-message TTLs made it
    await admin.jetstream().add_stream(
        name=f"KV_{bucket}", subjects=[f"$KV.{bucket}.>"], max_msgs_per_subject=1
    )
    control = await bus_connect("control", "control-a")
    with pytest.raises(bus.ProvisionConflict, match="the lease could never expire"):
        await bus.provision(control.jetstream())


# --------------------------------------------------------------------------- publishing


async def test_a_duplicate_publish_inside_the_window_is_stored_once(
    provisioned: bus.BusClient, bus_connect: BusConnect
) -> None:
    node = await bus_connect("node", "node-a")
    publisher = bus.Publisher(node.jetstream())
    event = shard_report(1, "node-a")
    first = await publisher.publish(event)
    second = await publisher.publish(event)
    assert not first.duplicate
    assert second.duplicate
    assert second.seq == first.seq
    info = await provisioned.jetstream().stream_info(subjects.STREAM)
    assert info.state.messages == 1


async def test_a_permission_violation_is_logged_as_such(
    provisioned: bus.BusClient, bus_connect: BusConnect
) -> None:
    told: list[Exception] = []

    async def error_cb(exc: Exception) -> None:
        told.append(exc)

    node = await bus_connect("node", "node-a", error_cb=error_cb)
    # Asked for no attempts, a publisher still makes one.
    publisher = bus.Publisher(node.jetstream(), timeout_s=0.5, attempts=0)
    with capture_logs() as logs, pytest.raises(bus.PublishError, match="after 1 attempts"):
        await publisher.publish(shard_report(1, "node-b"))  # another node's subject
    assert any("llmgw.events.node.node-b" in v for v in node.permission_violations)
    assert any(e["event"] == "permission_violation" for e in logs)
    # The caller's own callback hears of it too (`llmgw ctl` reports the last error).
    assert any("llmgw.events.node.node-b" in str(e) for e in told)


async def test_a_heartbeat_with_a_ttl_is_gone_after_it(
    provisioned: bus.BusClient, bus_connect: BusConnect
) -> None:
    node = await bus_connect("node", "node-a")
    publisher = bus.Publisher(node.jetstream())
    kept = await publisher.publish(shard_report(1, "node-a"))
    beat = await publisher.publish(heartbeat("node-a", 1), ttl_s=1)
    js = provisioned.jetstream()
    stored = await js.get_msg(subjects.STREAM, beat.seq)
    assert stored.headers is not None
    assert stored.headers.get("Nats-TTL") == "1s"

    async def expired() -> bool:
        info = await js.stream_info(subjects.STREAM)
        return info.state.messages == 1

    await wait_until(expired, 5.0, "heartbeat expired from the stream")
    router = await bus_connect("router", "router-1")
    records = await read_all(bus.Reader(router, follow=False))
    assert [r.seq for r in records] == [kept.seq]


# --------------------------------------------------------------------------- reading


async def test_replay_after_sequence_n_returns_exactly_the_later_events_in_order(
    provisioned: bus.BusClient, bus_connect: BusConnect
) -> None:
    node = await bus_connect("node", "node-a")
    published = await bus.Publisher(node.jetstream()).publish_all(
        shard_report(i, "node-a") for i in range(40)
    )
    seqs = [p.seq for p in published]
    router = await bus_connect("router", "router-1")
    for n in (0, seqs[0], seqs[17], seqs[-2], seqs[-1]):
        records = await read_all(bus.Reader(router, after_seq=n, follow=False, batch=7))
        assert [r.seq for r in records] == [s for s in seqs if s > n]
        assert [r.event for r in records] == [
            shard_report(i, "node-a") for i, s in enumerate(seqs) if s > n
        ]
        assert all(r.subject == "llmgw.events.node.node-a.shard" for r in records)
    # Everything the reader did (create, pull, info, delete its consumer) was allowed.
    await router.flush()
    assert list(router.permission_violations) == []


async def test_replay_from_a_time(provisioned: bus.BusClient, bus_connect: BusConnect) -> None:
    node = await bus_connect("node", "node-a")
    publisher = bus.Publisher(node.jetstream())
    await publisher.publish_all(shard_report(i, "node-a") for i in range(5))
    await asyncio.sleep(0.05)
    since = time.time()
    await asyncio.sleep(0.05)
    later = await publisher.publish_all(shard_report(i, "node-a") for i in range(5, 10))
    router = await bus_connect("router", "router-1")
    records = await read_all(bus.Reader(router, since=since, follow=False))
    assert [r.seq for r in records] == [p.seq for p in later]
    assert all(abs(r.time - since) < 5 for r in records)


async def test_garbage_is_skipped_counted_and_reported_with_its_sequence(
    provisioned: bus.BusClient, bus_connect: BusConnect, connect: Connector
) -> None:
    node = await bus_connect("node", "node-a")
    publisher = bus.Publisher(node.jetstream())
    admin = await connect.admin()
    before = await publisher.publish_all(shard_report(i, "node-a") for i in range(3))
    garbage = [
        await admin.jetstream().publish("llmgw.events.node.node-a.shard", raw)
        for raw in (b"\xff\xfe not json", b'{"type": "node.nonsense", "id": "x", "ts": 1}', b"")
    ]
    after = await publisher.publish_all(shard_report(i, "node-a") for i in range(3, 6))

    router = await bus_connect("router", "router-1")
    reader = bus.Reader(router, follow=False)
    with capture_logs() as logs:
        records = await read_all(reader)
    assert [r.seq for r in records] == [p.seq for p in before + after]
    assert reader.undecodable == 3
    assert [s.seq for s in reader.skipped] == [g.seq for g in garbage]
    # The admin's bytes carry no signature: refused before they are even decoded.
    assert all("signature refused: unsigned" in s.error for s in reader.skipped)
    assert reader.refused == 3
    logged = [e for e in logs if e["event"] == "bus.signature_refused"]
    assert [e["seq"] for e in logged] == [g.seq for g in garbage]


async def test_a_following_reader_gets_live_events_and_garbage_does_not_stop_it(
    provisioned: bus.BusClient, bus_connect: BusConnect, connect: Connector
) -> None:
    node = await bus_connect("node", "node-a")
    publisher = bus.Publisher(node.jetstream())
    await publisher.publish(shard_report(0, "node-a"))
    router = await bus_connect("router", "router-1")
    reader = bus.Reader(router, heartbeat_s=0.5)
    async with following(reader) as (got, task):
        await asyncio.wait_for(reader.caught_up.wait(), 5)
        admin = await connect.admin()
        await admin.jetstream().publish("llmgw.events.node.node-a.shard", b"garbage")
        for i in range(1, 4):
            await publisher.publish(shard_report(i, "node-a"))

        async def all_arrived() -> bool:
            return len(got) == 4

        await wait_until(all_arrived, 5.0, "live events")
        assert [r.event for r in got] == [shard_report(i, "node-a") for i in range(4)]
        assert reader.undecodable == 1
        assert not task.done()


async def test_a_following_reader_survives_a_server_restart(
    provisioned: bus.BusClient, bus_connect: BusConnect, nats_server: TestNatsServer
) -> None:
    node = await bus_connect("node", "node-a")
    router = await bus_connect("router", "router-1")
    reader = bus.Reader(router, heartbeat_s=0.5)
    async with following(reader) as (got, _task):
        await bus.Publisher(node.jetstream()).publish(shard_report(0, "node-a"))
        await asyncio.wait_for(reader.caught_up.wait(), 5)
        nats_server.stop()
        nats_server.start()
        publisher = bus.Publisher(node.jetstream(), timeout_s=1.0, attempts=10)
        for i in range(1, 4):
            await publisher.publish(shard_report(i, "node-a"))
        await until_kept(got, 4, "events after the restart")
        assert [r.event for r in got] == [shard_report(i, "node-a") for i in range(4)]
        assert reader.resets >= 1


async def test_a_reader_with_one_filter_reads_only_those_subjects(
    provisioned: bus.BusClient, bus_connect: BusConnect
) -> None:
    node = await bus_connect("node", "node-a")
    await bus.Publisher(node.jetstream()).publish_all(shard_report(i, "node-a") for i in range(3))
    decided = events.NodeRecovered(id="d1", ts=1.0, node="node-a", epoch=1)
    placed = await bus.Publisher(provisioned.jetstream()).publish(decided)
    router = await bus_connect("router", "router-1")
    reader = bus.Reader(router, subjects_filter=[subjects.CONTROL_EVENTS_ALL], follow=False)
    records = await read_all(reader)
    assert [(r.seq, r.event) for r in records] == [(placed.seq, decided)]


# --------------------------------------------------------------------------- fencing


async def test_a_fenced_publish_after_another_write_to_the_fenced_subjects_is_refused(
    provisioned: bus.BusClient, bus_connect: BusConnect
) -> None:
    leader = bus.Publisher(provisioned.jetstream())
    rival_nc = await bus_connect("control", "control-b")
    rival = bus.Publisher(rival_nc.jetstream())
    node = await bus_connect("node", "node-a")
    await bus.Publisher(node.jetstream()).publish(shard_report(1, "node-a"))  # not a fenced subject

    def decision(i: int) -> events.NodeRecovered:
        return events.NodeRecovered(id=f"decision-{i}", ts=float(i), node="node-a", epoch=1)

    fence = bus.Fence(subjects.CONTROL_EVENTS_ALL, 0)
    first = await leader.publish(decision(1), fence=fence)
    # The same event again (a retry after a lost ack) is a duplicate, not a refusal.
    retried = await leader.publish(decision(1), fence=fence)
    assert retried.duplicate
    assert retried.seq == first.seq

    fence = bus.Fence(subjects.CONTROL_EVENTS_ALL, first.seq)
    rival_write = await rival.publish(
        events.LeaderElected(id="coup", ts=2.0, leader="control-b", epoch=2)
    )
    with pytest.raises(bus.FenceRefused, match="another leader wrote first"):
        await leader.publish(decision(2), fence=fence)
    # Fenced on what it has now read, the write goes through.
    ok = await leader.publish(
        decision(3), fence=bus.Fence(subjects.CONTROL_EVENTS_ALL, rival_write.seq)
    )
    assert ok.seq == rival_write.seq + 1


# --------------------------------------------------------------------------- lease


async def test_two_lease_contenders_one_holds_and_the_other_takes_over(
    provisioned: bus.BusClient, bus_connect: BusConnect
) -> None:
    other = await bus_connect("control", "control-b")
    a = await bus.Lease.open(provisioned.jetstream(), "control-a", ttl_s=2)
    b = await bus.Lease.open(other.jetstream(), "control-b", ttl_s=2)
    assert await b.holder() is None
    # Racing for a free lease: exactly one wins.
    won = await asyncio.gather(a.acquire(), b.acquire())
    assert sorted(won) == [False, True]
    if won[1]:  # B won the race: hand it to A so the rest reads in one order
        await b.release()
        assert await a.acquire()
    assert not await b.acquire()
    holder = await b.holder()
    assert holder is not None
    assert (holder.holder, holder.epoch) == ("control-a", a.epoch)

    # While A renews, B never gets it.
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        await a.renew()
        assert not await b.acquire()
        await asyncio.sleep(0.5)
    holder = await b.holder()
    assert holder is not None
    assert holder.holder == "control-a"
    assert holder.epoch == a.epoch

    # A stops renewing: B takes over once the TTL has run out.
    stopped = time.monotonic()

    async def b_took_it() -> bool:
        return await b.acquire()

    await wait_until(b_took_it, 6.0, "B acquiring after A stopped renewing")
    assert time.monotonic() - stopped >= 1.0
    assert b.epoch > a.epoch
    holder = await a.holder()
    assert holder is not None
    assert (holder.holder, holder.epoch) == ("control-b", b.epoch)
    with pytest.raises(bus.LeaseLost):
        await a.renew()
    assert not await a.acquire()

    # A clean release hands over at once.
    await b.release()
    assert await a.acquire()
    assert a.epoch > b.epoch


async def test_a_lease_nobody_renews_is_gone_from_the_bucket_after_its_ttl(
    provisioned: bus.BusClient,
) -> None:
    """The server deletes it (the value's TTL): a standby then creates the lease at once,
    instead of waiting for the value to be judged run out a TTL later."""
    a = await bus.Lease.open(provisioned.jetstream(), "control-a", ttl_s=1)
    assert await a.acquire()
    kv = await provisioned.jetstream().key_value(bus.LEASE_BUCKET)

    async def gone() -> bool:
        try:
            entry = await kv.get(lease_module.KEY)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return True
        return entry.value is None

    await wait_until(gone, 15.0, "the unrenewed lease value expiring")


async def test_a_late_release_by_an_old_instance_leaves_its_successors_lease(
    provisioned: bus.BusClient,
) -> None:
    """The same name, restarted: the old process's lease ran out and the new one took the
    lease. The old one's release, late, must not free the lease of the new epoch."""
    old = await bus.Lease.open(provisioned.jetstream(), "control-a", ttl_s=1)
    assert await old.acquire()
    new = await bus.Lease.open(provisioned.jetstream(), "control-a", ttl_s=30)

    async def taken() -> bool:
        return await new.acquire()

    await wait_until(taken, 15.0, "the restarted instance taking the lease")
    assert new.epoch > old.epoch
    await old.release()
    holder = await new.holder()
    assert holder is not None
    assert (holder.holder, holder.epoch) == ("control-a", new.epoch)


async def test_a_release_after_a_renewal_whose_ack_was_lost_still_frees_the_lease(
    provisioned: bus.BusClient, bus_connect: BusConnect
) -> None:
    """A shutdown can cancel a renewal after the server stored it: the holder then knows
    an older revision than the stored one. Its release must still free the lease (else a
    standby waits out the TTL), and must never free one someone else holds."""
    other = await bus_connect("control", "control-b")
    a = await bus.Lease.open(provisioned.jetstream(), "control-a", ttl_s=30)
    b = await bus.Lease.open(other.jetstream(), "control-b", ttl_s=30)
    assert await a.acquire()
    known = a._revision
    await a.renew()  # stored; pretend its ack never arrived
    a._revision = known
    await a.release()
    assert await b.holder() is None
    assert await b.acquire()
    # A stale holder releasing does not take the lease from its new holder.
    a._revision = known
    await a.release()
    holder = await a.holder()
    assert holder is not None
    assert holder.holder == "control-b"


# --------------------------------------------------------------------------- snapshots


async def test_snapshots_load_the_newest_and_the_newest_at_or_before(
    provisioned: bus.BusClient, bus_connect: BusConnect
) -> None:
    store = await bus.SnapshotStore.open(provisioned.jetstream(), keep=3)
    assert await store.load() is None
    big = bytes(range(256)) * (3 * 4096)  # 3 MiB: more than a KV value may hold
    for seq, data in ((10, b"ten"), (20, big), (30, b"thirty"), (40, b"forty")):
        await store.save(data, seq)
    assert await store.seqs() == [20, 30, 40]  # the oldest pruned
    # Pruned with its metadata, so the listing (one get per metadata subject) stays short.
    meta = await provisioned.jetstream().stream_info(
        f"OBJ_{bus.SNAPSHOT_BUCKET}", subjects_filter=f"$O.{bus.SNAPSHOT_BUCKET}.M.>"
    )
    assert meta.state.subjects is not None
    assert len(meta.state.subjects) == 3
    newest = await store.load()
    assert newest == bus.Snapshot(seq=40, data=b"forty")
    at = await store.load(at_or_before=39)
    assert at == bus.Snapshot(seq=30, data=b"thirty")
    big_back = await store.load(at_or_before=29)
    assert big_back is not None
    assert big_back.seq == 20
    assert big_back.data == big
    assert await store.load(at_or_before=19) is None
    # An operator (`llmgw ctl replay`) may read them too.
    operator = await bus_connect("operator", "alice")
    seen = await bus.SnapshotStore.open(operator.jetstream())
    assert await seen.load(at_or_before=35) == bus.Snapshot(seq=30, data=b"thirty")
    await operator.flush()
    assert list(operator.permission_violations) == []
    # And a router (its feed starts from the newest), the 3 MiB one chunk by chunk.
    router = await bus_connect("router", "router-1")
    got = await (await bus.SnapshotStore.open(router.jetstream())).load(at_or_before=29)
    assert got == bus.Snapshot(seq=20, data=big)
    await router.flush()
    assert list(router.permission_violations) == []


# --------------------------------------------------------------------------- as a node, and errors


def node_a_commands(node: bus.BusClient, after: int) -> bus.Reader:
    """node-a's commands after `after`, through the one consumer name a node may hold."""
    return bus.Reader(
        node,
        after_seq=after,
        subjects_filter=[subjects.command("node-a")],
        consumer_name="cmd-node-a",
        follow=False,
    )


async def test_a_node_reads_its_own_commands_through_its_named_consumer(
    provisioned: bus.BusClient, bus_connect: BusConnect
) -> None:
    leader = bus.Publisher(provisioned.jetstream())
    stops = [
        events.StopShard(id=f"stop-{i}", ts=1.0, node=n, replica_id="r1", generation=1)
        for i, n in enumerate(("node-a", "node-b", "node-a"))
    ]
    acks = [await leader.publish(stop) for stop in stops]
    node = await bus_connect("node", "node-a")

    records = await read_all(node_a_commands(node, 0))
    assert [(r.seq, r.event) for r in records] == [(acks[0].seq, stops[0]), (acks[2].seq, stops[2])]
    # An agent restarting resumes after the last command it applied: same consumer name.
    again = await read_all(node_a_commands(node, acks[0].seq))
    assert [r.seq for r in again] == [acks[2].seq]
    await node.flush()
    assert list(node.permission_violations) == []

    with pytest.raises(bus.ReaderError, match="may create consumers"):
        await bus.Reader(
            node,
            subjects_filter=[subjects.command("node-b")],
            consumer_name="cmd-node-b",
            follow=False,
        ).start()


async def test_reading_before_provisioning_says_what_to_do(bus_connect: BusConnect) -> None:
    router = await bus_connect("router", "router-1")
    with pytest.raises(bus.ReaderError, match=r"stream not found.*provision"):
        await bus.Reader(router, follow=False).start()


async def test_provisioning_replicas_a_single_server_cannot_hold_says_so(
    bus_connect: BusConnect,
) -> None:
    control = await bus_connect("control", "control-a")
    with pytest.raises(bus.ProvisionConflict, match="cluster"):
        await bus.provision(control.jetstream(), replicas=3)


async def test_the_first_connection_waits_for_a_server_that_starts_later(
    nats_server: TestNatsServer,
) -> None:
    nats_server.stop()
    ctx = await asyncio.to_thread(nats_server.pki.client_tls, "router", "router-1")
    with capture_logs() as logs:
        pending = asyncio.create_task(
            bus.connect(
                nats_server.url,
                tls=ctx,
                identity=Identity("router", "router-1"),
                name="early-router",
            )
        )
        await asyncio.sleep(1.0)
        assert not pending.done()
        nats_server.start()
        nc = await asyncio.wait_for(pending, 15)
    try:
        assert nc.is_connected
        failures = [e for e in logs if e["event"] == "connect_failed"]
        assert len(failures) >= 2
    finally:
        await bus.close(nc)


async def test_an_unreadable_snapshot_falls_back_to_the_older_one(
    provisioned: bus.BusClient, connect: Connector
) -> None:
    store = await bus.SnapshotStore.open(provisioned.jetstream(), load_timeout_s=1.5)
    await store.save(b"old state", 10)
    await store.save(b"new state" * 1000, 20)
    # Lose the newest snapshot's chunks (a disk fault, an operator's purge).
    admin = await connect.admin()
    info = await (await admin.jetstream().object_store(bus.SNAPSHOT_BUCKET)).get_info(
        "state-00000000000000000020"
    )
    await admin.jetstream().purge_stream(
        f"OBJ_{bus.SNAPSHOT_BUCKET}", subject=f"$O.{bus.SNAPSHOT_BUCKET}.C.{info.nuid}"
    )
    with capture_logs() as logs:
        loaded = await store.load()
    assert loaded == bus.Snapshot(seq=10, data=b"old state")
    assert [e["seq"] for e in logs if e["event"] == "snapshot_unreadable"] == [20]


async def test_a_reader_holds_at_most_one_batch_however_slow_its_consumer(
    provisioned: bus.BusClient, bus_connect: BusConnect
) -> None:
    node = await bus_connect("node", "node-a")
    await bus.Publisher(node.jetstream()).publish_all(shard_report(i, "node-a") for i in range(500))
    router = await bus_connect("router", "router-1")
    sizes: list[int] = []
    async with bus.Reader(router, follow=False, batch=50) as reader:
        async for batch in reader.batches():
            sizes.append(len(batch))
            await asyncio.sleep(0.01)  # a slow fold: the server must not run ahead of it
    assert sum(sizes) == 500
    assert max(sizes) <= 50


async def test_an_event_on_a_subject_its_writer_does_not_own_is_refused_by_readers(
    provisioned: bus.BusClient, bus_connect: BusConnect
) -> None:
    # The server lets node-a write anything under llmgw.events.node.node-a.>; what it writes
    # there is checked by every reader: a control decision or another node's heartbeat
    # smuggled onto node-a's subjects must not reach a fold.
    # Signed by node-a itself, so the signature holds: the content check refuses them.
    node = await bus_connect("node", "node-a")
    js = node.jetstream()
    publisher = bus.Publisher(js)
    signer = publisher.signer

    async def signed(subject: str, event: events.Event) -> Any:
        payload = events.encode(event)
        headers = {"Nats-Msg-Id": event.id, **signer.event_headers(subject, event.id, payload)}
        return await js.publish(subject, payload, headers=headers)

    first = await publisher.publish(heartbeat("node-a", 1))
    forged = [
        await signed(
            "llmgw.events.node.node-a.heartbeat",
            events.ReplicaRetired(id="forged-1", ts=1.0, replica_id="r1"),
        ),
        await signed("llmgw.events.node.node-a.heartbeat", heartbeat("node-b", 1)),
        await signed("llmgw.events.node.node-a.registered", shard_report(1, "node-a")),
    ]
    last = await publisher.publish(shard_report(2, "node-a"))

    router = await bus_connect("router", "router-1")
    reader = bus.Reader(router, follow=False)
    records = await read_all(reader)
    assert [r.seq for r in records] == [first.seq, last.seq]
    assert reader.undecodable == 3
    assert [s.seq for s in reader.skipped] == [f.seq for f in forged]
    assert "control.replica_retired event refused" in reader.skipped[0].error


async def test_closing_a_client_while_it_reconnects_returns_promptly(
    nats_server: TestNatsServer, bus_connect: BusConnect
) -> None:
    # A daemon told to stop while NATS is down must stop, not wait for a server.
    nc = await bus_connect("router", "router-1", max_reconnect_attempts=-1)
    await asyncio.to_thread(nats_server.stop)
    await wait_until(lambda: _async(nc.is_reconnecting or not nc.is_connected), 10, "noticed")
    await asyncio.sleep(1.0)  # well into the backoff loop
    await asyncio.wait_for(nc.close(), 5)
    assert nc.is_closed


async def _async(value: bool) -> bool:
    return value


async def test_a_counter_stream_llmgw_cannot_use_leaves_the_fleet_running(
    bus_connect: BusConnect,
) -> None:
    """An `llmgw-limits` made without counters (by hand, or a server before 2.12): the
    control plane provisions the rest and says why; routers then limit keys each by itself."""
    control = await bus_connect("control", "control-a")
    js = control.jetstream()
    await js.add_stream(name=subjects.LIMITS_STREAM, subjects=list(subjects.LIMITS_SUBJECTS),
                        storage=api.StorageType.MEMORY)  # fmt: skip
    done = await bus.provision(js)
    assert subjects.LIMITS_STREAM not in done.created + done.existing
    assert subjects.USAGE_STREAM in done.created
    assert subjects.STREAM in done.created


async def test_counter_totals_read_every_subject_across_batches_and_only_the_filtered(
    provisioned: bus.BusClient, bus_connect: BusConnect
) -> None:
    """`ctl usage` reads hundreds of counters: every one, whatever the batch, and its own
    filter's only; a counter added to twice reads as its sum."""
    router = await bus_connect("router", "r1")
    adder = counters.Counters(router, timeout_s=10.0)
    for i in range(25):
        await adder.add(subjects.usage_counter(f"k{i % 5}", 100 + i, "m", "req"), 1)
    await adder.add(subjects.usage_counter("k0", 100, "m", "req"), 4)
    # A negative amount takes back (a hold released), and 0 only reads.
    assert await adder.add(subjects.usage_counter("k0", 100, "m", "req"), -2) == 3
    assert await adder.add(subjects.usage_counter("k0", 100, "m", "req"), 0) == 3
    operator = await bus_connect("operator", "alice")
    got = await counters.totals(operator, subjects.USAGE_STREAM, "llmgw.usage.>", batch=4)
    assert len(got) == 25
    assert got[subjects.usage_counter("k0", 100, "m", "req")] == 3
    assert sum(got.values()) == 27
    only = await counters.totals(operator, subjects.USAGE_STREAM, "llmgw.usage.k1.h.>", batch=2)
    assert sorted(only) == sorted(subjects.usage_counter("k1", 100 + i, "m", "req")
                                  for i in range(1, 25, 5))  # fmt: skip


async def test_counter_totals_too_slow_to_read_are_an_error_never_a_partial_answer(
    provisioned: bus.BusClient, bus_connect: BusConnect
) -> None:
    """A server slower than the timeout gives CounterError (what the CLI prints), never a
    bare TimeoutError nor whatever part of the totals arrived in time."""
    router = await bus_connect("router", "r1")
    await counters.Counters(router, timeout_s=10.0).add(
        subjects.usage_counter("k", 1, "m", "req"), 1
    )
    operator = await bus_connect("operator", "alice")
    with pytest.raises(counters.CounterError, match="cannot read llmgw-usage"):
        await counters.totals(operator, subjects.USAGE_STREAM, "llmgw.usage.>", timeout_s=1e-6)


# --------------------------------------------------------------------------- following, closing


async def test_a_reader_resuming_at_the_end_of_the_log_is_caught_up_before_its_request_expires(
    provisioned: bus.BusClient, bus_connect: BusConnect
) -> None:
    """A control plane whose snapshot holds the whole log waits for `caught_up` before it
    acts: it must not wait for a pull request that only a new event would answer."""
    node = await bus_connect("node", "node-a")
    published = await bus.Publisher(node.jetstream()).publish_all(
        shard_report(i, "node-a") for i in range(3)
    )
    router = await bus_connect("router", "router-1")
    reader = bus.Reader(router, after_seq=published[-1].seq, heartbeat_s=0.5, expires_s=120.0)
    async with following(reader) as (got, _task):
        await asyncio.wait_for(reader.caught_up.wait(), 30)
        assert got == []
        later = await bus.Publisher(node.jetstream()).publish(shard_report(3, "node-a"))
        await until_kept(got, 1, "the event published after catching up")
        assert [r.seq for r in got] == [later.seq]


async def test_an_idle_following_reader_keeps_its_consumer(
    provisioned: bus.BusClient, bus_connect: BusConnect
) -> None:
    """The server's idle heartbeats tell a reader its request is alive: a quiet log is no
    reason to start a new consumer."""
    node = await bus_connect("node", "node-a")
    publisher = bus.Publisher(node.jetstream())
    await publisher.publish(shard_report(0, "node-a"))
    router = await bus_connect("router", "router-1")
    reader = bus.Reader(router, heartbeat_s=1.0)
    async with following(reader) as (got, _task):
        await asyncio.wait_for(reader.caught_up.wait(), 30)
        await asyncio.sleep(6.0)  # quiet for six heartbeats
        assert reader.resets == 0
        await publisher.publish(shard_report(1, "node-a"))
        await until_kept(got, 2, "the event after the quiet spell")
        assert reader.resets == 0


async def test_a_following_reader_whose_connection_closes_says_so_instead_of_retrying(
    provisioned: bus.BusClient, bus_connect: BusConnect
) -> None:
    """A closed connection never reconnects: the reader ends with what to do, not in a loop
    of attempts on it."""
    router = await bus_connect("router", "router-1")
    reader = bus.Reader(router, heartbeat_s=0.3)

    async with following(reader) as (_, task):
        await asyncio.wait_for(reader.caught_up.wait(), 30)
        await router.close()
        with pytest.raises(bus.ReaderError, match="connection is closed"):
            await asyncio.wait_for(task, 60)


async def test_a_closed_reader_leaves_no_consumer_on_the_stream(
    provisioned: bus.BusClient, bus_connect: BusConnect
) -> None:
    node = await bus_connect("node", "node-a")
    await bus.Publisher(node.jetstream()).publish_all(shard_report(i, "node-a") for i in range(3))
    router = await bus_connect("router", "router-1")
    assert len(await read_all(bus.Reader(router, follow=False))) == 3
    js = provisioned.jetstream()

    async def none_left() -> bool:
        return (await js.stream_info(subjects.STREAM)).state.consumer_count == 0

    # Well before the server would remove it for inactivity (30 s at the least).
    await wait_until(none_left, 15.0, "the closed reader's consumer deleted")


async def test_a_node_restarted_after_a_crash_replaces_the_consumer_it_left(
    provisioned: bus.BusClient, bus_connect: BusConnect
) -> None:
    """A node may hold one consumer, of a fixed name: the one its killed process left (with
    the old start point) must not keep the restarted agent from resuming where it says."""
    leader = bus.Publisher(provisioned.jetstream())
    stops = [
        events.StopShard(id=f"stop-{i}", ts=1.0, node="node-a", replica_id="r1", generation=i)
        for i in range(3)
    ]
    acks = [await leader.publish(stop) for stop in stops]
    node = await bus_connect("node", "node-a")

    await node_a_commands(node, 0).start()  # never closed: the process died
    again = await read_all(node_a_commands(node, acks[1].seq))
    assert [(r.seq, r.event) for r in again] == [(acks[2].seq, stops[2])]


async def test_a_replay_whose_counted_messages_expired_before_delivery_still_ends(
    provisioned: bus.BusClient, bus_connect: BusConnect
) -> None:
    """`ctl replay` reads up to now and stops. A heartbeat counted when its consumer was made
    but gone (its TTL) before it was delivered leaves no message to say the end was reached:
    the reader asks the server, after a short pull, not a follower's long one."""
    node = await bus_connect("node", "node-a")
    router = await bus_connect("router", "router-1")
    await bus.Publisher(node.jetstream()).publish(heartbeat("node-a", 1), ttl_s=2)
    reader = bus.Reader(router, follow=False, heartbeat_s=0.5, expires_s=120.0)
    got: list[bus.Record] = []
    async with reader:
        assert not reader.caught_up.is_set()  # the heartbeat is still stored, and counted
        js = provisioned.jetstream()

        async def expired() -> bool:
            return (await js.stream_info(subjects.STREAM)).state.messages == 0

        await wait_until(expired, 15.0, "the heartbeat expired from the stream")

        async def drain() -> None:
            async for batch in reader.batches():
                got.extend(batch)

        await asyncio.wait_for(drain(), 30)
    assert got == []
    assert reader.caught_up.is_set()


async def test_closing_a_reader_ends_the_iteration_waiting_on_it_at_once(
    provisioned: bus.BusClient, bus_connect: BusConnect
) -> None:
    """A service stopping closes its readers from another task: the loop waiting for the
    next event (or heartbeat, here 30 s away) ends now."""
    router = await bus_connect("router", "router-1")
    reader = bus.Reader(router, heartbeat_s=30.0)
    await reader.start()
    async with following(reader, entered=False) as (got, task):

        async def waiting() -> bool:
            return reader._request_open

        await wait_until(waiting, 15.0, "the reader waiting on its pull request")
        await reader.close()
        await asyncio.wait_for(task, 10)
        assert got == []


async def test_a_reader_closed_while_the_server_is_down_stops_starting_over(
    provisioned: bus.BusClient, bus_connect: BusConnect, nats_server: TestNatsServer
) -> None:
    """A service stopping during an outage closes its readers: the one retrying to start a
    new consumer stops there, rather than waiting for the server to come back."""
    router = await bus_connect("router", "router-1", max_reconnect_attempts=-1)
    reader = bus.Reader(router, heartbeat_s=0.3)

    await reader.start()
    async with following(reader, entered=False) as (_, task):
        await asyncio.wait_for(reader.caught_up.wait(), 30)
        await asyncio.to_thread(nats_server.stop)

        async def starting_over() -> bool:
            return reader.resets >= 1

        await wait_until(starting_over, 30.0, "the reader starting over")
        await reader.close()
        await asyncio.wait_for(task, 30)
        assert not nats_server.running


async def test_an_empty_message_in_the_log_does_not_stall_readers_of_another_account(
    provisioned: bus.BusClient, bus_connect: BusConnect
) -> None:
    """The server ends a response it streams to another account (a pull request's, for
    every reader but the test administrator) at a message with neither payload nor
    headers, and delivers nothing more on that request. A node may store one on its own
    subjects: readers skip it and go on at once, not after their idle heartbeats stop
    (here 3 x 10 s)."""
    node = await bus_connect("node", "node-a")
    publisher = bus.Publisher(node.jetstream())
    first = await publisher.publish(shard_report(0, "node-a"))
    empty = await node.jetstream().publish("llmgw.events.node.node-a.shard", b"")
    last = await publisher.publish(shard_report(1, "node-a"))
    router = await bus_connect("router", "router-1")
    reader = bus.Reader(router, follow=False, heartbeat_s=10.0)
    records = await asyncio.wait_for(read_all(reader), 15)
    assert [r.seq for r in records] == [first.seq, last.seq]
    assert [s.seq for s in reader.skipped] == [empty.seq]

    # Following: the event after an empty one arrives as the empty one does.
    follower = bus.Reader(router, after_seq=last.seq, heartbeat_s=10.0)
    async with following(follower) as (got, _task):
        await asyncio.wait_for(follower.caught_up.wait(), 15)
        await node.jetstream().publish("llmgw.events.node.node-a.shard", b"")
        later = await publisher.publish(shard_report(2, "node-a"))
        await until_kept(got, 1, "the event after an empty message")
        assert [r.seq for r in got] == [later.seq]


async def test_a_load_report_stream_made_before_its_bound_is_used_and_said(
    bus_connect: BusConnect, connect: Connector
) -> None:
    """`llmgw-signals` made before it kept one report per subject: used as it is, and the
    control plane says what that costs and what to do."""
    control = await bus_connect("control", "control-a")
    js = control.jetstream()
    await js.add_stream(name=subjects.SIGNALS_STREAM, subjects=list(subjects.SIGNALS_SUBJECTS),
                        storage=api.StorageType.MEMORY)  # fmt: skip
    with structlog.testing.capture_logs() as logged:
        done = await bus.provision(js)
    assert subjects.SIGNALS_STREAM in done.existing
    (said,) = [e for e in logged if e["event"] == "stream_unbounded_per_subject"]
    assert said["stream"] == subjects.SIGNALS_STREAM
    assert "nats stream rm llmgw-signals" in said["action"]
    with structlog.testing.capture_logs() as again:
        await bus.provision(js)  # the same stream, still unbounded: said at every start
    assert [e["stream"] for e in again if e["event"] == "stream_unbounded_per_subject"] == [
        subjects.SIGNALS_STREAM
    ]
    admin = await connect.admin()  # as the message says: the control plane may not
    await admin.jetstream().delete_stream(subjects.SIGNALS_STREAM)
    await admin.close()
    with structlog.testing.capture_logs() as fresh:
        done = await bus.provision(js)
    assert subjects.SIGNALS_STREAM in done.created
    assert not [e for e in fresh if e["event"] == "stream_unbounded_per_subject"]
    info = await js.stream_info(subjects.SIGNALS_STREAM)
    assert info.config.max_msgs_per_subject == 1

"""One contract for the bus ports (llmgw.bus.ports), run against memory and JetStream.

`memory`: llmgw.bus.memory on an injected clock. `jetstream`: llmgw.bus.JetStreamLog,
Lease and SnapshotStore on a real nats-server with mutual TLS and the rendered
authorization, each writer connected as the identity that owns its subjects. What a
service test concludes on the in-memory side holds on the real one only as far as this
suite says they agree: append/read order, dedupe within the window, fences accepted
and refused, TTL expiry, following from a sequence, the lease's hand-over and expiry,
and which snapshot is loaded.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest

from llmgw import bus
from llmgw.bus.memory import LeaseBucket, MemoryLease, MemoryLog, MemorySnapshots
from llmgw.core import events, subjects
from tests.harness import TestNatsServer, connect_as, wait_for
from tests.kit.events import shard_report as shard

NODE_EVENTS = subjects.node_events("node-a")


@dataclass
class Side:
    """The log under test as each identity sees it, and how time passes for it."""

    node: bus.EventLog
    """Writes node-a's events."""
    control: bus.EventLog
    """Writes control decisions; reads everything."""
    let_pass: Callable[[float], Awaitable[None]]
    """Let `seconds` pass for the log's TTLs."""
    patience_s: float
    """How long to poll for something time-driven (a real server's TTL sweep)."""
    lease: Callable[[str, float], Awaitable[bus.LeasePort]]
    """The lease port of control plane `name`, with a TTL."""
    snapshots: Callable[[], Awaitable[bus.SnapshotPort]]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "jetstream"])
async def side(request: pytest.FixtureRequest) -> AsyncIterator[Side]:
    if request.param == "memory":
        clock = FakeClock()
        log = MemoryLog(clock=clock)
        bucket = LeaseBucket(clock=clock)
        store = MemorySnapshots()

        async def advance(seconds: float) -> None:
            clock.now += seconds

        async def memory_lease(name: str, ttl_s: float) -> bus.LeasePort:
            return MemoryLease(bucket, name, ttl_s=ttl_s)

        async def memory_snapshots() -> bus.SnapshotPort:
            return store

        yield Side(log, log, advance, 1.0, memory_lease, memory_snapshots)
        return
    server: TestNatsServer = request.getfixturevalue("nats_server")
    control_nc = await connect_as(server, "control", "control-a")
    await bus.provision(control_nc.jetstream())
    node_nc = await connect_as(server, "node", "node-a")
    others: list[bus.BusClient] = []

    async def real_time(seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def real_lease(name: str, ttl_s: float) -> bus.LeasePort:
        nc = await connect_as(server, "control", name)
        others.append(nc)
        return await bus.Lease.open(nc.jetstream(), name, ttl_s=ttl_s)

    async def real_snapshots() -> bus.SnapshotPort:
        return await bus.SnapshotStore.open(control_nc.jetstream())

    # A real server's TTL sweep and a busy machine: poll generously, never assume speed.
    got = Side(
        node=bus.JetStreamLog(node_nc),
        control=bus.JetStreamLog(control_nc),
        let_pass=real_time,
        patience_s=60.0,
        lease=real_lease,
        snapshots=real_snapshots,
    )
    yield got
    for nc in (node_nc, control_nc, *others):
        await asyncio.wait_for(nc.close(), 5)


def beat(i: int, node: str = "node-a") -> events.Heartbeat:
    return events.Heartbeat(id=f"{node}-hb-{i}", ts=1_800_000_000.0 + i, node=node, seq=i)


def elected(i: int) -> events.LeaderElected:
    return events.LeaderElected(
        id=f"leader-{i}", ts=1_800_000_000.0 + i, leader="control-a", epoch=i, basis_seq=0
    )


async def read(log: bus.EventLog, *, after_seq: int = 0, on: str = "") -> list[bus.Record]:
    out: list[bus.Record] = []
    filters = [on] if on else list(subjects.STREAM_SUBJECTS)
    async with log.reader(after_seq=after_seq, subjects_filter=filters, follow=False) as reader:
        async for batch in reader.batches():
            out.extend(batch)
    return out


async def test_appends_are_read_back_in_order_from_any_sequence(side: Side) -> None:
    published = [await side.node.append(shard(i)) for i in range(6)]
    seqs = [p.seq for p in published]
    assert seqs == sorted(seqs)
    assert not any(p.duplicate for p in published)
    for n in (0, seqs[0], seqs[3], seqs[-1]):
        records = await read(side.control, after_seq=n)
        assert [r.seq for r in records] == [s for s in seqs if s > n]
        assert [r.event for r in records] == [shard(i) for i in range(6) if seqs[i] > n]
        assert all(r.subject == subjects.node_event("node-a", "shard") for r in records)


async def test_a_second_append_of_an_id_within_the_window_is_a_duplicate(side: Side) -> None:
    first = await side.node.append(shard(1))
    again = await side.node.append(shard(1))
    other = await side.node.append(shard(2))
    assert not first.duplicate
    assert again.duplicate
    assert again.seq == first.seq
    assert [r.seq for r in await read(side.control)] == [first.seq, other.seq]


async def test_a_fence_holds_until_the_fenced_subjects_move(side: Side) -> None:
    control = subjects.CONTROL_EVENTS_ALL
    one = await side.control.append(elected(1), fence=bus.Fence(control, 0))
    assert await side.control.last_seq(control) == one.seq
    # A write elsewhere does not move a fence on the control subjects.
    await side.node.append(shard(1))
    two = await side.control.append(elected(2), fence=bus.Fence(control, one.seq))
    with pytest.raises(bus.FenceRefused):
        await side.control.append(elected(3), fence=bus.Fence(control, one.seq))
    with pytest.raises(bus.FenceRefused):
        await side.control.append(elected(4), fence=bus.Fence(control, 0))
    # A retry of the write that landed (its ack lost) is acknowledged, not refused.
    retry = await side.control.append(elected(2), fence=bus.Fence(control, one.seq))
    assert (retry.seq, retry.duplicate) == (two.seq, True)
    stored = await read(side.control, on=control)
    assert [r.event for r in stored] == [elected(1), elected(2)]
    assert await side.control.last_seq(control) == two.seq


async def test_a_message_with_a_ttl_expires_and_the_rest_stays(side: Side) -> None:
    kept = await side.node.append(shard(1))
    expiring = await side.node.append(beat(1), ttl_s=1)
    assert [r.seq for r in await read(side.control)] == [kept.seq, expiring.seq]
    assert await side.node.last_seq(subjects.node_event("node-a", "heartbeat")) == expiring.seq
    await side.let_pass(1.5)

    async def gone() -> bool:
        return [r.seq for r in await read(side.control)] == [kept.seq]

    await wait_for(gone, side.patience_s, "the heartbeat expiring from the log", every_s=0.25)
    assert await side.node.last_seq(subjects.node_event("node-a", "heartbeat")) == 0
    with pytest.raises(ValueError, match="only heartbeats"):
        await side.node.append(shard(2), ttl_s=1)


async def test_a_follower_from_a_sequence_sees_later_appends_in_order(side: Side) -> None:
    before = [await side.node.append(shard(i)) for i in range(3)]
    reader = side.control.reader(after_seq=before[1].seq, subjects_filter=[NODE_EVENTS])
    seen: list[bus.Record] = []
    await reader.start()

    async def follow() -> None:
        async for batch in reader.batches():
            seen.extend(batch)

    task = asyncio.create_task(follow())
    try:
        await wait_for(lambda: len(seen) == 1, side.patience_s, "the record after the start")
        await wait_for(lambda: reader.caught_up.is_set(), side.patience_s, "caught up")
        later = [await side.node.append(shard(i)) for i in range(3, 8)]
        await wait_for(lambda: len(seen) == 6, side.patience_s, "the later appends")
        assert [r.seq for r in seen] == [before[2].seq, *(p.seq for p in later)]
        assert [r.event for r in seen] == [shard(i) for i in range(2, 8)]
    finally:
        await reader.close()
        task.cancel()
        await asyncio.wait([task], timeout=10)


# --------------------------------------------------------------------------- lease, snapshots


async def test_one_contender_holds_the_lease_until_it_gives_it_up(side: Side) -> None:
    a = await side.lease("control-a", 10)
    b = await side.lease("control-b", 10)
    assert await b.holder() is None
    assert await a.acquire()
    assert a.held
    assert a.epoch > 0
    assert not await b.acquire()
    holder = await b.holder()
    assert holder is not None
    assert (holder.holder, holder.epoch) == ("control-a", a.epoch)
    await a.renew()
    assert not await b.acquire()
    await a.release()
    assert await b.acquire()
    assert b.epoch > a.epoch
    with pytest.raises(bus.LeaseLost):
        await a.renew()


async def test_a_lease_not_renewed_runs_out_and_its_holder_learns_it(side: Side) -> None:
    a = await side.lease("control-a", 1)
    b = await side.lease("control-b", 1)
    assert await a.acquire()
    await side.let_pass(1.5)
    await wait_for(b.acquire, side.patience_s, "the lease running out", every_s=0.25)
    assert b.epoch > a.epoch
    with pytest.raises(bus.LeaseLost):
        await a.renew()


async def test_the_newest_snapshot_or_the_newest_at_or_before_is_loaded(side: Side) -> None:
    store = await side.snapshots()
    assert await store.load() is None
    await store.save(b"state at 10", 10)
    await store.save(b"state at 20", 20)
    newest = await store.load()
    assert newest is not None
    assert (newest.seq, newest.data) == (20, b"state at 20")
    older = await store.load(at_or_before=15)
    assert older is not None
    assert (older.seq, older.data) == (10, b"state at 10")
    assert await store.load(at_or_before=5) is None

"""llmgw.bus.memory beyond the contract suite: what only an injected clock can show
(the end of the duplicate window, a lease running out), and subject filters."""

from __future__ import annotations

import pytest

from llmgw import bus
from llmgw.bus.memory import (
    LeaseBucket,
    MemoryLease,
    MemoryLog,
    MemorySnapshots,
    subject_matches,
)
from tests.kit.events import shard_report as shard


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("subject", "pattern", "match"),
    [
        ("llmgw.events.control.leader_elected", "llmgw.events.control.>", True),
        ("llmgw.events.control", "llmgw.events.control.>", False),
        ("llmgw.events.node.a.shard", "llmgw.events.node.*.shard", True),
        ("llmgw.events.node.a.b.shard", "llmgw.events.node.*.shard", False),
        ("llmgw.cmd.a", "llmgw.cmd.a", True),
        ("llmgw.cmd.ab", "llmgw.cmd.a", False),
        ("llmgw.cmd.a.x", "llmgw.cmd.a", False),
    ],
)
def test_subject_filters_match_as_nats_does(subject: str, pattern: str, match: bool) -> None:
    assert subject_matches(subject, pattern) is match


async def test_an_id_seen_before_the_window_is_stored_again() -> None:
    clock = Clock()
    log = MemoryLog(clock=clock, duplicate_window_s=120)
    first = await log.append(shard(1))
    clock.now += 119
    assert (await log.append(shard(1))).duplicate
    clock.now += 2
    again = await log.append(shard(1))
    assert not again.duplicate
    assert again.seq > first.seq


async def test_a_deleted_message_is_gone_from_reads_and_fences() -> None:
    log = MemoryLog()
    one = await log.append(shard(1))
    two = await log.append(shard(2))
    result = await log.delete([two.seq, 99])
    assert (result.deleted, result.gone) == (1, 1)
    assert [r.seq for r in log.records()] == [one.seq]
    assert await log.last_seq("llmgw.events.node.node-a.>") == one.seq


async def test_a_lease_runs_out_on_the_clock_and_its_holder_learns_it_lost() -> None:
    clock = Clock()
    bucket = LeaseBucket(clock=clock)
    a, b = MemoryLease(bucket, "control-a", ttl_s=3), MemoryLease(bucket, "control-b", ttl_s=3)
    assert await a.acquire()
    assert not await b.acquire()
    clock.now += 2
    await a.renew()  # a fresh TTL from now
    clock.now += 2
    assert a.held
    assert not await b.acquire()
    clock.now += 1.5
    assert not a.held
    assert await b.acquire()
    assert b.epoch > a.epoch
    with pytest.raises(bus.LeaseLost):
        await a.renew()
    await a.release()  # nothing of a's to release: b keeps it
    holder = await b.holder()
    assert holder is not None
    assert holder.holder == "control-b"


async def test_snapshots_keep_the_newest_and_load_at_or_before() -> None:
    store = MemorySnapshots(keep=2)
    for seq in (10, 20, 30):
        await store.save(f"state {seq}".encode(), seq)
    assert sorted(store.saved) == [20, 30]
    newest = await store.load()
    assert newest is not None
    assert (newest.seq, newest.data) == (30, b"state 30")
    older = await store.load(at_or_before=25)
    assert older is not None
    assert older.seq == 20
    assert await store.load(at_or_before=15) is None

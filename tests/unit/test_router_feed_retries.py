"""The router's log feed on in-memory ports, continued: its retries and back-off, a
snapshot store it cannot read, and what one batch of records tells the router's keys.
The same `LogFeed` and helpers as tests/unit/test_router_feed_ports.py."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import structlog

from llmgw import bus
from llmgw.bus.memory import MemoryLog, MemoryReader, MemorySnapshots
from llmgw.core import events, subjects
from llmgw.core.tenancy import KeySettings
from llmgw.router import feed as feed_mod
from llmgw.router.config import LogSource
from llmgw.router.feed import LogFeed
from llmgw.router.ports import FeedPorts
from llmgw.router.table import Catalog, EndpointTable
from tests.unit.scenarios import profile
from tests.unit.test_router_feed_ports import (
    DEADLINE_S,
    FlakyLog,
    copy,
    feed_on,
    routable,
    serving_sim,
    until,
)


def retries(logged: list[dict[str, object]]) -> list[object]:
    return [e["retry_in_s"] for e in logged if e["event"] == "feed_retry"]


async def test_waits_double_while_the_log_is_unreachable_up_to_the_most(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each failure to open the log waits twice as long as the one before, never more than
    RETRY_MAX_S, and the wait a retry line names is the one the feed then waits."""
    monkeypatch.setattr(feed_mod, "RETRY_FIRST_S", 0.05)
    monkeypatch.setattr(feed_mod, "RETRY_MAX_S", 0.2)
    opened: list[float] = []

    @contextlib.asynccontextmanager
    async def opener() -> AsyncIterator[FeedPorts]:
        opened.append(time.monotonic())
        raise OSError("connection refused")
        yield FeedPorts(log=MemoryLog(), snapshots=MemorySnapshots())  # never reached

    feed = LogFeed(LogSource(name="r1"), Catalog(), EndpointTable(), ports=opener)
    with structlog.testing.capture_logs() as logged:
        feed.start()
        try:
            await until(lambda: len(opened) >= 6, "six tries to open the log")
        finally:
            await feed.close()
    waits = retries(logged)[:5]
    assert waits == [0.05, 0.1, 0.2, 0.2, 0.2]
    for i, wait in enumerate(waits):
        assert isinstance(wait, float)
        assert opened[i + 1] - opened[i] >= wait, f"waited less than the {wait} s it said"


async def test_a_feed_that_folded_a_single_record_retries_soon_again() -> None:
    """Any progress, one record included, starts the waits over."""
    log = FlakyLog()
    await log.append(events.ModelDeclared(id="d1", ts=1.0, operator="alice", profile=profile("m")))
    opened: list[int] = []

    @contextlib.asynccontextmanager
    async def opener() -> AsyncIterator[FeedPorts]:
        opened.append(1)
        if len(opened) == 1:
            raise OSError("connection refused")  # no progress: the wait doubles after it
        yield FeedPorts(log=log, snapshots=MemorySnapshots())

    feed = LogFeed(LogSource(name="r1"), Catalog(), EndpointTable(), ports=opener)
    with structlog.testing.capture_logs() as logged:
        feed.start()
        try:
            await until(feed.ready.is_set, "the feed caught up on its second try")
            assert feed.cluster.last_seq == 1
            log.connected, log.gone_for_good = False, True
            await log.append(events.ModelRemoved(id="r1", ts=2.0, operator="alice", name="m"))
            log.back.set()  # the reader, having folded one record, fails
            await until(lambda: len(retries(logged)) >= 2, "a second retry")
        finally:
            await feed.close()
    assert retries(logged)[:2] == [feed_mod.RETRY_FIRST_S, feed_mod.RETRY_FIRST_S]


async def test_a_failure_as_the_feed_closes_is_not_reported_as_a_retry() -> None:
    sim = serving_sim()
    log = FlakyLog()
    await copy(sim, log)
    feed = feed_on(log)
    with structlog.testing.capture_logs() as logged:
        feed.start()
        try:
            await asyncio.wait_for(feed.ready.wait(), DEADLINE_S)
            log.connected, log.gone_for_good = False, True
            sim.heartbeats()
            await copy(sim, log)
            feed._stop.set()  # closing: the reader fails under the feed at that moment
            log.back.set()
            task = feed._task
            assert task is not None
            await asyncio.wait_for(asyncio.shield(task), DEADLINE_S)
        finally:
            await feed.close()
    assert retries(logged) == []
    assert not [e for e in logged if e["event"] == "feed_ended"]


class UnreadableSnapshots(MemorySnapshots):
    async def load(self, *, at_or_before: int | None = None) -> bus.Snapshot | None:
        raise OSError("snapshot store not readable")


async def test_an_unreadable_snapshot_store_means_the_whole_log_is_folded() -> None:
    sim = serving_sim()
    log = MemoryLog()
    await copy(sim, log)
    feed = feed_on(log, UnreadableSnapshots())
    feed.start()
    try:
        await asyncio.wait_for(feed.ready.wait(), DEADLINE_S)
    finally:
        await feed.close()
    assert feed.applied == len(sim.records), "read from the first record"
    assert routable(feed, "m") == set(sim.state.endpoints)


def test_one_batch_tells_the_keys_of_a_key_event_anywhere_in_it_and_only_then() -> None:
    """A key created early in a batch reaches the router's keys even when other events
    follow it; a batch without key events does not rebuild the keys; a record the fold
    refuses counts as refused, not applied."""
    told: list[set[str]] = []
    feed = LogFeed(LogSource(name="r1"), Catalog(), EndpointTable(),
                   ports=FeedPorts(log=MemoryLog(), snapshots=MemorySnapshots()),
                   on_keys=lambda keys: told.append(set(keys)))  # fmt: skip
    made = events.KeyCreated(id="k1", ts=1.0, operator="alice",
                             key=KeySettings(name="team-a"), sha256="1" * 64)  # fmt: skip
    declared = events.ModelDeclared(id="d1", ts=1.0, operator="alice", profile=profile("m"))
    batch = [bus.Record(seq=1, subject="s", time=1.0, event=made),
             bus.Record(seq=2, subject="s", time=1.0, event=declared)]  # fmt: skip
    feed.apply(batch)
    assert told == [{"team-a"}]
    assert feed.catalog.resolve("m") is not None

    removed = events.ModelRemoved(id="r1", ts=2.0, operator="alice", name="m")
    feed.apply([bus.Record(seq=3, subject="s", time=2.0, event=removed)])
    assert feed.catalog.resolve("m") is None
    assert told == [{"team-a"}], "no key event: the keys are left as they are"

    ghost = events.ModelChanged(id="c1", ts=3.0, operator="alice", profile=profile("g"))
    feed.apply([bus.Record(seq=4, subject="s", time=3.0, event=ghost)])
    assert (feed.applied, feed.rejected) == (3, 1)


class EndingLog(MemoryLog):
    """A log whose readers stop at its end instead of following it."""

    def reader(self, **kw: Any) -> MemoryReader:
        kw["follow"] = False
        return super().reader(**kw)


async def test_a_reader_that_ends_by_itself_is_reported_not_reopened_unseen() -> None:
    sim = serving_sim()
    log = EndingLog()
    await copy(sim, log)
    feed = feed_on(log)
    with structlog.testing.capture_logs() as logged:
        feed.start()
        try:
            task = feed._task
            assert task is not None
            await asyncio.wait_for(asyncio.shield(task), DEADLINE_S)
        finally:
            await feed.close()
    (ended,) = [e for e in logged if e["event"] == "feed_ended"]
    assert ended["error"] == "the log's reader ended"
    assert ended["seq"] == sim.state.last_seq
    assert retries(logged) == []
    assert routable(feed, "m") == set(sim.state.endpoints), "the tables are kept"


class FailingReader(MemoryReader):
    """A reader that fails before it has caught up: the server went away at once."""

    async def start(self) -> None:
        pass

    async def batches(self) -> AsyncIterator[list[bus.Record]]:
        raise bus.ReaderError("the connection is closed")
        yield []  # never reached: an async generator


class FailingLog(MemoryLog):
    def reader(self, **kw: Any) -> MemoryReader:
        return FailingReader(self, after_seq=kw.get("after_seq", 0),
                             subjects_filter=subjects.STREAM_SUBJECTS, follow=True)  # fmt: skip


async def test_a_reader_failing_before_it_caught_up_leaves_no_task_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(feed_mod, "RETRY_FIRST_S", 0.001)
    monkeypatch.setattr(feed_mod, "RETRY_MAX_S", 0.001)
    before = len(asyncio.all_tasks())
    feed = feed_on(FailingLog())
    with structlog.testing.capture_logs() as logged:
        feed.start()
        try:
            await until(lambda: len(retries(logged)) >= 10, "ten retries")
            assert not feed.ready.is_set()
            # The feed's task, and at most its current try's wait for readiness.
            assert len(asyncio.all_tasks()) <= before + 2, "a task left behind by each try"
        finally:
            await feed.close()

"""The router's log feed on in-memory ports (llmgw.bus.memory): no nats-server.

The same `LogFeed` as production, constructed with a `MemoryLog` and `MemorySnapshots`
(llmgw.router.ports.FeedPorts). The log's content comes from the pure core's scenario
(tests/unit/scenarios.py: a leader and obliging agents), copied record by record, so
the feed folds what a control plane would have written. Each test runs in milliseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import msgspec
import pytest
import structlog

from llmgw import bus
from llmgw.bus.memory import MemoryLog, MemoryReader, MemorySnapshots
from llmgw.core import attestation, events, state, subjects
from llmgw.core.tenancy import KeySettings
from llmgw.router import feed as feed_mod
from llmgw.router import ports as ports_
from llmgw.router.config import LogSource
from llmgw.router.feed import LogFeed, wanted
from llmgw.router.ports import FeedPorts
from llmgw.router.table import Catalog, EndpointTable
from tests.unit.scenarios import Sim, profile

DEADLINE_S = 10.0
"""Generous: a loaded machine may be slow; each wait normally ends in milliseconds."""


async def until(check: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + DEADLINE_S
    while not check():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


async def copy(sim: Sim, log: MemoryLog) -> None:
    """Append to `log` what `sim` wrote since the last copy, at the same sequences."""
    stored = len(log.records())
    for seq, event in sim.records[stored:]:
        published = await log.append(event)
        assert published.seq == seq, "the copy must keep the scenario's sequences"


def serving_sim() -> Sim:
    """One node, model `m` (alias `m-latest`, fallback `m-small`) served by one replica."""
    sim = Sim()
    sim.register("n1")
    sim.declare(profile("m", replicas=1, aliases=("m-latest",), fallbacks=("m-small",)))
    sim.settle()
    assert sim.rejected == []
    assert len(sim.state.endpoints) == 1
    return sim


def feed_on(log: MemoryLog, snapshots: MemorySnapshots | None = None) -> LogFeed:
    ports = FeedPorts(log=log, snapshots=snapshots or MemorySnapshots())
    return LogFeed(LogSource(name="r1"), Catalog(), EndpointTable(), ports=ports)


def routable(feed: LogFeed, model: str) -> set[str]:
    return {ep.id for ep in feed.table.for_model(model) if not ep.draining}


@pytest.fixture
async def started() -> AsyncIterator[list[LogFeed]]:
    """Feeds a test starts, closed at its end whatever happened."""
    feeds: list[LogFeed] = []
    yield feeds
    for feed in feeds:
        await feed.close()


async def start(feed: LogFeed, feeds: list[LogFeed]) -> LogFeed:
    feeds.append(feed)
    feed.start()
    await asyncio.wait_for(feed.ready.wait(), DEADLINE_S)
    return feed


async def test_starts_from_the_newest_snapshot_then_the_tail(started: list[LogFeed]) -> None:
    sim = serving_sim()
    log, snapshots = MemoryLog(), MemorySnapshots()
    await copy(sim, log)
    snap_seq = sim.state.last_seq
    await snapshots.save(state.encode_snapshot(sim.state), snap_seq)
    # The log's head is gone (retention): only the snapshot still knows the endpoint.
    deleted = await log.delete(range(1, snap_seq + 1))
    assert deleted.deleted > 0
    sim.declare(profile("m2", replicas=0))
    await copy(sim, log)

    feed = await start(feed_on(log, snapshots), started)
    (replica_id,) = sim.state.endpoints
    assert routable(feed, "m") == {replica_id}
    assert feed.catalog.resolve("m-latest") == feed.catalog.resolve("m")
    assert feed.catalog.resolve("m2") is not None, "the tail was not folded"
    assert feed.applied == len(sim.records) - snap_seq, "only the tail is read"
    assert feed.cluster.last_seq == sim.state.last_seq


async def test_a_replay_without_a_snapshot_folds_the_whole_log(started: list[LogFeed]) -> None:
    sim = serving_sim()
    log = MemoryLog()
    await copy(sim, log)
    feed = await start(feed_on(log), started)
    assert routable(feed, "m") == set(sim.state.endpoints)
    assert feed.applied == len(sim.records)
    assert state.digest(feed.cluster) == state.digest(sim.state)


async def test_follows_endpoints_up_and_down_and_model_changes(started: list[LogFeed]) -> None:
    sim = Sim()
    sim.register("n1")
    log = MemoryLog()
    await copy(sim, log)
    feed = await start(feed_on(log), started)
    assert feed.catalog.resolve("m") is None

    sim.declare(profile("m", replicas=1, aliases=("m-latest",)))
    sim.settle()
    await copy(sim, log)
    (replica_id,) = sim.state.endpoints
    await until(lambda: routable(feed, "m") == {replica_id}, "EndpointUp makes it routable")
    up = sim.state.endpoints[replica_id]
    assert feed.table.by_id[replica_id].url == up.url
    resolved = feed.catalog.resolve("m-latest")
    assert resolved is not None
    assert resolved.name == "m"

    # ModelChanged: a new alias and a fallback, the old alias gone.
    sim.change(profile("m", replicas=1, aliases=("m-v2",), fallbacks=("m-small",)))
    await copy(sim, log)
    await until(lambda: feed.catalog.resolve("m-v2") is not None, "the new alias")
    assert feed.catalog.resolve("m-latest") is None
    changed = feed.catalog.resolve("m")
    assert changed is not None
    assert changed.fallbacks == ("m-small",)

    # The engine fails: the leader takes its endpoint down, and the router stops routing.
    replica = sim.state.replicas[replica_id]
    sim.status("n1", replica_id, replica.generation, 0, "failed", error="exit 1")
    downs = [d for d in sim.leader() if isinstance(d, events.EndpointDown)]
    assert [d.replica_id for d in downs] == [replica_id]
    await copy(sim, log)
    await until(lambda: replica_id not in feed.table.by_id, "EndpointDown removes it")
    assert routable(feed, "m") == set()
    assert feed.catalog.resolve("m") is not None, "the model stays declared"
    assert feed.rejected == 0


async def test_static_models_and_endpoints_are_left_alone(started: list[LogFeed]) -> None:
    sim = serving_sim()
    log = MemoryLog()
    await copy(sim, log)
    (replica_id,) = sim.state.endpoints
    catalog = Catalog([profile("m", aliases=("static-alias",))])
    table = EndpointTable()
    table.add(replica_id, "http://static.internal:1", ["m"], ready=True)
    feed = LogFeed(
        LogSource(name="r1"),
        catalog,
        table,
        ports=FeedPorts(log=log, snapshots=MemorySnapshots()),
        static_models=frozenset({"m"}),
        static_endpoints=frozenset({replica_id}),
    )
    await start(feed, started)
    assert catalog.resolve("static-alias") is not None
    assert catalog.resolve("m-latest") is None
    assert table.by_id[replica_id].url == "http://static.internal:1"


async def test_an_undecodable_and_a_refused_record_are_counted_and_skipped(
    started: list[LogFeed],
) -> None:
    sim = serving_sim()
    log = MemoryLog()
    await copy(sim, log)
    feed = await start(feed_on(log), started)
    reader = feed._reader
    assert reader is not None
    known = routable(feed, "m")

    # A control event on an operator's subject: forged, the reader refuses to hand it out.
    forged = events.EndpointUp(
        id="forged", ts=sim.now, epoch=1, replica_id="r-x", model="m", url="http://evil:1"
    )
    at = await log.append(forged, subject=subjects.operator_event("alice", "model_declared"))
    # A change of a model never declared: decoded, but the fold refuses it.
    ghost = events.ModelChanged(id="chg-ghost", ts=sim.now, operator="alice", profile=profile("g"))
    await log.append(ghost)
    await until(lambda: feed.rejected == 1, "the refused record counted")
    assert reader.undecodable == 1
    assert [s.seq for s in reader.skipped] == [at.seq]
    assert "r-x" not in feed.table.by_id
    assert feed.catalog.resolve("g") is None

    # The feed goes on: the next record is folded as if nothing had happened.
    later = events.ModelDeclared(id="decl-m3", ts=sim.now, operator="alice", profile=profile("m3"))
    await log.append(later)
    await until(lambda: feed.catalog.resolve("m3") is not None, "m3 after the bad records")
    assert routable(feed, "m") == known
    assert feed.cluster.last_seq == len(log.records())


class FlakyLog(MemoryLog):
    """A log that can go away. While it is away its readers hand out nothing; once it is
    back they start over where they were (`resets`), as `bus.Reader` does across a
    server restart; `gone_for_good` makes them fail instead, as `bus.Reader` does when
    its connection is closed under it."""

    def __init__(self) -> None:
        super().__init__()
        self.back = asyncio.Event()
        self.gone_for_good = False

    def come_back(self) -> None:
        self.connected = True
        self.back.set()

    def reader(
        self,
        *,
        after_seq: int = 0,
        subjects_filter: Sequence[str] = subjects.STREAM_SUBJECTS,
        follow: bool = True,
        name: str = "reader",
        attestations: attestation.Attestations | None = None,
        attester: attestation.Sink | None = None,
    ) -> MemoryReader:
        return FlakyReader(
            self, after_seq=after_seq, subjects_filter=subjects_filter, follow=follow
        )


class FlakyReader(MemoryReader):
    def __init__(self, log: FlakyLog, **kw: Any) -> None:
        super().__init__(log, **kw)
        self._flaky = log

    async def batches(self) -> AsyncIterator[list[bus.Record]]:
        async for batch in super().batches():
            while not self._flaky.connected:
                await self._flaky.back.wait()
                if self._flaky.gone_for_good:
                    raise bus.ReaderError("the connection is closed")
                self.resets += 1
            yield batch


async def test_keeps_the_last_known_endpoints_while_the_log_is_away(
    started: list[LogFeed],
) -> None:
    sim = serving_sim()
    log = FlakyLog()
    await copy(sim, log)
    feed = await start(feed_on(log), started)
    known = routable(feed, "m")
    assert known == set(sim.state.endpoints)

    log.connected = False
    # What is written meanwhile (heartbeats, a new model) waits for the log to be back.
    sim.heartbeats()
    sim.declare(profile("m2", replicas=0))
    await copy(sim, log)
    await asyncio.sleep(0.2)
    assert routable(feed, "m") == known, "endpoints lost while the log was away"
    assert feed.catalog.resolve("m") is not None
    assert feed.catalog.resolve("m2") is None

    log.come_back()
    await until(lambda: feed.catalog.resolve("m2") is not None, "m2 once the log is back")
    assert routable(feed, "m") == known
    assert feed._reader is not None
    assert feed._reader.resets == 1


async def test_a_reader_that_fails_is_started_again_and_the_tables_kept_meanwhile(
    started: list[LogFeed],
) -> None:
    """A reader that fails for good (its connection closed under it; NATS unreachable
    when the router starts) leaves the tables as they were, and the feed opens the log
    again and follows it from where its fold stands: it never stops following."""
    sim = serving_sim()
    log = FlakyLog()
    await copy(sim, log)
    feed = await start(feed_on(log), started)
    known = routable(feed, "m")
    folded = feed.cluster.last_seq

    log.connected, log.gone_for_good = False, True
    sim.heartbeats()
    sim.declare(profile("m2", replicas=0))
    await copy(sim, log)
    with structlog.testing.capture_logs() as logged:
        log.back.set()
        await until(lambda: any(e["event"] == "feed_retry" for e in logged), "a retry")
        assert routable(feed, "m") == known
        assert feed.catalog.resolve("m2") is None
        log.gone_for_good = False  # a new connection reaches it
        log.come_back()
        await until(lambda: feed.catalog.resolve("m2") is not None, "m2 once the log is back")
    (retry,) = [e for e in logged if e["event"] == "feed_retry"][:1]
    assert "connection is closed" in retry["error"]
    assert retry["seq"] == folded
    assert not [e for e in logged if e["event"] == "feed_ended"]
    assert feed._task is not None
    assert not feed._task.done()
    assert routable(feed, "m") == known
    assert feed.cluster.last_seq == sim.state.last_seq
    assert feed.rejected == 0, "started again from where its fold stood, nothing re-read"


async def test_the_feed_releases_what_its_opener_opened_when_it_stops() -> None:
    """The production opener closes its connection on exit; the feed must leave it."""
    log = MemoryLog()
    entered: list[str] = []

    @contextlib.asynccontextmanager
    async def opener() -> AsyncIterator[FeedPorts]:
        entered.append("open")
        try:
            yield FeedPorts(log=log, snapshots=MemorySnapshots())
        finally:
            entered.append("closed")

    feed = LogFeed(LogSource(name="r1"), Catalog(), EndpointTable(), ports=opener)
    feed.start()
    await asyncio.wait_for(feed.ready.wait(), DEADLINE_S)
    assert entered == ["open"]
    await feed.close()
    assert entered == ["open", "closed"]


async def test_a_routers_log_refuses_to_write_before_the_server_would() -> None:
    nc = bus.BusClient()  # never connected: nothing may reach the server
    log = ports_.ReadOnlyLog(nc)
    assert not log.connected
    with pytest.raises(PermissionError):
        await log.append(events.ModelRemoved(id="rm", ts=1.0, operator="alice", name="m"))
    with pytest.raises(PermissionError):
        await log.delete([1])


def _draining(cluster: state.ClusterState, replica_id: str) -> bool:
    return wanted(cluster).endpoints[replica_id][2]


def test_an_endpoint_is_draining_while_its_node_shard_or_replica_goes() -> None:
    """Each way an endpoint's engine is on its way out marks it draining, so new requests
    go to another endpoint of its model once one is ready; nothing else does."""
    for how in ("node", "shard_phase", "drain_sent", "retired", "no_replica"):
        sim = serving_sim()
        cluster = sim.state
        (replica_id,) = cluster.endpoints
        assert not _draining(cluster, replica_id)
        replica = cluster.replicas[replica_id]
        shard = replica.shards[0]
        if how == "node":
            cluster.nodes[shard.node].draining = True
        elif how == "shard_phase":
            shard.phase = "draining"
        elif how == "drain_sent":
            shard.drain_sent_at = 1.0
        elif how == "retired":
            replica.retired = True
        else:
            del cluster.replicas[replica_id]
        assert _draining(cluster, replica_id), how


def test_an_endpoint_that_moves_under_the_same_id_is_followed_to_its_new_address() -> None:
    """An engine restarted on another port (or with a new key) under the same replica id:
    the router must send to the new address with the new key, not the dead one."""
    sim = serving_sim()
    feed = feed_on(MemoryLog())
    feed.cluster = sim.state
    feed.sync()
    (replica_id,) = sim.state.endpoints
    old = sim.state.endpoints[replica_id]
    assert feed.table.by_id[replica_id].url == old.url
    assert feed.table.by_id[replica_id].ready, "reported up once it serves: routed at once"
    for change in ({"url": "http://127.0.0.1:1"}, {"api_key": "k2"}, {"node": "n9"}):
        sim.state.endpoints[replica_id] = msgspec.structs.replace(old, **change)
        feed.sync()
        ep = feed.table.by_id[replica_id]
        got = {"url": ep.url, "api_key": ep.api_key, "node": ep.node}
        assert {k: got[k] for k in change} == change


def test_a_drain_called_off_makes_the_endpoint_preferred_again() -> None:
    sim = serving_sim()
    feed = feed_on(MemoryLog())
    feed.cluster = sim.state
    (replica_id,) = sim.state.endpoints
    node = sim.state.nodes[sim.state.replicas[replica_id].shards[0].node]
    for draining in (True, False, True, False):
        node.draining = draining
        feed.sync()
        assert feed.table.by_id[replica_id].draining is draining


def test_a_removed_model_and_its_aliases_no_longer_resolve() -> None:
    """ModelRemoved: a request for it (or an alias of it) is a 404, not sent to an engine
    that is being stopped."""
    sim = serving_sim()
    feed = feed_on(MemoryLog())
    feed.cluster = sim.state
    feed.sync()
    assert feed.catalog.resolve("m-latest") is not None
    del sim.state.models["m"]
    feed.sync()
    assert feed.catalog.resolve("m") is None
    assert feed.catalog.resolve("m-latest") is None
    assert "m" not in feed.models


async def test_a_feed_that_made_progress_retries_soon_again(started: list[LogFeed]) -> None:
    """Its waits double only while it gets nowhere: a reader that folded records before
    failing is retried after the first wait, not after the last one grown while NATS was
    unreachable (a router would lag the log by up to RETRY_MAX_S after each blip)."""
    sim = serving_sim()
    log = FlakyLog()
    await copy(sim, log)
    opened: list[int] = []

    @contextlib.asynccontextmanager
    async def opener() -> AsyncIterator[FeedPorts]:
        opened.append(1)
        if len(opened) == 1:
            raise OSError("connection refused")  # NATS not up yet: no progress
        yield FeedPorts(log=log, snapshots=MemorySnapshots())

    feed = LogFeed(LogSource(name="r1"), Catalog(), EndpointTable(), ports=opener)
    with structlog.testing.capture_logs() as logged:
        started.append(feed)
        feed.start()
        await until(feed.ready.is_set, "the feed caught up on its second try")
        log.connected, log.gone_for_good = False, True
        sim.heartbeats()
        await copy(sim, log)
        log.back.set()  # the reader, having folded the log, fails
        await until(lambda: len([e for e in logged if e["event"] == "feed_retry"]) >= 2, "two")
    waits = [e["retry_in_s"] for e in logged if e["event"] == "feed_retry"][:2]
    assert waits == [feed_mod.RETRY_FIRST_S, feed_mod.RETRY_FIRST_S]


def test_a_key_created_or_revoked_reaches_the_routers_keys_at_once() -> None:
    """A revoked key must stop working when its event is folded, not at the next sync
    some other event happens to cause."""
    told: list[set[str]] = []
    feed = LogFeed(LogSource(name="r1"), Catalog(), EndpointTable(),
                   ports=FeedPorts(log=MemoryLog(), snapshots=MemorySnapshots()),
                   on_keys=lambda keys: told.append(set(keys)))  # fmt: skip
    settings = KeySettings(name="team-a")
    made = events.KeyCreated(id="k1", ts=1.0, operator="alice", key=settings, sha256="1" * 64)
    gone = events.KeyRevoked(id="k2", ts=2.0, operator="alice", name="team-a")
    for seq, event in enumerate((made, gone), start=1):
        feed.apply([bus.Record(seq=seq, subject="s", time=float(seq), event=event)])
    assert feed.rejected == 0
    assert told == [{"team-a"}, set()]

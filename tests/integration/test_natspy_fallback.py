"""A bus client on nats-py's stock path (llmgw.bus.natspy's fallback, forced) against a
real nats-server with mutual TLS: it connects, publishes, and receives through a
Reader, whose fast subscription then runs on an ordinary nats-py callback."""

from __future__ import annotations

import asyncio

import pytest
from nats.protocol.parser import Parser

from llmgw import bus
from llmgw.bus import natspy
from llmgw.core import subjects
from tests.harness import TestNatsServer, connect_as, wait_for
from tests.kit.events import shard_report as shard


async def test_a_client_on_the_stock_path_connects_publishes_and_receives(
    nats_server: TestNatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(natspy, "REASON", "forced by the test")
    control = await connect_as(nats_server, "control", "control-a")
    node = await connect_as(nats_server, "node", "node-a")
    try:
        for nc in (control, node):
            assert not nc.overridden
            assert type(nc._ps) is Parser
            assert nc.options["reconnect_time_wait"] == natspy.FALLBACK_RECONNECT_WAIT_S
        await bus.provision(control.jetstream())
        published = [await bus.Publisher(node.jetstream()).publish(shard(i)) for i in range(5)]
        assert [p.duplicate for p in published] == [False] * 5

        # A Reader replays and follows over the fast subscription's stock callback.
        reader = bus.Reader(control, subjects_filter=[subjects.node_events("node-a")])
        seen: list[bus.Record] = []

        async def follow() -> None:
            async for batch in reader.batches():
                seen.extend(batch)

        async with reader:
            task = asyncio.create_task(follow())
            try:
                await wait_for(lambda: len(seen) >= 5, 60, "the replay on the stock path")
                later = await bus.Publisher(node.jetstream()).publish(shard(5))
                await wait_for(lambda: len(seen) >= 6, 60, "a later event, followed")
            finally:
                task.cancel()
                await asyncio.wait([task], timeout=10)
        assert [r.seq for r in seen] == [*(p.seq for p in published), later.seq]
        assert [r.event for r in seen] == [shard(i) for i in range(6)]
        assert reader.refused == 0

    finally:
        for nc in (control, node):
            await asyncio.wait_for(nc.close(), 5)

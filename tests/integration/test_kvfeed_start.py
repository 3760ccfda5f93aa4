"""A router's KV feed started after the engines' updates were stored (llmgw.router.kvfeed):
it reads the stream `llmgw-kv` from its window back, so it is warm when it says it is
ready, without waiting for the engines' next full updates. Real nats-server, mutual TLS,
signed updates published as the node."""

from __future__ import annotations

import asyncio

from llmgw import bus
from llmgw.core import kvblocks, subjects
from tests.harness import TestNatsServer, connect_as, wait_for
from tests.integration.test_kv_routing import kv_feed, provisioned


async def test_a_feed_started_after_an_update_was_stored_is_warm_when_ready(
    nats_server: TestNatsServer,
) -> None:
    await provisioned(nats_server)
    node = await connect_as(nats_server, "node", "node-a")
    try:
        keys = kvblocks.block_keys(list(range(64)), 16)
        update = kvblocks.KvUpdate(endpoint="e1", model="m", block_size=16, instance="i",
                                   seq=1, full=True, stored=keys, roots=keys[:1])  # fmt: skip
        await bus.KvPublisher(node, "node-a").publish(update)
        control = await connect_as(nats_server, "control", "c1")
        try:

            async def stored() -> bool:
                info = await control.jetstream().stream_info(subjects.KV_STREAM)
                return info.state.messages >= 1

            await wait_for(stored, 30, "the update stored")
        finally:
            await bus.close(control)
        feed = kv_feed(nats_server, "r1", window_s=60.0)
        feed.start()
        try:
            await asyncio.wait_for(feed.ready.wait(), 30)
            # Ready means caught up with what was stored: the update is folded already.
            assert set(feed.index.endpoints) == {("node-a", "e1")}
            assert len(feed.index) == len(keys)
        finally:
            await feed.close()
    finally:
        await bus.close(node)

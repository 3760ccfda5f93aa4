"""An engine relay (llmgw.agent.kvrelay) against an engine's real ZMQ sockets (the sim's
publisher: vLLM's wire format, its replay socket): what the engine published before the
relay subscribed, or while batches were lost, is asked for again and folded once; and the
sockets' frames and payloads are vLLM's."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from llmgw.agent.kvrelay import EngineRelay
from llmgw.core import kvblocks
from llmgw.sim import kvevents
from llmgw.sim.config import KvEventsConfig
from llmgw.sim.kvcache import StoredEvent
from llmgw.sim.kvevents import Publisher, encode_batch, wire_events
from tests.harness import wait_for

BS = 4


@pytest.fixture
def engine() -> Iterator[tuple[Publisher, str, str]]:
    # ipc:// paths are limited to ~107 bytes: pytest's tmp_path is too deep for them.
    where = Path(tempfile.mkdtemp(prefix="kvr-", dir="/tmp"))
    events, replay = f"ipc://{where}/e.events", f"ipc://{where}/e.replay"
    cfg = KvEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=events, replay_endpoint=replay
    )
    pub = Publisher(cfg, BS)
    try:
        yield pub, events, replay
    finally:
        pub.close()
        shutil.rmtree(where, ignore_errors=True)


def _chain_link(block: int) -> StoredEvent:
    """Block `block` of one prompt: its parent is the block before (none for block 0)."""
    return ("stored", [block], block - 1 if block else None, [block] * BS, None)


async def _published(pub: Publisher, batches: int) -> None:
    for b in range(batches):
        pub.publish([_chain_link(b)])
    await wait_for(lambda: pub.sent == batches, 30, f"the engine's {batches} batches sent")


class Sent:
    def __init__(self) -> None:
        self.updates: list[kvblocks.KvUpdate] = []

    async def __call__(self, update: kvblocks.KvUpdate) -> None:
        self.updates.append(update)


async def test_a_gap_is_filled_from_the_replay_and_each_batch_folded_once(
    engine: tuple[Publisher, str, str],
) -> None:
    pub, events, replay = engine
    await _published(pub, 5)  # nobody subscribed: only the replay buffer has them
    relay = EngineRelay(endpoint="e", model="m", events_addr=events, replay_addr=replay,
                        send=Sent())  # fmt: skip
    # The live batch 3 arrives first: 0-2 are missing, and the replay has 0-4.
    frames = [b"", (3).to_bytes(8, "big"), encode_batch(1.0, wire_events([_chain_link(3)], BS))]
    await relay._on_frames(frames)
    assert relay.gaps == 0
    assert relay.last_engine_seq == 4  # batch 3 came with the replay: not folded again
    assert relay.batches == 5
    assert len(relay.blocks) == 5  # the whole chain, from its first block on


async def test_what_the_engine_published_before_the_relay_started_reaches_routers(
    engine: tuple[Publisher, str, str],
) -> None:
    pub, events, replay = engine
    await _published(pub, 3)
    sent = Sent()
    relay = EngineRelay(endpoint="e", model="m", events_addr=events, replay_addr=replay,
                        send=sent, full_every_s=0.2)  # fmt: skip
    relay.start()
    try:
        await wait_for(
            lambda: any(u.full and len(u.stored) == 3 for u in sent.updates),
            30,
            "a full update of the 3 blocks stored before the relay started",
        )
    finally:
        await relay.stop(tell=False)
    assert relay.gaps == 0


async def test_a_cleared_cache_reaches_routers_as_a_full_update_at_once(
    engine: tuple[Publisher, str, str],
) -> None:
    pub, events, replay = engine
    await _published(pub, 1)
    sent = Sent()
    # The periodic full update is a minute away: only the clearing may bring one sooner.
    relay = EngineRelay(endpoint="e", model="m", events_addr=events, replay_addr=replay,
                        send=sent, full_every_s=60.0)  # fmt: skip
    relay.start()
    try:
        await wait_for(lambda: len(sent.updates) == 1, 30, "the first full update")
        (first,) = sent.updates[0].stored
        pub.publish([("stored", [100], None, [100] * BS, None)], cleared=True)
        await wait_for(
            lambda: any(u.full for u in sent.updates[1:]), 30, "a full update after the clearing"
        )
    finally:
        await relay.stop(tell=False)
    (full,) = [u for u in sent.updates[1:] if u.full]
    assert len(full.stored) == 1
    assert full.stored != [first]  # the new engine block only: the old one is gone


async def test_the_engines_sockets_speak_vllms_wire_format(
    engine: tuple[Publisher, str, str],
) -> None:
    """What any reader of vLLM's sockets gets: on the PUB socket (topic, 8-byte big-endian
    sequence counting batches from 0, payload); from the replay, every kept batch from the
    sequence asked for as (sequence, payload), then (-1, empty); a payload is an EventBatch
    of tagged maps, a cache's clearing first, a salt in its first block's extra keys."""
    pub, events, replay = engine
    ctx = zmq.asyncio.Context()
    sub, dealer = ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(events)
        pub.publish([("stored", [0, 1], None, [5] * (2 * BS), "salt-1")], cleared=True)
        pub.publish([("removed", [1])])
        live: list[list[bytes]] = []
        published = [2]

        async def one_live() -> bool:  # a SUB joins late: batches go out until one lands
            pub.publish([_chain_link(published[0])])  # block n in batch n
            published[0] += 1
            if await sub.poll(200):
                live.append(await sub.recv_multipart())
            return bool(live)

        await wait_for(one_live, 30, "a batch on the PUB socket")
        topic, seq_b, payload = live[0]
        assert topic == pub.cfg.topic.encode()
        seq = int.from_bytes(seq_b, "big")
        assert len(seq_b) == 8  # its payload is the replay's batch of that sequence (below)

        end = (-1).to_bytes(8, "big", signed=True)

        async def replayed(start: int) -> list[list[bytes]]:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            frames = [await asyncio.wait_for(dealer.recv_multipart(), 30)]
            while frames[-1][1] != end:
                frames.append(await asyncio.wait_for(dealer.recv_multipart(), 30))
            assert frames[-1] == [b"", end, b""]
            return frames[:-1]

        await wait_for(lambda: pub.sent == published[0], 30, "every batch sent")
        dealer.connect(replay)
        got = await replayed(0)
        assert len(got) == published[0]
        assert [f[1] for f in got] == [s.to_bytes(8, "big") for s in range(len(got))]
        assert got[seq][2] == payload
        first = msgspec.msgpack.decode(got[0][2])
        assert isinstance(first["ts"], float)
        assert first["data_parallel_rank"] == 0
        cleared, stored = first["events"]
        assert cleared == {"type": "AllBlocksCleared"}
        assert stored == {
            "type": "BlockStored", "block_hashes": [0, 1], "parent_block_hash": None,
            "token_ids": [5] * (2 * BS), "block_size": BS, "lora_id": None, "medium": "GPU",
            "lora_name": None, "extra_keys": [["salt-1"], None],
        }  # fmt: skip
        (removed,) = msgspec.msgpack.decode(got[1][2])["events"]
        assert removed == {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}
        assert [f[1] for f in await replayed(seq)] == [f[1] for f in got[seq:]]
    finally:
        sub.close(0)
        dealer.close(0)
        ctx.term()


@pytest.mark.parametrize(
    ("endpoint", "binds"),
    [
        ("tcp://*:5557", True),
        ("tcp://[::]:5557", True),
        ("ipc:///tmp/kv.events", True),
        ("inproc://kv", True),
        ("tcp://127.0.0.1:5557", False),
        ("tcp://relay.example:5557", False),
    ],
)
def test_the_engine_binds_where_vllm_binds_and_connects_elsewhere(
    endpoint: str, binds: bool
) -> None:
    assert kvevents._binds(endpoint) is binds

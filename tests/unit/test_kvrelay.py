"""An engine relay's batches (llmgw.agent.kvrelay): a batch numbered far ahead of the
engine's count (corrupt, or not this engine's) must not make the relay pass over the
engine's real batches that follow; a replay's overlap is still folded once; a batch of
many blocks is folded in slices, the agent's loop running between them, with the same
result as in one go."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.agent.kvrelay import FOLD_SLICE, SEQ_BEHIND, EngineRelay
from llmgw.core import kvblocks
from llmgw.sim import kvevents

BS = 4


def _frames(seq: int, block: int) -> list[bytes]:
    stored = {"type": "BlockStored", "block_hashes": [block], "parent_block_hash": None,
              "token_ids": [block] * BS, "block_size": BS, "lora_id": None, "medium": "GPU",
              "lora_name": None}  # fmt: skip
    return [b"kv", seq.to_bytes(8, "big", signed=True), kvevents.encode_batch(1.0, [stored])]


async def _nothing(_: kvblocks.KvUpdate) -> None:
    return None


def _relay() -> EngineRelay:
    # No replay socket: a gap is counted and the batch folded (what _replay finds is moot).
    return EngineRelay(endpoint="e", model="m", events_addr="ipc:///nonexistent",
                       replay_addr="", send=_nothing)  # fmt: skip


async def test_a_batch_numbered_far_ahead_does_not_hide_the_engines_next_batches() -> None:
    relay = _relay()
    for seq in range(4):
        await relay._on_frames(_frames(seq, 100 + seq))
    first = relay.instance
    await relay._on_frames(_frames(2**62, 999))  # not the engine's count
    await relay._on_frames(_frames(4, 104))
    await relay._on_frames(_frames(5, 105))
    assert relay.last_engine_seq == 5
    assert relay.renumbered == 1
    assert relay.instance != first  # routers are told to start this engine over
    assert len(relay.blocks) == 2  # what the engine stored since; routers get a full update


@settings(max_examples=50)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=40))
def test_batches_within_the_replay_window_are_folded_once_in_order(order: list[int]) -> None:
    """Batches arriving again or out of order (a replay overlapping the live stream) never
    start the engine over and never fold twice."""

    async def run() -> list[int]:
        relay = _relay()
        folded: list[int] = []
        for seq in [0, *order]:
            before = relay.last_engine_seq
            await relay._on_frames(_frames(seq, 1000 + seq))
            if relay.last_engine_seq != before:
                folded.append(relay.last_engine_seq)
        assert relay.renumbered == 0
        return folded

    folded = asyncio.run(run())
    assert folded == sorted(set(folded))
    assert folded[0] == 0
    assert set(folded) <= {0, *order}


def test_a_replay_as_far_back_as_vllms_buffer_is_an_overlap_not_a_renumbering() -> None:
    """vLLM replays up to 10,000 steps back by default (`buffer_steps`): batches that far
    below the last folded are already folded, not a sign of another count."""

    async def run() -> EngineRelay:
        relay = _relay()
        await relay._on_frames(_frames(0, 1))
        await relay._on_frames(_frames(20_000, 2))  # a gap: counted, folded
        await relay._on_frames(_frames(10_000, 3))  # the replay's overlap
        return relay

    relay = asyncio.run(run())
    assert (relay.renumbered, relay.last_engine_seq, relay.gaps) == (0, 20_000, 1)
    assert len(relay.blocks) == 2
    assert SEQ_BEHIND > 10_000


def _many(seq: int, n: int, removed: int = 0) -> list[bytes]:
    """A batch storing a chain of `n` blocks, then removing its last `removed`."""
    wire: list[dict[str, object]] = [
        {"type": "BlockStored", "block_hashes": [i], "parent_block_hash": i - 1 if i else None,
         "token_ids": [i % 50_000] * BS, "block_size": BS, "lora_id": None, "medium": "GPU",
         "lora_name": None}
        for i in range(n)
    ]  # fmt: skip
    wire += [{"type": "BlockRemoved", "block_hashes": [i], "medium": "GPU"}
             for i in range(n - removed, n)]  # fmt: skip
    return [b"kv", seq.to_bytes(8, "big", signed=True), kvevents.encode_batch(1.0, wire)]


def test_a_batch_of_many_blocks_is_folded_in_slices_while_the_loop_turns() -> None:
    n = 3 * FOLD_SLICE + 5

    async def run() -> tuple[int, EngineRelay, EngineRelay]:
        turns = 0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal turns
            while not done.is_set():
                turns += 1
                await asyncio.sleep(0)

        sliced, whole = _relay(), _relay()
        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        before = turns
        await sliced._on_frames(_many(0, n, removed=FOLD_SLICE + 3))
        during = turns - before
        done.set()
        await task
        # The same batch in one slice: what the routers are told must not differ.
        whole_items = kvblocks.read_batch(_many(0, n, removed=FOLD_SLICE + 3)[2])[1]
        whole._apply(kvblocks.events_of(whole_items))
        return during, sliced, whole

    during, sliced, whole = asyncio.run(run())
    assert during >= 6  # reading and folding each gave the loop a turn per slice
    assert sliced.blocks.held == whole.blocks.held
    assert list(sliced._stored) == list(whole._stored)
    assert list(sliced._removed) == list(whole._removed)
    assert len(sliced.blocks) == n - FOLD_SLICE - 3


def test_a_bad_event_in_a_late_slice_folds_nothing_of_its_batch() -> None:
    """Every slice is read before any is folded: a batch is folded whole or not at all."""
    frames = _many(0, 2 * FOLD_SLICE)
    wire = msgspec.msgpack.decode(frames[2])
    wire["events"].append({"type": "BlockStored", "block_hashes": [1], "token_ids": ["x"],
                           "block_size": BS, "medium": "GPU"})  # fmt: skip
    frames[2] = msgspec.msgpack.encode(wire)
    relay = _relay()
    asyncio.run(relay._on_frames(frames))
    assert (relay.bad_batches, len(relay.blocks), relay.last_engine_seq) == (1, 0, 0)


async def test_an_engines_oversized_message_is_not_taken_into_the_agents_memory(
    tmp_path: Path,
) -> None:
    # ZMQ took a frame of any size: an engine could make the agent allocate gigabytes.
    # Past MAX_BATCH_BYTES ZMQ drops the engine's connection (and does not connect again by
    # itself): the relay subscribes anew, and what the engine sends after is relayed.
    import zmq
    import zmq.asyncio

    from llmgw.agent import kvrelay

    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    addr = f"ipc://{tmp_path}/kv.sock"
    pub.bind(addr)
    relay = EngineRelay(endpoint="e", model="m", events_addr=addr, replay_addr="",
                        send=_nothing, context=ctx)  # fmt: skip
    relay.start()
    try:
        loop = asyncio.get_running_loop()

        async def relayed(seq: int) -> None:
            """Send batch `seq` until it is folded (a subscription, or a reconnection,
            takes effect some time after it is made: what PUB sent before is lost)."""
            deadline = loop.time() + 60
            while relay.last_engine_seq < seq:
                assert loop.time() < deadline, f"batch {seq} never relayed"
                await pub.send_multipart(_frames(seq, 100 + seq))
                await asyncio.sleep(0.05)

        await relayed(0)
        too_big = [b"kv", (1).to_bytes(8, "big"), b"\0" * (kvrelay.MAX_BATCH_BYTES + 1)]
        await pub.send_multipart(too_big)
        await relayed(2)
        assert relay.bad_batches == 0  # the oversized one never reached the fold
        assert relay.last_engine_seq == 2
        assert relay.reconnects >= 1
    finally:
        await relay.stop(tell=False)
        pub.close(0)
        ctx.term()

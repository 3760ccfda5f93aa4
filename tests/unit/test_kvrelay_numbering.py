"""An engine relay's batch numbering (llmgw.agent.kvrelay): a batch numbered far ahead
of the engine's count (corrupt, or not this engine's) must not make the relay pass over
the engine's real batches that follow, and a replay's overlap is still folded once."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.agent.kvrelay import SEQ_BEHIND, EngineRelay
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


def test_the_window_covers_vllms_replay_buffer() -> None:
    assert SEQ_BEHIND >= 10_000  # vLLM's default `buffer_steps`

"""An engine's KV-event batch that nests a block hash deeply is one bad batch: refused with
why, never a RecursionError out of the relay (which would end it for good)."""

from __future__ import annotations

import msgspec
import pytest

from llmgw.core import kvblocks


def removed_with_hash_nested(depth: int) -> bytes:
    """msgpack of [0.0, [["BlockRemoved", [hash], nil, nil]]], the hash 1 inside `depth`
    one-element arrays: written by hand, as an encoder refuses to nest that deep."""
    return (
        b"\x92"
        + b"\xcb"
        + bytes(8)  # [0.0,
        + b"\x91\x94\xacBlockRemoved"  # [["BlockRemoved",
        + b"\x91"
        + b"\x91" * depth
        + b"\x01"  # [hash],
        + b"\xc0\xc0"  # nil, nil]]]
    )


@pytest.mark.parametrize("depth", [3, 600, 5000])
def test_a_deeply_nested_block_hash_is_a_bad_batch(depth: int) -> None:
    payload = removed_with_hash_nested(depth)
    with pytest.raises(kvblocks.BadBatch):
        kvblocks.decode_batch(payload)


def test_a_hash_of_two_levels_still_reads() -> None:
    payload = msgspec.msgpack.encode([0.0, [["BlockRemoved", [[[1, 2], 3]], None, None]]])
    batch = kvblocks.decode_batch(payload)
    assert len(batch.events) == 1
    assert kvblocks.decode_batch(removed_with_hash_nested(2)).events


def test_an_offloading_placeholder_beside_a_gpu_store_costs_nothing() -> None:
    # vLLM's offloading connector sends CPU placeholders (no token ids, block size 0) in the
    # same batch as the GPU's stores: they are not folded, and the GPU store still is.
    cpu = ["BlockStored", [7], None, [], 0, None, "CPU", None, None, None]
    gpu = ["BlockStored", [8], None, list(range(16)), 16, None, "GPU", None, None, None]
    batch = kvblocks.decode_batch(msgspec.msgpack.encode([0.0, [cpu, gpu]]))
    assert [(type(e).__name__, e.block_size) for e in batch.events] == [("BlockStored", 16)]
    blocks = kvblocks.EngineBlocks()
    stored, _, _ = blocks.apply(batch.events)
    assert len(stored) == 1

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


def test_an_engine_that_only_stores_holds_a_bounded_fold(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine that stores blocks and never removes them (a bug, or a lie) grew the
    agent's fold of its cache without bound: every block a dict entry or two, for as long
    as the engine ran. Past `MAX_HELD` blocks are left unkeyed, as routers refuse an
    endpoint holding more (llmgw.core.kvindex); removing some makes room again."""
    monkeypatch.setattr(kvblocks, "MAX_HELD", 1000, raising=False)
    blocks = kvblocks.EngineBlocks()
    for batch in range(5):
        base = batch * 1000
        stored = kvblocks.BlockStored(list(range(base, base + 1000)), None,
                                      list(range(base, base + 1000)), 1)  # fmt: skip
        blocks.apply([stored])
    assert len(blocks.key_of) == len(blocks) == 1000
    assert blocks.unkeyed == 4000
    blocks.apply([kvblocks.BlockRemoved([0, 1])])
    again = kvblocks.BlockStored([7000, 7001, 7002], None, [1, 2, 3], 1)
    stored, _, _ = blocks.apply([again])
    assert len(stored) == 2
    assert len(blocks) == 1000


def test_the_folds_bound_is_what_a_router_keeps_of_an_endpoint() -> None:
    from llmgw.core import kvindex

    assert kvblocks.MAX_HELD == kvindex.MAX_KEYS_PER_ENDPOINT

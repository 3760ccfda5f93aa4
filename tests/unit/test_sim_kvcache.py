"""The simulated engine's KV block pool: exact accounting, LRU eviction, prefix lookup."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core import simtokens as tokens
from llmgw.sim.kvcache import BlockPool


def test_allocate_and_release_account_exactly() -> None:
    pool = BlockPool(8)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert pool.num_used == 8
    assert pool.num_free == 0
    assert pool.usage == 1.0
    pool.release(a)
    assert pool.num_used == 5
    pool.release(b)
    assert pool.num_used == 0
    pool.check()


def test_cached_blocks_are_free_memory_until_reused() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.cache(blocks[0], 111)
    pool.cache(blocks[1], 222)
    pool.release(blocks)
    # vLLM counts unreferenced cached blocks as free: usage is zero, the cache keeps them.
    assert pool.usage == 0.0
    assert set(pool.cached) == {111, 222}
    hit = pool.lookup([111, 222, 333], limit=3)
    assert [b.id for b in hit] == [blocks[0].id, blocks[1].id]
    assert pool.cost(hit, 1) == 3  # both hits leave the free queue, plus one new block
    pool.touch(hit)
    assert pool.num_used == 2
    pool.check()


def test_release_is_tail_first_so_prompt_ends_are_evicted_before_their_beginnings() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.cache(b, 100 + i)
    pool.release(blocks)
    evicted = pool.allocate(1)[0]
    assert evicted.id == blocks[2].id  # the last block of the sequence goes first
    assert set(pool.cached) == {100, 101}
    assert pool.evictions == 1
    pool.check()


def test_lru_keeps_recently_used_blocks() -> None:
    pool = BlockPool(2)
    old, new = pool.allocate(1)[0], pool.allocate(1)[0]
    pool.cache(old, 1)
    pool.cache(new, 2)
    pool.release([old])
    pool.release([new])
    # Touch the older one again: it becomes the most recently freed.
    hit = pool.lookup([1], limit=1)
    pool.touch(hit)
    pool.release(hit)
    pool.allocate(1)
    assert set(pool.cached) == {1}
    pool.check()


def test_lookup_stops_at_first_miss_and_respects_the_limit() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    for b, h in zip(blocks, (1, 2, 3), strict=True):
        pool.cache(b, h)
    assert len(pool.lookup([1, 2, 3], limit=2)) == 2
    assert len(pool.lookup([1, 9, 3], limit=3)) == 1
    assert pool.lookup([9, 2, 3], limit=3) == []


def test_chained_hashes_depend_on_every_earlier_block() -> None:
    bs = 4
    a = [f" w{i}" for i in range(12)]
    b = [" x", *a[1:]]  # only the first token differs
    ha: list[int] = []
    hb: list[int] = []
    tokens.block_hashes(a, bs, 0, ha)
    tokens.block_hashes(b, bs, 0, hb)
    assert len(ha) == len(hb) == 3
    # Blocks 1 and 2 hold identical tokens, yet no hash matches: the prefix differs.
    assert not set(ha) & set(hb)
    # Extending incrementally gives the same chain as hashing at once.
    inc: list[int] = []
    tokens.block_hashes(a[:5], bs, 0, inc)
    tokens.block_hashes(a, bs, len(inc), inc)
    assert inc == ha


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("arcpt"), st.integers(0, 7)), max_size=80))
def test_any_sequence_of_operations_keeps_the_accounting_exact(ops: list[tuple[str, int]]) -> None:
    pool = BlockPool(8)
    held: list[list] = []  # type: ignore[type-arg]
    for op, arg in ops:
        if op == "a" and arg <= pool.num_free:
            held.append(pool.allocate(arg))
        elif op == "r" and held:
            pool.release(held.pop(arg % len(held)))
        elif op == "c" and held and held[arg % len(held)]:
            seq = held[arg % len(held)]
            pool.cache(seq[0], arg)
        elif op == "t":
            hit = pool.lookup([arg], limit=1)
            if hit and pool.cost(hit, 0) <= pool.num_free:
                pool.touch(hit)
                held.append(hit)
        elif op == "p":
            pool.reset_cache()
        pool.check()
        assert pool.num_used == len({b.id for seq in held for b in seq})
    for seq in held:
        pool.release(seq)
    pool.check()
    assert pool.num_used == 0


def test_stored_events_join_a_run_of_one_prompt_and_split_at_another() -> None:
    """As vLLM sends them: a prompt's consecutive blocks are one BlockStored whose parent is
    the block before the run; another prompt's block starts an event of its own, so that a
    reader never chains it under the first prompt."""
    pool = BlockPool(8, record_events=True)
    a, b, c, d = pool.allocate(4)
    pool.cache(a, 10, None, [1] * 4, "salt")
    pool.cache(b, 11, 10, [2] * 4)
    pool.cache(c, 20, None, [3] * 4)
    pool.cache(d, 12, 11, [4] * 4)  # the first prompt's next block, after another's
    assert pool.take_events() == [
        ("stored", [10, 11], None, [1] * 4 + [2] * 4, "salt"),
        ("stored", [20], None, [3] * 4, None),
        ("stored", [12], 11, [4] * 4, None),
    ]
    assert pool.take_events() == []

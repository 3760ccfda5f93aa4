"""The router's approximate prefix index (llmgw.core.prefix)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.prefix import PrefixIndex, block_hashes


def test_hashes_are_chained_over_whole_blocks() -> None:
    a = block_hashes("x" * 40 + "tail", 10, 100)
    b = block_hashes("x" * 40 + "other tail!", 10, 100)
    assert len(a) == 4
    assert a == b[:4]
    # Same block text at a different position hashes differently: the hash covers the prefix.
    assert len(set(a)) == 4
    assert block_hashes("y" + "x" * 39, 10, 100)[1:] != a[1:]
    assert len(block_hashes("z" * 1000, 10, 7)) == 7


def test_match_counts_leading_blocks_per_endpoint() -> None:
    idx = PrefixIndex(capacity=100)
    shared = "s" * 30
    idx.record(block_hashes(shared + "a" * 20, 10, 100), "e1")
    idx.record(block_hashes(shared + "b" * 20, 10, 100), "e2")
    assert idx.match(block_hashes(shared + "a" * 20, 10, 100)) == {"e1": 5, "e2": 3}
    assert idx.match(block_hashes("q" * 50, 10, 100)) == {}


def test_lru_bound_evicts_the_oldest() -> None:
    idx = PrefixIndex(capacity=3)
    old = block_hashes("o" * 30, 10, 100)
    idx.record(old, "e1")
    idx.record(block_hashes("n" * 30, 10, 100), "e2")
    assert len(idx) == 3
    assert idx.match(old) == {}


def test_forget_drops_an_endpoint() -> None:
    idx = PrefixIndex()
    h = block_hashes("p" * 30, 10, 100)
    idx.record(h, "e1")
    idx.record(h, "e2")
    idx.forget("e1")
    assert idx.match(h) == {"e2": 3}


@given(
    prompts=st.lists(st.tuples(st.text(max_size=80), st.sampled_from("abcdef")), max_size=30),
    capacity=st.integers(1, 20),
)
def test_index_stays_bounded_and_matches_are_consistent(
    prompts: list[tuple[str, str]], capacity: int
) -> None:
    idx = PrefixIndex(capacity=capacity)
    for text, endpoint in prompts:
        hashes = block_hashes(text, 8, 16)
        idx.record(hashes, endpoint)
        assert len(idx) <= capacity
        for ep, depth in idx.match(hashes).items():
            assert 1 <= depth <= len(hashes)
            assert ep in "abcdef"

"""The KV index's bounds, exactly (llmgw.core.kvindex): a node's endpoints, an endpoint's
keys and a node's keys are capped at their bound and not one more; an update past a bound
is refused and drops what the endpoint held; keys removed stop counting against the node;
a full index makes no room by dropping what the router's table lists; a node claims as
roots only keys it holds; an endpoint whose full update was refused is trusted again only
after a full one. And what an engine's batch or a node's update says is checked before
it is folded (llmgw.core.kvblocks): token ids, their number, every key, and a repeated
store of a block counted once."""

from __future__ import annotations

import msgspec
import pytest

from llmgw.core import kvblocks, kvindex
from llmgw.core.kvindex import KvIndex

from .test_kvindex import upd


@pytest.fixture
def small(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bounds small enough to reach: 10 keys an endpoint, 15 a node, 4 endpoints."""
    monkeypatch.setattr(kvindex, "MAX_KEYS_PER_ENDPOINT", 10)
    monkeypatch.setattr(kvindex, "MAX_KEYS_PER_NODE", 15)
    monkeypatch.setattr(kvindex, "MAX_ENDPOINTS", 4)


def test_a_node_has_exactly_its_bound_of_endpoints_indexed() -> None:
    index = KvIndex()
    bound = kvindex.MAX_ENDPOINTS_PER_NODE
    refused = [index.apply(upd(f"e{i}", 1, full=True), "n", 0.0) for i in range(bound + 1)]
    assert refused[:bound] == [None] * bound
    assert refused[bound] is not None
    assert f"{bound} endpoints already" in refused[bound]


@pytest.mark.usefixtures("small")
def test_an_endpoint_holds_exactly_its_bound_of_keys_and_a_refusal_drops_them() -> None:
    index = KvIndex()
    assert index.apply(upd("e", 1, full=True, stored=list(range(10))), "n", 0.0) is None
    assert len(index) == 10
    refused = index.apply(upd("e", 2, stored=[10]), "n", 0.0)
    assert refused is not None
    assert "would hold over 10 blocks" in refused
    assert len(index) == 0  # nothing of the endpoint is kept, nor trusted
    assert index.usable("e", "n", 0.0) is None


@pytest.mark.usefixtures("small")
def test_a_node_holds_exactly_its_bound_of_keys_over_its_endpoints() -> None:
    index = KvIndex()
    assert index.apply(upd("a", 1, full=True, stored=list(range(10))), "n", 0.0) is None
    assert index.apply(upd("b", 1, full=True, stored=list(range(100, 105))), "n", 0.0) is None
    refused = index.apply(upd("b", 2, stored=[105]), "n", 0.0)
    assert refused is not None
    assert "node n would hold over 15 blocks" in refused


@pytest.mark.usefixtures("small")
def test_keys_removed_stop_counting_against_the_node() -> None:
    index = KvIndex()
    assert index.apply(upd("a", 1, full=True, stored=list(range(10))), "n", 0.0) is None
    assert index.apply(upd("a", 2, removed=list(range(10))), "n", 0.0) is None
    assert index.apply(upd("a", 3, stored=list(range(20, 30))), "n", 0.0) is None
    assert index.apply(upd("b", 1, full=True, stored=list(range(40, 45))), "n", 0.0) is None
    assert len(index) == 15


@pytest.mark.usefixtures("small")
def test_a_full_index_drops_no_listed_endpoint_to_make_room() -> None:
    index = KvIndex()
    for i in range(4):
        assert index.apply(upd(f"e{i}", 1, full=True, stored=[i]), f"n{i}", 0.0) is None
    refused = index.apply(upd("e9", 1, full=True), "n9", 0.0, listed=lambda _e, _n: True)
    assert refused is not None
    assert "holds 4 endpoints already" in refused
    assert sorted(ep for _, ep in index.endpoints) == ["e0", "e1", "e2", "e3"]


def test_a_node_claims_as_roots_only_keys_it_holds() -> None:
    index = KvIndex()
    update = msgspec.structs.replace(upd("e", 1, full=True, stored=[1, 2]), roots=[1, 99])
    assert index.apply(update, "n", 0.0) is None
    assert index.roots("e", "n", 0.0) == {1}


def test_an_endpoint_whose_full_update_was_refused_is_trusted_only_after_a_full_one() -> None:
    """Its node's endpoints use as many block sizes as they may: the endpoint's full update
    in a fifth is refused, and the updates that follow it are not folded (they would be
    keys of no block size) until a full update in a size the node may use."""
    index = KvIndex()
    for i, size in enumerate((4, 8, 16, 32)):
        assert index.apply(upd(f"s{i}", 1, full=True, size=size), "n", 0.0) is None
    assert index.apply(upd("e", 1, full=True, stored=[1], size=4), "n", 0.0) is None
    assert index.apply(upd("e", 2, full=True, stored=[2], size=64), "n", 0.0) is not None
    assert index.apply(upd("e", 3, stored=[3], size=64), "n", 0.0) is None
    assert index.usable("e", "n", 0.0) is None
    assert len(index) == 0
    assert index.apply(upd("e", 4, full=True, stored=[4], size=4), "n", 0.0) is None
    assert index.usable("e", "n", 0.0) is not None


def stored_event(token_ids: list[int], hashes: list[int], size: int = 4) -> bytes:
    return msgspec.msgpack.encode([1.0, [["BlockStored", hashes, None, token_ids, size]]])


def test_a_stored_blocks_negative_token_id_is_a_bad_batch() -> None:
    # (msgpack holds no integer above 2**64 - 1: a negative one is what a batch can send.)
    with pytest.raises(kvblocks.BadBatch, match="token_ids"):
        kvblocks.decode_batch(stored_event([1, 2, 3, -1], [7]))


def test_a_store_with_fewer_token_ids_than_its_blocks_need_is_a_bad_batch() -> None:
    with pytest.raises(kvblocks.BadBatch, match="7 token ids for 2 blocks of 4"):
        kvblocks.decode_batch(stored_event(list(range(7)), [1, 2]))


def test_an_update_carries_at_most_its_bound_of_keys_roots_included() -> None:
    bound = kvblocks.MAX_KEYS_PER_UPDATE
    update = msgspec.structs.replace(upd("e", 1, stored=[1]), roots=list(range(bound)))
    with pytest.raises(ValueError, match=f"at most {bound} keys"):
        kvblocks.decode_update(kvblocks.encode_update(update))


def test_a_removed_key_outside_64_bits_is_refused() -> None:
    update = upd("e", 1, removed=[-1])
    with pytest.raises(ValueError, match="64-bit"):
        kvblocks.decode_update(kvblocks.encode_update(update))


def test_a_block_stored_twice_is_removed_by_one_removal() -> None:
    """Engine events arrive at least once: a store repeated is one block, which its one
    BlockRemoved takes out of the cache the router believes in."""
    fold = kvblocks.EngineBlocks()
    store = kvblocks.BlockStored([1], None, [1, 2, 3, 4], 4)
    (key,), _, _ = fold.apply([store])
    fold.apply([store])
    _, removed, _ = fold.apply([kvblocks.BlockRemoved([1])])
    assert removed == [key]
    assert len(fold) == 0

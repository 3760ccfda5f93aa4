"""The fleet KV index's keys and the fold of an engine's KV events (llmgw.core.kvblocks).

The property: folding what the sim publishes (through vLLM's wire format, as the agent
reads it) reproduces the sim's prefix cache exactly, under random workloads that evict.
"""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core import kvblocks
from llmgw.core import simtokens as tokens
from llmgw.sim import kvevents
from llmgw.sim.config import KvEventsConfig, SimConfig
from llmgw.sim.engine import Engine, Request

BS = 4


def _engine(num_blocks: int) -> Engine:
    cfg = SimConfig(
        block_size=BS,
        num_blocks=num_blocks,
        max_model_len=num_blocks * BS,
        max_num_seqs=4,
        kv_events_config=KvEventsConfig(enable_kv_cache_events=True, publisher="zmq"),
    )
    return Engine(cfg)


def _fold_published(engine: Engine, fold: kvblocks.EngineBlocks, *, array_form: bool) -> None:
    events = engine.pool.take_events()
    if not events:
        return
    wire = kvevents.wire_events(events, BS)
    if array_form:  # the encoding of vLLM releases with array_like structs, and SGLang's
        order = {"BlockStored": kvblocks._STORED_FIELDS, "BlockRemoved": kvblocks._REMOVED_FIELDS}
        wire = [[e["type"], *(e.get(f) for f in order.get(e["type"], ()))] for e in wire]
        payload = msgspec.msgpack.encode([1.0, wire, 0])
    else:
        payload = kvevents.encode_batch(1.0, wire)
    fold.apply(kvblocks.decode_batch(payload).events)


def _expected_keys(engine: Engine, prompts: dict[int, list[str]]) -> dict[int, int]:
    """Engine hash -> the key a router computes for that block from the prompt's tokens."""
    out: dict[int, int] = {}
    for toks in prompts.values():
        hashes: list[int] = []
        tokens.block_hashes(toks, BS, 0, hashes)
        for h, k in zip(hashes, kvblocks.block_keys(tokens.token_ids(toks), BS), strict=False):
            out[h] = k
    return out


words = st.sampled_from(["a", " b", " cc", ".", " dd", "\n", " e"])


@settings(max_examples=60, deadline=None)
@given(
    num_blocks=st.integers(8, 40),
    prefixes=st.lists(st.lists(words, min_size=0, max_size=24), min_size=1, max_size=4),
    plan=st.lists(
        st.tuples(st.integers(0, 3), st.lists(words, max_size=12), st.integers(1, 9)),
        min_size=1,
        max_size=30,
    ),
    array_form=st.booleans(),
    resets=st.sets(st.integers(0, 29)),
)
def test_folding_the_sims_events_reproduces_its_cache(
    num_blocks: int,
    prefixes: list[list[str]],
    plan: list[tuple[int, list[str], int]],
    array_form: bool,
    resets: set[int],
) -> None:
    engine = _engine(num_blocks)
    fold = kvblocks.EngineBlocks()
    seen: dict[int, list[str]] = {}
    now = 0.0
    for i, (group, question, out_len) in enumerate(plan):
        prompt = tokens.tokenize("".join(prefixes[group % len(prefixes)] + question) or "x")
        if len(prompt) + out_len + 1 > num_blocks * BS // 2:
            continue
        req = Request(f"r{i}", list(prompt), max_tokens=out_len, arrival=now, seed=i)
        engine.add(req)
        while engine.has_work:
            now += engine.step(now) or 0.001
            _fold_published(engine, fold, array_form=array_form)
        seen[i] = req.tokens  # prompt and output: generated blocks are cached too
        if i in resets:
            engine.pool.reset_cache()
            _fold_published(engine, fold, array_form=array_form)
        engine.pool.check()
        # Exactly the blocks the engine can find, each under the key a router computes.
        assert set(fold.key_of) == set(engine.pool.cached)
        expected = _expected_keys(engine, seen)
        assert {h: fold.key_of[h] for h in fold.key_of} == {h: expected[h] for h in fold.key_of}
    assert fold.unkeyed == 0


def test_keys_are_chained_and_equal_only_for_equal_prefixes() -> None:
    a = kvblocks.block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = kvblocks.block_keys([1, 2, 3, 4, 5, 6, 7, 0], 4)
    c = kvblocks.block_keys([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2
    assert a[0] == b[0]
    assert a[1] != b[1]
    # The same second block after another first one: other keys.
    assert c[0] != a[0]
    assert c[1] != a[1]
    assert kvblocks.block_keys([1, 2, 3], 4) == []
    assert kvblocks.block_keys(list(range(40)), 4, limit=3) == kvblocks.block_keys(
        list(range(12)), 4
    )
    # Continuing from a parent key gives the keys of the whole prompt.
    whole = kvblocks.block_keys(list(range(16)), 4)
    assert kvblocks.block_keys(list(range(8, 16)), 4, parent=whole[1]) == whole[2:]


@pytest.mark.parametrize("bad", [[-1, 2, 3, 4], [1 << 64, 0, 0, 0], [1.5, 0, 0, 0]])
def test_bad_token_ids_are_refused_with_a_message(bad: list[object]) -> None:
    with pytest.raises(ValueError, match="token ids"):
        kvblocks.block_keys(bad, 4)  # type: ignore[arg-type]


@given(st.binary(max_size=200))
def test_any_bytes_decode_to_a_batch_or_a_bad_batch(payload: bytes) -> None:
    with contextlib.suppress(kvblocks.BadBatch):
        kvblocks.decode_batch(payload)


@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.floats()
        | st.text(max_size=5),
        lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids),
        max_leaves=20,
    )
)
def test_any_msgpack_value_decodes_or_is_refused(value: object) -> None:
    for shaped in (value, [1.0, [value]], {"ts": 1.0, "events": [value]}):
        try:
            batch = kvblocks.decode_batch(msgspec.msgpack.encode(shaped))
        except kvblocks.BadBatch:
            continue
        kvblocks.EngineBlocks().apply(batch.events)  # whatever decoded folds without error


def test_a_stored_event_whose_parent_was_never_seen_is_counted_not_guessed() -> None:
    fold = kvblocks.EngineBlocks()
    stored, removed, cleared = fold.apply([kvblocks.BlockStored([7], 99, [1, 2, 3, 4], 4)])
    assert (stored, removed, cleared) == ([], [], False)
    assert fold.unkeyed == 1
    assert len(fold) == 0


def test_all_blocks_cleared_empties_the_fold_and_says_so() -> None:
    fold = kvblocks.EngineBlocks()
    fold.apply([kvblocks.BlockStored([1, 2], None, list(range(8)), 4)])
    assert len(fold) == 2
    stored, removed, cleared = fold.apply(
        [kvblocks.AllBlocksCleared(), kvblocks.BlockStored([3], None, [9, 9, 9, 9], 4)]
    )
    assert cleared
    assert removed == []
    assert stored == kvblocks.block_keys([9, 9, 9, 9], 4)
    assert len(fold) == 1


def test_updates_round_trip_and_bad_ones_are_refused() -> None:
    u = kvblocks.KvUpdate(endpoint="r1", model="m", block_size=16, instance="i", seq=1,
                          stored=[1, 2], removed=[3])  # fmt: skip
    assert kvblocks.decode_update(kvblocks.encode_update(u)) == u
    base = {"endpoint": "r", "model": "m", "instance": "i", "seq": 1}
    for bad, why in (
        ({**base, "block_size": 0}, "block_size"),
        ({**base, "block_size": 4, "stored": [-1]}, "64-bit"),
        ({**base, "block_size": 4, "seq": 0}, "seq"),
    ):
        with pytest.raises(ValueError, match=why):
            kvblocks.decode_update(msgspec.msgpack.encode(bad))
    with pytest.raises(ValueError, match="not a KV update"):
        kvblocks.decode_update(b"\xc1")


def test_blocks_of_a_lora_adapter_are_not_folded() -> None:
    # The same tokens under an adapter are other KV: a base-model request gains nothing.
    raw = [
        ["BlockStored", [1], None, [1, 2, 3, 4], 4, None, "GPU", "my-adapter"],
        ["BlockStored", [2], None, [1, 2, 3, 4], 4, 7, "GPU"],  # the older lora_id
        ["BlockStored", [3], None, [5, 6, 7, 8], 4, None, "GPU", None],
    ]
    batch = kvblocks.decode_batch(msgspec.msgpack.encode([1.0, raw]))
    fold = kvblocks.EngineBlocks()
    stored, _, _ = fold.apply(batch.events)
    assert stored == kvblocks.block_keys([5, 6, 7, 8], 4)
    assert set(fold.key_of) == {3}

"""What one node can make every router hold and compute with its KV updates: the names an
update carries are bounded as the log's are, a refused update never reaches the index, and
the block sizes a node announces cannot multiply the hashing a router does per request."""

from __future__ import annotations

import random
from collections import Counter

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.bus import kvlog
from llmgw.core import kvblocks, routing, simtokens, subjects
from llmgw.core.kvindex import (
    MAX_BLOCK_SIZES_PER_NODE,
    MAX_PROMPT_BLOCK_SIZES,
    EndpointBlocks,
    KvIndex,
    keyed_sizes,
)
from llmgw.core.limits import MAX_NAME
from llmgw.core.prefix import PrefixIndex
from llmgw.core.profile import ModelProfile
from llmgw.pki.identity import Identity
from llmgw.router.config import LogSource
from llmgw.router.kvfeed import KvFeed
from llmgw.router.kvroute import DEFAULT_BLOCK_SIZE, KvRouting, Source
from llmgw.router.requests import Parsed
from tests.unit.test_reader_intake import feed, signed_as
from tests.unit.test_signing import VERIFIER, _NoClient

NAMED = ("endpoint", "model", "instance")


def update_with(field: str, value: str, **more: object) -> bytes:
    """A KV update's msgpack with `field` set to `value` (encoded as a map, as an agent
    sends it, without the Struct's own checks)."""
    base: dict[str, object] = {"endpoint": "e1", "model": "m", "block_size": 16,
                               "instance": "i", "seq": 1, **more}  # fmt: skip
    return msgspec.msgpack.encode({**base, field: value})


lengths = st.integers(0, 3 * MAX_NAME).map(lambda n: "é" * n)  # characters, not bytes


@settings(max_examples=200)
@given(field=st.sampled_from(NAMED), name=st.text(max_size=2 * MAX_NAME) | lengths)
def test_an_updates_names_are_accepted_exactly_within_the_bound(field: str, name: str) -> None:
    payload = update_with(field, name)
    if len(name) <= MAX_NAME:
        assert getattr(kvblocks.decode_update(payload), field) == name
    else:
        with pytest.raises(ValueError, match=rf"length <= {MAX_NAME} - at `\$\.{field}`"):
            kvblocks.decode_update(payload)


def test_a_refused_update_leaves_the_routers_index_unchanged() -> None:
    keys = kvblocks.block_keys(list(range(64)), 16)
    good = kvblocks.KvUpdate(endpoint="e1", model="m", block_size=16, instance="i", seq=1,
                             full=True, stored=keys)  # fmt: skip
    long_name = "m" * (MAX_NAME + 1)
    node_a = Identity("node", "a")
    e1, e2 = subjects.kv_updates("a", "e1"), subjects.kv_updates("a", "e2")
    reader = kvlog.KvReader(_NoClient(), verifier=VERIFIER)  # type: ignore[arg-type]
    feed(reader, [
        signed_as(node_a, e1, kvblocks.encode_update(good)),
        # Each would change the index were it folded: e1 emptied, e2 added.
        signed_as(node_a, e1, update_with("model", long_name, full=True, seq=2)),
        signed_as(node_a, e2, update_with("instance", long_name, endpoint="e2", full=True)),
    ])  # fmt: skip
    router = KvFeed(LogSource(servers=("nats://127.0.0.1:1",), name="r1"), KvIndex())
    router.apply(reader._buf)
    assert list(router.index.endpoints) == [("a", "e1")]
    assert router.index.endpoints[("a", "e1")].keys == set(keys)
    assert router.index.endpoints[("a", "e1")].model == "m"
    assert router.index.holders.keys() == set(keys)
    # Counted and logged as every undecodable KV update is, with why.
    assert reader.undecodable == 2
    assert [s.seq for s in reader.skipped] == [2, 3]
    assert "$.model" in reader.skipped[0].error
    assert "$.instance" in reader.skipped[1].error


# ------------------------------------------------------------------ block sizes


@settings(max_examples=200)
@given(size=st.integers(-(2**63), 2**64 - 1) | st.integers(-2, kvblocks.MAX_BLOCK_SIZE + 2))
def test_an_updates_block_size_is_accepted_exactly_within_the_range(size: int) -> None:
    payload = msgspec.msgpack.encode({"endpoint": "e1", "model": "m", "block_size": size,
                                      "instance": "i", "seq": 1})  # fmt: skip
    if 1 <= size <= kvblocks.MAX_BLOCK_SIZE:
        assert kvblocks.decode_update(payload).block_size == size
    else:
        with pytest.raises(ValueError, match=r"block_size"):
            kvblocks.decode_update(payload)


@pytest.mark.parametrize("size", [0, kvblocks.MAX_BLOCK_SIZE + 1, 2**40])
def test_an_engines_store_of_an_implausible_block_size_is_a_bad_batch(size: int) -> None:
    # The agent relays no update routers would refuse: the batch is refused, with why.
    batch = msgspec.msgpack.encode([0.0, [["BlockStored", [1], None, [1] * 4, size]]])
    with pytest.raises(kvblocks.BadBatch, match=rf"block_size {size} is outside"):
        kvblocks.decode_batch(batch)


def full(endpoint: str, size: int, stored: list[int], seq: int = 1) -> kvblocks.KvUpdate:
    return kvblocks.KvUpdate(endpoint=endpoint, model="m", block_size=size, instance="i",
                             seq=seq, full=True, stored=stored, roots=stored[:1])  # fmt: skip


def test_a_node_announcing_more_block_sizes_than_it_may_is_refused_by_name() -> None:
    index = KvIndex()
    sizes = [16, 32, 64, 128, 256]
    verdicts = [index.apply(full(f"e{i}", s, []), "evil", 0.0) for i, s in enumerate(sizes)]
    assert verdicts[:MAX_BLOCK_SIZES_PER_NODE] == [None] * MAX_BLOCK_SIZES_PER_NODE
    refused = verdicts[MAX_BLOCK_SIZES_PER_NODE]
    assert refused is not None
    assert "node evil" in refused
    assert "256" in refused
    assert not index.endpoints[("evil", "e4")].synced
    # Its endpoints may change size within the bound, and other nodes are not concerned.
    assert index.apply(full("e0", 256, [], seq=2), "evil", 0.0) is None
    assert index.apply(full("e4", 32, [], seq=2), "evil", 0.0) is None
    assert index.apply(full("e9", 1, []), "honest", 0.0) is None
    # Forgetting the one endpoint of a size frees it for the node's others.
    index.forget("e2")
    assert index.apply(full("e5", 8, []), "evil", 0.0) is None


@settings(max_examples=300)
@given(
    fleet=st.lists(st.tuples(st.sampled_from("abcdef"), st.sampled_from([1, 2, 3, 8, 16, 528])),
                   max_size=30),
    order=st.randoms(use_true_random=False),
)  # fmt: skip
def test_the_sizes_keyed_are_few_and_no_nodes_sizes_crowd_out_anothers(
    fleet: list[tuple[str, int]], order: random.Random
) -> None:
    by_size: dict[int, list[EndpointBlocks]] = {}
    for i, (node, size) in enumerate(fleet):
        by_size.setdefault(size, []).append(EndpointBlocks(f"e{i}", node, i))
    chosen = keyed_sizes(by_size)
    assert len(set(chosen)) == len(chosen) <= MAX_PROMPT_BLOCK_SIZES
    assert set(chosen) <= by_size.keys()
    # The same whatever order the candidates come in.
    shuffled = list(by_size.items())
    order.shuffle(shuffled)
    assert keyed_sizes({size: order.sample(eps, len(eps)) for size, eps in shuffled}) == chosen
    # Each node's most used size (the smaller on a tie) is keyed whenever they fit.
    firsts = set()
    for node in {node for node, _ in fleet}:
        used = Counter(size for n, size in fleet if n == node)
        firsts.add(min(used, key=lambda s: (-used[s], s)))
    if len(firsts) <= MAX_PROMPT_BLOCK_SIZES:
        assert firsts <= set(chosen)
    if len(by_size) <= MAX_PROMPT_BLOCK_SIZES:
        assert set(chosen) == by_size.keys()


PROFILE = ModelProfile(name="m", engine="sim")
MESSAGES = (("system", "You are a careful assistant. " * 100), ("user", "Two and two?"))


def endpoint(name: str, node: str) -> routing.EndpointState:
    return routing.EndpointState(id=name, url="u", models=frozenset({"m"}), ready=True, node=node)


def prompt_ids() -> list[int]:
    return simtokens.token_ids(simtokens.tokenize(simtokens.render_chat(MESSAGES)))


@settings(max_examples=60, deadline=None)
@given(
    cycle=st.lists(
        st.tuples(st.integers(0, 7), st.integers(1, kvblocks.MAX_BLOCK_SIZE)),
        min_size=1,
        max_size=40,
    )
)
def test_a_node_cycling_block_sizes_cannot_multiply_a_requests_hashing(
    cycle: list[tuple[int, int]],
) -> None:
    kv = KvRouting()
    ids = prompt_ids()
    honest = {"a": ("n1", 16, 6), "b": ("n2", 16, 3), "c": ("n3", 1, 40)}
    for name, (node, size, blocks) in honest.items():
        kv.index.apply(full(name, size, kvblocks.block_keys(ids, size)[:blocks]), node, 0.0)
    # The hostile node runs eight replicas of the model, which announce whatever sizes.
    eps = [endpoint(name, node) for name, (node, _, _) in honest.items()]
    eps += [endpoint(f"x{i}", "evil") for i in range(8)]
    parsed = Parsed(model="m", stream=False, wants_usage=False, has_options=False,
                    text=simtokens.render_chat(MESSAGES), chat=MESSAGES)  # fmt: skip
    for i, size in cycle:
        kv.index.apply(full(f"x{i}", size, kvblocks.block_keys(ids, size)), "evil", 1.0)
        plan = kv.plan(parsed, PROFILE, eps, now=1.0)
        assert plan is not None
        # Each entry of `plan.keys` is one pass of hashing over the prompt.
        assert len(plan.keys.keys() - {DEFAULT_BLOCK_SIZE}) <= MAX_PROMPT_BLOCK_SIZES
        for name, (_, size, blocks) in honest.items():
            assert plan.by_endpoint[name] == Source(blocks * size, "events")


def test_engines_of_a_few_kinds_are_all_matched_by_prefix() -> None:
    kv = KvRouting()
    ids = prompt_ids()
    fleet = {"a": ("n1", 16, 5), "b": ("n1", 1, 33), "c": ("n2", 528, 1), "d": ("n3", 16, 2)}
    for name, (node, size, blocks) in fleet.items():
        assert kv.index.apply(full(name, size, kvblocks.block_keys(ids, size)[:blocks]),
                              node, 0.0) is None  # fmt: skip
    parsed = Parsed(model="m", stream=False, wants_usage=False, has_options=False,
                    text=simtokens.render_chat(MESSAGES), chat=MESSAGES)  # fmt: skip
    eps = [endpoint(name, node) for name, (node, _, _) in fleet.items()]
    plan = kv.plan(parsed, PROFILE, eps, now=1.0)
    assert plan is not None
    assert set(plan.keys) == {16, 1, 528}
    assert plan.cached == {name: blocks * size for name, (_, size, blocks) in fleet.items()}


def _planned(kv: KvRouting, eps: list[routing.EndpointState], **kw: object) -> dict[str, Source]:
    parsed = Parsed(model="m", stream=False, wants_usage=False, has_options=False,
                    text=simtokens.render_chat(MESSAGES), chat=MESSAGES)  # fmt: skip
    plan = kv.plan(parsed, PROFILE, eps, now=1.0, **kw)  # type: ignore[arg-type]
    assert plan is not None
    return plan.by_endpoint


def test_a_shorter_recent_route_does_not_lower_what_the_engines_events_say() -> None:
    kv = KvRouting()
    ids = prompt_ids()
    kv.index.apply(full("a", 16, kvblocks.block_keys(ids, 16)[:6]), "n1", 0.0)
    kv.recent.record(kvblocks.block_keys(ids, DEFAULT_BLOCK_SIZE)[:2], "a", 1.0)
    assert _planned(kv, [endpoint("a", "n1")])["a"] == Source(96, "events")


def test_an_engine_that_finds_less_than_predicted_gets_less_credit_and_never_more() -> None:
    kv = KvRouting()
    ids = prompt_ids()
    kv.index.apply(full("a", 16, kvblocks.block_keys(ids, 16)[:5]), "n1", 0.0)
    eps = [endpoint("a", "n1")]
    kv.delivered("a", 80, 10_000)  # an engine reporting more than was predicted
    assert kv.reliability["a"] <= 1.0
    assert _planned(kv, eps)["a"].cached_tokens == 80
    kv.delivered("a", 80, 0)  # its cache thrashed: nothing predicted was there
    assert _planned(kv, eps)["a"].cached_tokens == 72  # 80 * 0.9
    kv.delivered("a", 0, 5)  # nothing predicted: no information, and no crash
    assert kv.reliability["a"] == pytest.approx(0.9)
    kv.forget("a")  # a new engine under the id starts with full credit
    assert "a" not in kv.reliability


def test_a_text_match_never_predicts_more_than_the_whole_prompt() -> None:
    text = PrefixIndex()
    hashes = [bytes([i]) * 8 for i in range(60)]  # turn-sized blocks: more than the text holds
    text.record(hashes, "a")
    got = _planned(KvRouting(), [endpoint("a", "n1")], text_index=text, text_hashes=hashes)
    assert got["a"].source == "approximate"
    assert got["a"].cached_tokens == len(prompt_ids())


def test_a_request_just_routed_is_predicted_cached_where_it_went() -> None:
    """Before the engine's events arrive, the next request of the same prompt is credited
    to the endpoint the first went to (this router's recent routes)."""
    kv = KvRouting()
    eps = [endpoint("a", "n1"), endpoint("b", "n2")]
    parsed = Parsed(model="m", stream=False, wants_usage=False, has_options=False,
                    text=simtokens.render_chat(MESSAGES), chat=MESSAGES)  # fmt: skip
    plan = kv.plan(parsed, PROFILE, eps, now=1.0)
    assert plan is not None
    assert plan.cached == {"a": 0, "b": 0}
    kv.routed(plan, eps[1], 1.0)
    got = _planned(kv, eps)
    assert got["b"].source == "recent"
    assert got["b"].cached_tokens >= len(prompt_ids()) // DEFAULT_BLOCK_SIZE * DEFAULT_BLOCK_SIZE
    assert got["a"].cached_tokens == 0


def test_the_engines_events_outrank_a_text_guess() -> None:
    kv = KvRouting()
    ids = prompt_ids()
    kv.index.apply(full("a", 16, kvblocks.block_keys(ids, 16)[:2]), "n1", 0.0)
    text = PrefixIndex()
    hashes = [bytes([i]) * 8 for i in range(60)]
    text.record(hashes, "a")
    got = _planned(kv, [endpoint("a", "n1")], text_index=text, text_hashes=hashes)
    assert got["a"] == Source(32, "events")

"""What nodes say of endpoints the router's table does not have on them is dropped
(llmgw.core.kvindex `KvIndex.sweep`, run by llmgw.router.kvfeed)."""

from __future__ import annotations

from typing import Any

import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core import kvblocks, kvindex
from llmgw.core.kvindex import UNLISTED_GRACE_S, KvIndex
from llmgw.router.config import LogSource
from llmgw.router.kvfeed import SWEEP_EVERY_S, KvFeed
from llmgw.router.table import EndpointTable
from tests.unit.test_kvindex import upd

GRACE = UNLISTED_GRACE_S


def wired() -> tuple[KvIndex, EndpointTable]:
    """An index and a table as a router wires them: an endpoint leaving the table is
    forgotten at once."""
    index, table = KvIndex(), EndpointTable()
    table.on_remove.append(index.forget)
    return index, table


def test_a_nodes_made_up_endpoint_is_dropped_after_the_grace_and_a_late_listed_one_kept() -> None:
    index, table = wired()
    keys = kvblocks.block_keys(list(range(12)), 4)
    # n1's engine "real" reports before the router folds its EndpointUp; n1 also makes up
    # "fake", and n2 speaks of n1's "real".
    index.apply(upd("real", 1, full=True, stored=keys[:2]), "n1", 0.0)
    index.apply(upd("fake", 1, full=True, stored=keys), "n1", 0.0)
    index.apply(upd("real", 1, full=True, stored=keys), "n2", 0.0)
    assert index.sweep(table.has, GRACE) == ([], True)  # all within the grace
    table.add("real", "http://e", ["m"], node="n1")  # its EndpointUp, within the grace
    index.apply(upd("real", 2, stored=keys[2:]), "n1", GRACE)
    dropped, complete = index.sweep(table.has, GRACE + 1)
    assert complete
    assert sorted(dropped) == [("n1", "fake", 3), ("n2", "real", 3)]
    assert set(index.endpoints) == {("n1", "real")}
    assert index.unlisted_dropped == 2
    assert index.match(lambda _s: keys, [("real", "n1")], GRACE + 1)[0] == {"real": 3}
    assert set(index.holders) == set(keys)  # n1's own, no more
    # An endpoint that leaves the table goes at once, as it always did.
    table.remove("real")
    assert not index.endpoints
    assert not index.holders


def test_a_sweep_is_bounded_and_the_feed_goes_on_at_its_next_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kvindex, "SWEEP_KEYS", 3)
    index, table = wired()
    feed = KvFeed(LogSource(servers=("nats://127.0.0.1:1",), name="r1"), index,
                  listed=table.has)  # fmt: skip
    for e in range(3):
        index.apply(upd(f"fake{e}", 1, full=True, stored=[10 * e, 10 * e + 1]), "n9", 0.0)
    with structlog.testing.capture_logs() as logged:
        feed.apply([], now=GRACE + 1)  # 2 keys, the next 2 would pass the bound of 3
        assert len(index.endpoints) == 2
        feed.apply([], now=GRACE + 1.1)  # cut short: not put off for SWEEP_EVERY_S
        assert len(index.endpoints) == 1
        feed.apply([], now=GRACE + 1.2)
        assert not index.endpoints
        assert not index.holders
        feed.apply([], now=GRACE + 1.3)  # nothing was left: the next pass waits
    dropped = [e for e in logged if e["event"] == "kv_unlisted_dropped"]
    assert [(e["node"], e["endpoints"], e["blocks"]) for e in dropped] == [("n9", 1, 2)] * 3
    assert index.unlisted_dropped == 3
    # A feed with no table sweeps nothing.
    index.apply(upd("fake", 1, full=True, stored=[1]), "n9", 0.0)
    KvFeed(feed.source, index).apply([], now=GRACE + 2 * SWEEP_EVERY_S)
    assert list(index.endpoints) == [("n9", "fake")]


def assert_consistent(index: KvIndex) -> None:
    """The invariants KvIndex keeps: its per-node counters are what its endpoints hold,
    its key masks are its endpoints' keys, and every endpoint has a bit of its own."""
    per_node: dict[str, int] = {}
    node_keys: dict[str, int] = {}
    node_sizes: dict[str, dict[int, int]] = {}
    holders: dict[int, int] = {}
    for (node, endpoint), ep in index.endpoints.items():
        assert (ep.node, ep.endpoint) == (node, endpoint)
        assert ep.roots <= ep.keys
        per_node[node] = per_node.get(node, 0) + 1
        node_keys[node] = node_keys.get(node, 0) + len(ep.keys)
        if ep.block_size:
            sizes = node_sizes.setdefault(node, {})
            sizes[ep.block_size] = sizes.get(ep.block_size, 0) + 1
        for k in ep.keys:
            holders[k] = holders.get(k, 0) | 1 << ep.bit
    assert index._per_node == per_node
    assert index._node_keys == node_keys
    assert {n: s for n, s in index._node_sizes.items() if s} == node_sizes
    assert all(len(s) <= kvindex.MAX_BLOCK_SIZES_PER_NODE for s in node_sizes.values())
    assert index.holders == holders
    bits = [ep.bit for ep in index.endpoints.values()]
    assert len(set(bits)) == len(bits)
    assert not set(bits) & set(index._free_bits)


NODES = ("n1", "n2", "n3")
ITS_OWN = ""
"""An update's node: the one the table has its endpoint on (n1 if none)."""
ENDPOINTS = ("a", "b", "c", "x", "y")  # x and y are never listed
times = st.floats(0, 5 * GRACE, allow_nan=False)
an_update = st.tuples(
    st.just("update"),
    st.sampled_from((ITS_OWN, *NODES)),
    st.sampled_from(ENDPOINTS),
    times,
    st.booleans(),  # full
    st.lists(st.integers(0, 40), max_size=8),
    st.lists(st.integers(0, 40), max_size=4),
    st.integers(0, 2),  # 0: the next seq, 1: one skipped, 2: another instance
    st.integers(1, 6),  # block size: more than a node may use at once
)
an_up = st.tuples(st.just("up"), st.sampled_from(NODES), st.sampled_from(ENDPOINTS[:3]))
a_down = st.tuples(st.just("down"), st.sampled_from(ENDPOINTS[:3]))
a_pass = st.tuples(st.just("sweep"), times, st.integers(0, 20))


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.sampled_from(ENDPOINTS[:3]), st.sampled_from(NODES)),
    st.lists(st.one_of(an_update, an_update, an_update, an_up, a_down, a_pass), max_size=60),
    st.one_of(times, st.floats(GRACE, 10 * GRACE)),
)
def test_after_a_sweep_nothing_unlisted_is_held_past_the_grace(
    listed: dict[str, str], steps: list[tuple[Any, ...]], at: float
) -> None:
    index, table = wired()
    for endpoint, node in listed.items():
        table.add(endpoint, "http://e", ["m"], node=node)
    since: dict[tuple[str, str], float] = {}  # when the index last began holding it
    seqs: dict[tuple[str, str], tuple[str, int]] = {}
    for step in steps:
        if step[0] == "update":
            _, node, ep, now, full, stored, removed, mode, size = step
            if node == ITS_OWN:
                node = table.by_id[ep].node if ep in table.by_id else NODES[0]
            inst, seq = seqs.get((node, ep), ("", 0))
            inst, seq = (inst + "x", 1) if mode == 2 else (inst, seq + 1 + int(mode == 1))
            seqs[(node, ep)] = (inst, seq)
            if (node, ep) not in index.endpoints:
                since[(node, ep)] = now
            u = upd(ep, seq, full=full, stored=stored, removed=removed, instance=inst, size=size)
            index.apply(u, node, now)
        elif step[0] == "up":
            table.add(step[2], "http://e", ["m"], node=step[1])
        elif step[0] == "down":
            table.remove(step[1])
        else:
            held = {key: len(ep.keys) for key, ep in index.endpoints.items()}
            dropped, _ = index.sweep(table.has, step[1], max_keys=step[2])
            for node, ep, blocks in dropped:
                assert not table.has(ep, node)
                assert step[1] - since[(node, ep)] > GRACE
                assert held[(node, ep)] == blocks
        assert_consistent(index)
    before = dict(index.endpoints)
    while not index.sweep(table.has, at, max_keys=3)[1]:
        pass
    assert_consistent(index)
    # Listed ones and those within their grace stay; nothing else does.
    kept = {key for key in before if table.has(key[1], key[0]) or at - since[key] <= GRACE}
    assert set(index.endpoints) == kept
    assert all(index.endpoints[key] is before[key] for key in kept)

"""What nodes say of endpoints the router's table does not have on them is dropped
(llmgw.core.kvindex `KvIndex.sweep`, run by llmgw.router.kvfeed)."""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.bus.intake import Record
from llmgw.core import kvblocks, kvindex, subjects
from llmgw.core.kvindex import UNLISTED_GRACE_S, KvIndex
from llmgw.router.config import LogSource
from llmgw.router.kvfeed import SWEEP_EVERY_S, KvFeed
from llmgw.router.table import EndpointTable
from tests.unit.test_kvindex import depths, upd

GRACE = UNLISTED_GRACE_S
CAP = kvindex.MAX_UNLISTED_PER_NODE
SOURCE = LogSource(servers=("nats://127.0.0.1:1",), name="r1")


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
    feed = KvFeed(SOURCE, index, listed=table.has)
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


def published(node: str, updates: list[kvblocks.KvUpdate]) -> list[Record]:
    """The records a router's KV feed reads for `node`'s updates."""
    return [Record(seq=i + 1, subject=subjects.kv_updates(node, u.endpoint), time=0.0, event=u)  # type: ignore[arg-type]
            for i, u in enumerate(updates)]  # fmt: skip


def unlisted_on(index: KvIndex, table: EndpointTable, node: str) -> list[str]:
    return [e for n, e in index.endpoints if n == node and not table.has(e, node)]


def test_a_node_publishing_for_300_made_up_endpoints_holds_at_most_the_cap_of_them() -> None:
    # Dropped after the grace, a made-up endpoint was back with the node's next full update:
    # n1 held 256 of them nearly all the time, which also left no room for its real ones.
    index, table = wired()
    feed = KvFeed(SOURCE, index, listed=table.has)
    table.add("r0", "http://e", ["m"], node="n1")
    table.add("r1", "http://e", ["m"], node="n1")
    table.add("o0", "http://e", ["m"], node="n2")
    keys = kvblocks.block_keys(list(range(12)), 4)
    rounds = int(4 * GRACE / SWEEP_EVERY_S)
    held = []
    with structlog.testing.capture_logs() as logged:
        for n in range(rounds):
            made_up = [upd(f"fake{i}", n + 1, full=True, stored=[-i - 1]) for i in range(300)]
            real = [upd(e, n + 1, full=True, stored=keys) for e in ("r0", "r1")]
            other = [upd("o0", n + 1, full=True, stored=keys)]
            feed.apply(published("n1", made_up + real) + published("n2", other),
                       now=n * SWEEP_EVERY_S)  # fmt: skip
            held.append(len(unlisted_on(index, table, "n1")))
            assert depths(index, keys, [("r0", "n1"), ("r1", "n1"), ("o0", "n2")],
                          n * SWEEP_EVERY_S) == {"r0": 3, "r1": 3, "o0": 3}  # fmt: skip
    assert max(held) == CAP  # dropped after the grace, then as many again, never more
    assert index.refused >= rounds * (300 - CAP)
    refusals = [e for e in logged if e["event"] == "kv_update_refused"]
    # Logged with the node's name, once per full-update interval at most.
    assert 0 < len(refusals) <= rounds
    assert all(e["node"] == "n1" and "node n1 " in e["reason"] for e in refusals)
    assert sum(1 + e["not_logged"] for e in refusals) <= index.refused


def test_hostile_nodes_cannot_keep_an_honest_nodes_new_endpoint_out_of_the_index() -> None:
    # Sixteen nodes of 256 made-up endpoints each filled the index's 4096: every other
    # node's new endpoints were refused.
    index, table = wired()
    feed = KvFeed(SOURCE, index, listed=table.has)
    for h in range(20):
        made_up = [upd(f"h{h}x{i}", 1, full=True, stored=[h]) for i in range(300)]
        feed.apply(published(f"h{h}", made_up), now=0.0)
    keys = kvblocks.block_keys(list(range(12)), 4)
    # The honest engine's first update comes before its EndpointUp, its next one after.
    feed.apply(published("honest", [upd("new", 1, full=True, stored=keys)]), now=1.0)
    assert ("honest", "new") in index.endpoints
    table.add("new", "http://e", ["m"], node="honest")
    feed.apply(published("honest", [upd("new", 2, stored=keys)]), now=2.0)
    assert depths(index, keys, [("new", "honest")], 2.0) == {"new": 3}
    assert all(len(unlisted_on(index, table, f"h{h}")) <= CAP for h in range(20))


def test_unlisted_endpoints_cannot_crowd_listed_ones_out_of_a_full_index(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kvindex, "MAX_ENDPOINTS", 2 * CAP)
    index, table = wired()
    feed = KvFeed(SOURCE, index, listed=table.has)
    for h in range(3):
        made_up = [upd(f"h{h}x{i}", 1, full=True, stored=[h]) for i in range(CAP)]
        feed.apply(published(f"h{h}", made_up), now=0.0)
    assert len(index.endpoints) == 2 * CAP
    keys = kvblocks.block_keys(list(range(12)), 4)
    # Before its EndpointUp the honest engine is one more unlisted endpoint: no room.
    feed.apply(published("honest", [upd("new", 1, full=True, stored=keys)]), now=1.0)
    assert ("honest", "new") not in index.endpoints
    # Listed, it takes the place of one that is not.
    table.add("new", "http://e", ["m"], node="honest")
    feed.apply(published("honest", [upd("new", 2, full=True, stored=keys)]), now=2.0)
    assert depths(index, keys, [("new", "honest")], 2.0) == {"new": 3}
    assert len(index.endpoints) == 2 * CAP
    assert index.unlisted_dropped == 1


def assert_consistent(index: KvIndex) -> None:
    """The invariants KvIndex keeps: its per-node counters are what its endpoints hold,
    its key masks are its endpoints' keys, and every endpoint has a bit of its own."""
    per_node: dict[str, set[str]] = {}
    node_keys: dict[str, int] = {}
    node_sizes: dict[str, dict[int, int]] = {}
    holders: dict[int, int] = {}
    for (node, endpoint), ep in index.endpoints.items():
        assert (ep.node, ep.endpoint) == (node, endpoint)
        assert ep.roots <= ep.keys
        per_node.setdefault(node, set()).add(endpoint)
        node_keys[node] = node_keys.get(node, 0) + len(ep.keys)
        if ep.block_size:
            sizes = node_sizes.setdefault(node, {})
            sizes[ep.block_size] = sizes.get(ep.block_size, 0) + 1
        for k in ep.keys:
            holders[k] = holders.get(k, 0) | 1 << ep.bit
    assert index._node_endpoints == per_node
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


def assert_within_bounds(index: KvIndex, table: EndpointTable, cap: int, most: int) -> None:
    """No node has more than `cap` endpoints indexed that the table does not list on it,
    and the index holds `most` endpoints at most."""
    assert len(index.endpoints) <= most
    for node in {n for n, _ in index.endpoints}:
        assert len(unlisted_on(index, table, node)) <= cap


def assert_refused_rightly(index: KvIndex, table: EndpointTable, node: str, ep: str,
                           refused: str, cap: int) -> None:  # fmt: skip
    """A new endpoint is refused for its node's unlisted ones only when it is unlisted and
    they are `cap`, and for a full index only when none it holds could make room for it."""
    if "endpoints not in the" in refused:
        assert not table.has(ep, node)
        assert len(unlisted_on(index, table, node)) == cap
    elif "the index holds" in refused and table.has(ep, node):
        assert not any(not table.has(e, n) for n, e in index.endpoints)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.sampled_from(ENDPOINTS[:3]), st.sampled_from(NODES)),
    st.lists(st.one_of(an_update, an_update, an_update, an_up, a_down, a_pass), max_size=60),
    st.one_of(times, st.floats(GRACE, 10 * GRACE)),
    st.integers(1, 2),  # unlisted endpoints a node may have indexed
    st.integers(2, 16),  # endpoints the index holds: fewer than 5 endpoints of 3 nodes
)
def test_after_a_sweep_nothing_unlisted_is_held_past_the_grace(
    listed: dict[str, str], steps: list[tuple[Any, ...]], at: float, cap: int, most: int
) -> None:
    """Also: after every step each node has `cap` unlisted endpoints indexed at most, and an
    endpoint the table lists is kept out of a full index only by listed ones."""
    with (
        mock.patch.object(kvindex, "MAX_UNLISTED_PER_NODE", cap),
        mock.patch.object(kvindex, "MAX_ENDPOINTS", most),
    ):
        check_sweeps_and_bounds(listed, steps, at, cap, most)


def check_sweeps_and_bounds(
    listed: dict[str, str], steps: list[tuple[Any, ...]], at: float, cap: int, most: int
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
            refused = index.apply(u, node, now, table.has)
            if refused is not None and (node, ep) not in index.endpoints:
                assert_refused_rightly(index, table, node, ep, refused, cap)
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
        assert_within_bounds(index, table, cap, most)
    before = dict(index.endpoints)
    while not index.sweep(table.has, at, max_keys=3)[1]:
        pass
    assert_consistent(index)
    # Listed ones and those within their grace stay; nothing else does.
    kept = {key for key in before if table.has(key[1], key[0]) or at - since[key] <= GRACE}
    assert set(index.endpoints) == kept
    assert all(index.endpoints[key] is before[key] for key in kept)

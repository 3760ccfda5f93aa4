"""The fleet KV index (llmgw.core.kvindex) and cost ranking (llmgw.core.routing.CostModel)."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core import kvblocks, routing
from llmgw.core.kvindex import KvIndex, RecentRoutes


def upd(
    endpoint: str,
    seq: int,
    *,
    full: bool = False,
    stored: list[int] | None = None,
    removed: list[int] | None = None,
    instance: str = "i1",
    size: int = 4,
) -> kvblocks.KvUpdate:
    return kvblocks.KvUpdate(
        endpoint=endpoint, model="m", block_size=size, instance=instance, seq=seq, full=full,
        stored=stored or [], removed=removed or [],
    )  # fmt: skip


def depths(index: KvIndex, keys: list[int], cands: list[tuple[str, str]], now: float = 0.0):
    return index.match(lambda _size: keys, cands, now)[0]


def test_a_prompt_matches_the_leading_blocks_each_endpoint_holds() -> None:
    index = KvIndex()
    keys = kvblocks.block_keys(list(range(20)), 4)  # 5 blocks
    assert index.apply(upd("a", 1, full=True, stored=keys[:3]), "n1", 0.0) is None
    assert (
        index.apply(upd("b", 1, full=True, stored=[keys[0], keys[2], keys[3]]), "n2", 0.0) is None
    )
    assert depths(index, keys, [("a", "n1"), ("b", "n2"), ("c", "n3")]) == {"a": 3, "b": 1}


def test_a_node_speaks_only_for_its_own_endpoints() -> None:
    index = KvIndex()
    keys = kvblocks.block_keys(list(range(8)), 4)
    index.apply(upd("a", 1, full=True, stored=keys[:1]), "n1", 0.0)
    # n2 claims a's cache: kept apart, never believed for a, and n1's word stands.
    index.apply(upd("a", 1, full=True, stored=keys), "n2", 0.0)
    index.apply(upd("a", 2, stored=keys[1:]), "n2", 0.0)
    assert depths(index, keys, [("a", "n1")]) == {"a": 1}
    index.apply(upd("a", 2, stored=keys[1:2]), "n1", 0.0)
    assert depths(index, keys, [("a", "n1")]) == {"a": 2}


def test_a_missed_update_or_a_new_instance_predicts_nothing_until_a_full_one() -> None:
    index = KvIndex()
    keys = kvblocks.block_keys(list(range(16)), 4)
    index.apply(upd("a", 1, full=True, stored=keys[:2]), "n", 0.0)
    index.apply(upd("a", 3, stored=keys[2:3]), "n", 0.0)  # seq 2 was lost
    assert depths(index, keys, [("a", "n")]) == {}
    index.apply(upd("a", 4, full=True, stored=keys[:3]), "n", 0.0)
    assert depths(index, keys, [("a", "n")]) == {"a": 3}
    index.apply(upd("a", 1, stored=keys, instance="i2"), "n", 0.0)  # the engine restarted
    assert depths(index, keys, [("a", "n")]) == {}
    assert len(index) == 0


def test_updates_that_stop_make_an_endpoint_unpredicted() -> None:
    index = KvIndex(stale_after_s=5.0)
    keys = kvblocks.block_keys(list(range(8)), 4)
    index.apply(upd("a", 1, full=True, stored=keys), "n", 100.0)
    assert depths(index, keys, [("a", "n")], now=104.0) == {"a": 2}
    assert depths(index, keys, [("a", "n")], now=106.0) == {}


def test_forget_drops_an_endpoint_from_every_node() -> None:
    index = KvIndex()
    keys = kvblocks.block_keys(list(range(8)), 4)
    index.apply(upd("a", 1, full=True, stored=keys), "n1", 0.0)
    index.apply(upd("a", 1, full=True, stored=keys), "n2", 0.0)
    index.apply(upd("b", 1, full=True, stored=keys), "n1", 0.0)
    index.forget("a")
    assert depths(index, keys, [("a", "n1"), ("a", "n2"), ("b", "n1")]) == {"b": 2}
    assert set(index.holders) == set(keys)


ops = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c"]),
        st.sampled_from(["n1", "n2"]),
        st.booleans(),
        st.lists(st.integers(0, 30), max_size=8),
        st.lists(st.integers(0, 30), max_size=8),
        st.integers(0, 2),  # 0: next seq, 1: skip one, 2: new instance
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ops, st.lists(st.integers(0, 30), min_size=1, max_size=10, unique=True))
def test_the_index_is_the_fold_of_its_updates_and_two_routers_agree(
    plan: list[tuple[str, str, bool, list[int], list[int], int]], prompt: list[int]
) -> None:
    a, b = KvIndex(), KvIndex()
    model: dict[tuple[str, str], set[int] | None] = {}  # None: not synced
    seqs: dict[tuple[str, str], tuple[str, int]] = {}
    for ep, node, full, stored, removed, mode in plan:
        inst, seq = seqs.get((node, ep), ("i0", 0))
        if mode == 1:
            seq += 1
        elif mode == 2:
            inst = inst + "x"
        seq += 1
        seqs[(node, ep)] = (inst, seq)
        u = upd(ep, seq, full=full, stored=stored, removed=removed, instance=inst)
        for index in (a, b):
            index.apply(u, node, 0.0)
        have = model.get((node, ep))
        if full:
            model[(node, ep)] = set(stored)
        elif (node, ep) not in model or mode != 0 or have is None:
            model[(node, ep)] = None  # unknown base, a gap or a new instance: unsynced
        else:
            have -= set(removed)
            have |= set(stored)
    cands = [(ep, node) for ep in "abc" for node in ("n1", "n2")]
    for ep, node in cands:
        held = model.get((node, ep))
        got = a.endpoints.get((node, ep))
        if held is None:
            assert got is None or not got.synced
        else:
            assert got is not None
            assert got.keys == held
    # Matching agrees with the model: consecutive leading keys held, per synced endpoint.
    for (node, ep), held in model.items():
        if held is None:
            continue
        n = 0
        while n < len(prompt) and prompt[n] in held:
            n += 1
        got = a.match(lambda _s: prompt, [(ep, node)], 0.0)[0]
        assert got == {ep: n}
    assert a.holders == b.holders
    assert {k: e.keys for k, e in a.endpoints.items()} == {
        k: e.keys for k, e in b.endpoints.items()
    }


def test_recent_routes_cover_the_moment_before_the_events() -> None:
    recent = RecentRoutes(window_s=2.0)
    keys = [1, 2, 3]
    recent.record(keys, "a", 10.0)
    assert recent.match([1, 2, 9], 11.0) == ("a", 2)
    assert recent.match(keys, 12.5) == ("", 0)
    recent.forget("a")
    assert recent.match(keys, 10.5) == ("", 0)


def _ep(name: str, *, inflight: int = 0, queue: float = 0.0) -> routing.EndpointState:
    return routing.EndpointState(id=name, url=f"http://{name}", models=frozenset({"m"}),
                                 ready=True, inflight=inflight, queue_depth=queue)  # fmt: skip


PLAIN = routing.CostModel(running_tokens=64, waiting_tokens=1024, agree_tokens=0, family_tokens=0)


def _first(
    eps: list[routing.EndpointState],
    cached: dict[str, int],
    prompt: int = 1000,
    cost: routing.CostModel = PLAIN,
    **query: object,
) -> str:
    q = routing.Query(model="m", now=0.0, prompt_tokens=prompt, cached_tokens=cached, cost=cost,
                      **query)  # type: ignore[arg-type]  # fmt: skip
    return routing.rank(eps, q, routing.Weights(), 0.0).order[0].id


def test_cost_ranking_follows_the_cache_until_load_outweighs_it() -> None:
    assert _first([_ep("a", inflight=4), _ep("b")], {"a": 960}) == "a"  # 40 + 256 < 1000
    assert _first([_ep("a", inflight=16), _ep("b")], {"a": 960}) == "b"  # 40 + 1024 > 1000
    assert _first([_ep("a", queue=1), _ep("b")], {"a": 960}) == "b"  # a queued request
    # Past max_imbalance no cache is followed, whatever it saves.
    tight = routing.CostModel(running_tokens=1, max_imbalance=2, agree_tokens=0, family_tokens=0)
    assert _first([_ep("a", inflight=3), _ep("b")], {"a": 1000}, cost=tight) == "b"
    assert _first([_ep("a", inflight=2), _ep("b")], {"a": 1000}, cost=tight) == "a"


def test_a_new_prefix_goes_where_fewest_families_compete() -> None:
    cost = routing.CostModel(running_tokens=32, family_tokens=256, agree_tokens=0)
    eps = [_ep("a", inflight=1), _ep("b", inflight=3)]
    # Nobody holds it: b is busier but holds fewer prefix families.
    assert _first(eps, {}, cost=cost, families={"a": 4, "b": 2}) == "b"
    # Cached on a, a stays the choice: the prefill saved outweighs the families.
    assert _first(eps, {"a": 960}, cost=cost, families={"a": 4, "b": 2}) == "a"


def test_a_fresh_replica_is_not_flooded_for_its_empty_cache() -> None:
    # Short unique prompts are each a family of their own: an old cache holds hundreds, a
    # new replica none. Load still balances them: crowding costs at most the prompt.
    cost = routing.CostModel(running_tokens=32, family_tokens=256, agree_tokens=0)
    old, fresh = _ep("old"), _ep("fresh", inflight=1)
    assert _first([old, fresh], {}, prompt=19, cost=cost, families={"old": 200}) == "old"
    # A long prompt nobody holds still goes where fewer families compete.
    assert _first([old, fresh], {}, prompt=1200, cost=cost, families={"old": 200}) == "fresh"


def test_a_conversations_next_turn_stays_with_its_cache_in_a_crowded_cache() -> None:
    # a holds this conversation's first turns (352 of 435 tokens) and more prefix families
    # than b. Placing the turn on a adds 83 tokens and no family: it stays.
    cost = routing.CostModel(running_tokens=32, family_tokens=256, agree_tokens=0)
    eps = [_ep("a"), _ep("b")]
    assert _first(eps, {"a": 352}, prompt=435, cost=cost, families={"a": 16, "b": 14}) == "a"
    # Nobody holds it: the less crowded cache takes it.
    assert _first(eps, {}, prompt=435, cost=cost, families={"a": 16, "b": 14}) == "b"


def test_the_engines_queue_counts_as_load_of_every_router() -> None:
    # Requests other routers sent wait in a's engine (its /metrics); this router sent none.
    cost = routing.CostModel()
    assert _first([_ep("a", queue=20), _ep("b")], {}, cost=cost) == "b"
    assert _first([_ep("a", queue=20), _ep("b")], {"a": 960}, cost=cost) == "a"  # 40 + 640
    assert _first([_ep("a", queue=40), _ep("b")], {"a": 960}, cost=cost) == "b"  # 40 + 1280


@given(
    st.dictionaries(st.sampled_from("abcd"), st.tuples(st.integers(0, 10_000),
                                                       st.integers(0, 5000)), min_size=1),
    st.integers(1, 5000),
)  # fmt: skip
def test_crowding_never_costs_more_than_what_the_prompt_adds(
    held: dict[str, tuple[int, int]], prompt: int
) -> None:
    cost = routing.CostModel(running_tokens=0, waiting_tokens=0, family_tokens=256)
    families = {name: f for name, (f, _) in held.items()}
    cached = {name: c for name, (_, c) in held.items()}
    eps = [_ep(name) for name in held]
    q = routing.Query(model="m", now=0.0, prompt_tokens=prompt, families=families,
                      cached_tokens=cached, cost=cost)  # fmt: skip
    for (price, followed), name in zip(routing.costs(eps, q), held, strict=True):
        uncached = prompt - min(cached[name], prompt)
        assert followed == prompt - uncached
        assert uncached <= price <= 2 * uncached


@given(st.dictionaries(st.sampled_from("abcd"), st.integers(0, 10_000), min_size=1),
       st.integers(1, 5000))  # fmt: skip
def test_crowding_never_costs_more_than_the_prompt(families: dict[str, int], prompt: int) -> None:
    cost = routing.CostModel(running_tokens=0, waiting_tokens=0, family_tokens=256)
    eps = [_ep(name) for name in families]
    q = routing.Query(model="m", now=0.0, prompt_tokens=prompt, families=families, cost=cost)
    priced = [c for c, _ in routing.costs(eps, q)]
    assert max(priced) - min(priced) <= prompt
    # The least crowded pays nothing for crowding; more families never cost less.
    assert min(priced) == prompt
    by_families = sorted(zip(families.values(), priced, strict=True))
    assert all(x[1] <= y[1] for x, y in itertools.pairwise(by_families))


@given(st.integers(1, 2**63), st.integers(0, 1), st.integers(0, 1))
def test_routers_whose_loads_differ_a_little_choose_alike(key: int, da: int, db: int) -> None:
    # Two routers see the same caches, their own in-flight counts off by a request: within
    # agree_tokens, the prompt's key decides, the same way for both.
    cost = routing.CostModel(running_tokens=32, agree_tokens=64, family_tokens=0)
    one = _first([_ep("a"), _ep("b"), _ep("c")], {}, cost=cost, tie_key=key)
    other = _first([_ep("a", inflight=da), _ep("b", inflight=db), _ep("c")], {}, cost=cost,
                   tie_key=key)  # fmt: skip
    assert one == other


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 3), st.integers(0, 2000)),
                min_size=2, max_size=6), st.integers(1, 2000))  # fmt: skip
def test_the_cheapest_endpoint_always_wins(spec: list[tuple[int, int, int]], prompt: int) -> None:
    eps = [_ep(f"e{i}", inflight=f, queue=q) for i, (f, q, _) in enumerate(spec)]
    cached = {f"e{i}": c for i, (_, _, c) in enumerate(spec)}
    q = routing.Query(model="m", now=0.0, prompt_tokens=prompt, cached_tokens=cached)
    priced = routing.costs(eps, q)
    first = routing.rank(eps, q, routing.Weights(), 0.5).order[0]
    assert priced[eps.index(first)][0] == min(c for c, _ in priced)
    assert all(0 <= held <= prompt for _, held in priced)


def test_a_cache_holding_the_prompts_start_is_not_charged_for_the_prompts_own_family() -> None:
    # a holds 100 tokens of this prompt, so its 2 families include the prompt's own: it
    # gains no family by taking it, and b (1 family, holding nothing) is no less crowded.
    cost = routing.CostModel(running_tokens=0, family_tokens=256, agree_tokens=0)
    eps = [_ep("a"), _ep("b")]
    assert _first(eps, {"a": 100}, cost=cost, families={"a": 2, "b": 1}) == "a"


def test_the_order_after_the_first_is_cheapest_first_for_retries() -> None:
    eps = [_ep("d", inflight=3), _ep("b", inflight=1), _ep("a"), _ep("c", inflight=2)]
    q = routing.Query(model="m", now=0.0, prompt_tokens=1000, cost=PLAIN)
    assert [e.id for e in routing.rank(eps, q, routing.Weights(), 0.0).order] == list("abcd")

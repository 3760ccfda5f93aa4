"""Endpoint selection: filters, scorers and the ranking (llmgw.core.routing)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llmgw.core import breaker, routing
from llmgw.core.routing import EndpointState, Query, Weights

POLICY = breaker.BreakerPolicy(failures_to_open=2, open_s=10.0)


def ep(id: str, **kw: object) -> EndpointState:
    base: dict[str, object] = {"url": f"http://{id}", "models": frozenset({"m"}), "ready": True}
    base.update(kw)
    return EndpointState(id=id, **base)  # type: ignore[arg-type]


def q(**kw: object) -> Query:
    base: dict[str, object] = {"model": "m", "now": 100.0, "policy": POLICY}
    base.update(kw)
    return Query(**base)  # type: ignore[arg-type]


def test_each_filter_drops_what_it_names() -> None:
    eps = [
        ep("ok"),
        ep("other-model", models=frozenset({"x"})),
        ep("loading", ready=False),
        ep("draining", draining=True),
        ep("broken", breaker=breaker.Breaker(state="open", opened_at=95.0)),
    ]
    r = routing.rank(eps, q(), Weights(), 0.0)
    assert [e.id for e in r.order] == ["ok"]
    assert r.drops == {"serves_model": 1, "ready": 1, "not_draining": 1, "breaker_closed": 1}


def test_open_breaker_past_cool_down_lets_a_probe_through_but_not_two() -> None:
    opened = breaker.Breaker(state="open", opened_at=80.0)
    assert [e.id for e in routing.rank([ep("a", breaker=opened)], q(), Weights(), 0).order] == ["a"]
    probing = breaker.on_attempt(opened, POLICY, 100.0)
    assert routing.rank([ep("a", breaker=probing)], q(), Weights(), 0).order == []


def test_fewest_inflight_wins() -> None:
    eps = [ep("a", inflight=5), ep("b", inflight=1), ep("c", inflight=3)]
    r = routing.rank(eps, q(), Weights(), 0.99)
    assert [e.id for e in r.order] == ["b", "c", "a"]
    assert r.winner_scores["inflight"] == 1.0


def test_deep_queue_loses_even_with_fewer_router_inflight() -> None:
    eps = [ep("deep", queue_depth=40.0, inflight=0), ep("idle", queue_depth=0.0, inflight=1)]
    r = routing.rank(eps, q(), Weights(inflight=1.0, queue=2.0), 0.0)
    assert r.order[0].id == "idle"


def test_full_kv_cache_loses() -> None:
    eps = [ep("full", kv_usage=0.95), ep("free", kv_usage=0.1)]
    assert routing.rank(eps, q(), Weights(), 0.0).order[0].id == "free"


def test_prefix_affinity_beats_load_unless_weight_zero() -> None:
    eps = [ep("warm", inflight=2), ep("cold", inflight=0)]
    query = q(prefix_blocks=10, prefix_hits={"warm": 9})
    assert routing.rank(eps, query, Weights(prefix=2.0), 0.0).order[0].id == "warm"
    assert routing.rank(eps, query, Weights(prefix=0.0), 0.0).order[0].id == "cold"


def test_session_affinity() -> None:
    eps = [ep("a"), ep("b"), ep("c")]
    for rand in (0.0, 0.5, 0.99):
        assert routing.rank(eps, q(session_endpoint="c"), Weights(), rand).order[0].id == "c"


def test_ties_are_broken_by_the_random_number() -> None:
    eps = [ep("a"), ep("b"), ep("c"), ep("d")]
    firsts = {routing.rank(eps, q(), Weights(), r / 4).order[0].id for r in range(4)}
    assert firsts == {"a", "b", "c", "d"}


def test_ties_go_to_the_endpoint_sent_to_longest_ago() -> None:
    eps = [ep("a", last_sent=5.0), ep("b", last_sent=2.0), ep("c", last_sent=9.0)]
    for rand in (0.0, 0.5, 0.99):
        assert routing.rank(eps, q(), Weights(), rand).order[0].id == "b"
    # A better score still wins over waiting longer.
    eps[2].inflight = 0
    eps[0].inflight = eps[1].inflight = 3
    assert routing.rank(eps, q(), Weights(), 0.0).order[0].id == "c"


def test_a_draining_endpoint_takes_requests_while_no_other_of_its_model_can() -> None:
    # The drained node held every replica: they keep serving, scored like any other.
    draining = [ep("d1", draining=True, inflight=3), ep("d2", draining=True, inflight=0)]
    r = routing.rank(draining, q(), Weights(), 0.0)
    assert [e.id for e in r.order] == ["d2", "d1"]
    assert r.drops == {}
    # Other endpoints that cannot take it (loading, broken, another model) change nothing.
    others = [
        ep("loading", ready=False),
        ep("broken", breaker=breaker.Breaker(state="open", opened_at=95.0)),
        ep("other-model", models=frozenset({"x"})),
    ]
    r = routing.rank([*draining, *others], q(), Weights(), 0.0)
    assert {e.id for e in r.order} == {"d1", "d2"}
    assert "not_draining" not in r.drops
    # Once a replacement is ready, it alone takes new requests.
    r = routing.rank([*draining, *others, ep("replacement", inflight=9)], q(), Weights(), 0.0)
    assert [e.id for e in r.order] == ["replacement"]
    assert r.drops["not_draining"] == 2


def test_routable_counts_what_rank_would_send_to() -> None:
    assert routing.routable([ep("d", draining=True), ep("loading", ready=False)]) == 1
    assert routing.routable([ep("d", draining=True), ep("a"), ep("b")]) == 2
    assert routing.routable([ep("d", draining=True, ready=False)]) == 0
    assert routing.routable([]) == 0


def test_nothing_survives_means_empty_order() -> None:
    r = routing.rank([ep("a", ready=False)], q(), Weights(), 0.5)
    assert r.order == []
    assert r.drops == {"ready": 1}


endpoint_st = st.builds(
    EndpointState,
    id=st.text(min_size=1, max_size=4),
    url=st.just("http://x"),
    models=st.frozensets(st.sampled_from(["m", "n"]), max_size=2),
    ready=st.booleans(),
    draining=st.booleans(),
    inflight=st.integers(0, 1000),
    queue_depth=st.floats(0, 1e4, allow_nan=False),
    kv_usage=st.floats(0, 1, allow_nan=False),
    breaker=st.sampled_from(
        [
            breaker.CLOSED,
            breaker.Breaker(state="open", opened_at=99.0),
            breaker.Breaker(state="half_open", probing=True),
        ]
    ),
)
weights_st = st.builds(
    Weights,
    inflight=st.floats(0, 10),
    queue=st.floats(0, 10),
    kv_cache=st.floats(0, 10),
    prefix=st.floats(0, 10),
    session=st.floats(0, 10),
)


@given(
    eps=st.lists(endpoint_st, max_size=8),
    weights=weights_st,
    rand=st.floats(0, 1, exclude_max=True),
    hits=st.dictionaries(st.text(min_size=1, max_size=4), st.integers(0, 20)),
)
def test_rank_orders_exactly_the_eligible_endpoints(
    eps: list[EndpointState], weights: Weights, rand: float, hits: dict[str, int]
) -> None:
    query = q(prefix_blocks=20, prefix_hits=hits, session_endpoint=eps[0].id if eps else "")
    r = routing.rank(eps, query, weights, rand)
    eligible = [e for e in eps if all(f(e, query) for _, f in routing.FILTERS)]
    # Draining endpoints only when nothing else is eligible (the drained node's last
    # replica keeps serving until a replacement is ready).
    if any(not e.draining for e in eligible):
        eligible = [e for e in eligible if not e.draining]
    assert sorted(map(id, r.order)) == sorted(map(id, eligible))
    assert sum(r.drops.values()) == len(eps) - len(eligible)
    # Deterministic: the same inputs give the same order.
    assert [id(e) for e in routing.rank(eps, query, weights, rand).order] == [
        id(e) for e in r.order
    ]
    for values in (s(eligible, query) for _, s in routing.SCORERS if eligible):
        assert all(0.0 <= v <= 1.0 for v in values)


@given(eps=st.lists(endpoint_st, min_size=1, max_size=8), rand=st.floats(0, 1, exclude_max=True))
def test_no_request_goes_unrouted_while_a_draining_endpoint_could_take_it(
    eps: list[EndpointState], rand: float
) -> None:
    query = q()
    r = routing.rank(eps, query, Weights(), rand)
    # Whatever serves the model, is ready and whose breaker lets a request through.
    takers = [
        e
        for e in eps
        if "m" in e.models and e.ready and breaker.allows(e.breaker, POLICY, query.now)
    ]
    assert bool(r.order) == bool(takers)
    assert all(e.draining for e in r.order) or not any(e.draining for e in r.order)
    assert not r.order or r.order[0].draining == all(e.draining for e in takers)


def test_a_session_stays_on_its_endpoint_under_default_weights_though_it_is_busiest() -> None:
    # Its conversation is in that engine's cache: moving it for load re-prefills it all.
    eps = [ep("home", inflight=7, queue_depth=9.0, kv_usage=0.9), ep("idle"), ep("idle2")]
    for rand in (0.0, 0.5, 0.99):
        assert routing.rank(eps, q(session_endpoint="home"), Weights(), rand).order[0].id == "home"


@given(hits=st.integers(0, 10_000), blocks=st.integers(1, 40))
def test_prefix_score_never_passes_one_whatever_the_index_claims(hits: int, blocks: int) -> None:
    # An index that claims more blocks than the prompt has must not outweigh a session.
    eps = [ep("claims"), ep("session")]
    query = q(prefix_blocks=blocks, prefix_hits={"claims": hits}, session_endpoint="session")
    assert all(0.0 <= v <= 1.0 for v in routing.score_prefix(eps, query))
    weights = Weights(inflight=0, queue=0, kv_cache=0, prefix=2.0, session=3.0)
    assert routing.rank(eps, query, weights, 0.0).order[0].id == "session"


def test_the_scorers_cache_is_bounded_and_never_serves_another_weights_scorers() -> None:
    for i in range(300):  # weights made per call: the cache must not grow with them
        routing.rank([ep("a"), ep("b")], q(), Weights(inflight=float(i)), 0.0)
    assert len(routing._ACTIVE) <= 65
    # A Weights object at the address of a freed one (ids are reused) gets its own scorers.
    session_only = Weights(inflight=0, queue=0, kv_cache=0, prefix=0, session=1.0)
    routing._ACTIVE[id(session_only)] = (Weights(), ())  # a stale entry, another object's
    eps = [ep("a"), ep("b")]
    assert routing.rank(eps, q(session_endpoint="b"), session_only, 0.0).order[0].id == "b"

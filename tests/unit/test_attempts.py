"""The attempt planner (llmgw.router.attempts) without a socket: its properties over
generated fleets, fallback chains and attempt outcomes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core import breaker, routing
from llmgw.core.profile import Deadlines, ModelProfile
from llmgw.router.attempts import Attempt, Planner, Rules, fallback_chain
from llmgw.router.errors import Refusal, Retry, retry_refusal

POLICY = breaker.BreakerPolicy(failures_to_open=2, open_s=10.0)


def rules(endpoints: Callable[[str], list[routing.EndpointState]]) -> Rules:
    """Three attempts a model, ties to the first."""
    return Rules(
        endpoints, weights=routing.Weights(), policy=POLICY, max_attempts=3, draw=lambda: 0.0
    )


MODELS = ["m0", "m1", "m2", "m3"]
FAILURES = [
    Retry("connect_error", 502, "no connection"),
    Retry("status_503", 502, "engine answered 503"),
    Retry("overloaded", 429, "engine answered 429", fault=False),
    Retry("first_token_timeout", 504, "no first token"),
]


@dataclass
class World:
    profiles: dict[str, ModelProfile]
    endpoints: list[routing.EndpointState]
    asked: str
    allowed: frozenset[str]
    max_attempts: int
    outcomes: list[tuple[str, int]]
    """Per attempt: ("ok" | "before" | "after", failure index)."""
    steps: list[float]
    """Clock advance before each `next`."""
    draws: list[float] = field(default_factory=list)

    def for_model(self, name: str) -> list[routing.EndpointState]:
        return [ep for ep in self.endpoints if name in ep.models]


breakers = st.sampled_from(
    [
        breaker.CLOSED,
        breaker.Breaker(failures=1),
        breaker.Breaker(state="open", opened_at=95.0),  # cooling down at t=100
        breaker.Breaker(state="open", opened_at=50.0),  # past its cool-down: one probe
        breaker.Breaker(state="half_open", probing=True, opened_at=50.0),
    ]
)


@st.composite
def worlds(draw: st.DrawFn) -> World:
    profiles = {}
    for name in MODELS:
        others = [m for m in MODELS if m != name]
        fallbacks = draw(st.lists(st.sampled_from([*others, "missing"]), max_size=4))
        total = draw(st.sampled_from([1.0, 5.0, 600.0]))
        profiles[name] = ModelProfile(
            name=name, fallbacks=tuple(fallbacks), deadlines=Deadlines(total_s=total)
        )
    endpoints = []
    for i in range(draw(st.integers(0, 7))):
        endpoints.append(
            routing.EndpointState(
                id=f"e{i}",
                url=f"http://e{i}",
                models=frozenset(draw(st.sets(st.sampled_from(MODELS), min_size=1, max_size=3))),
                ready=draw(st.booleans() | st.just(True)),
                draining=draw(st.booleans()) and draw(st.booleans()),
                inflight=draw(st.integers(0, 3)),
                queue_depth=draw(st.sampled_from([0.0, 2.0])),
                breaker=draw(breakers),
                last_sent=draw(st.sampled_from([0.0, 1.0])),
            )
        )
    outcomes = draw(
        st.lists(
            st.tuples(st.sampled_from(["ok", "before", "after"]), st.integers(0, 3)),
            min_size=16,
            max_size=16,
        )
    )
    return World(
        profiles=profiles,
        endpoints=endpoints,
        asked=draw(st.sampled_from(MODELS)),
        allowed=frozenset(draw(st.sets(st.sampled_from(MODELS)))),
        max_attempts=draw(st.integers(1, 4)),
        outcomes=outcomes,
        steps=draw(st.lists(st.sampled_from([0.0, 0.0, 0.5, 2.0]), min_size=16, max_size=16)),
        draws=draw(st.lists(st.floats(0.0, 0.999), min_size=5, max_size=5)),
    )


@dataclass
class Run:
    chain: list[ModelProfile]
    attempts: list[Attempt]
    end: Attempt | Refusal | None
    after_end: list[Attempt | Refusal | None]
    settled_by: str
    last: Retry | None
    times: list[float]


def drive(w: World, start: float = 100.0) -> Run:
    """The dispatch loop's part, with outcomes from the world instead of engines."""
    profile = w.profiles[w.asked]
    chain, _ = fallback_chain(
        profile, w.profiles.get, lambda name, p: name == w.asked or name in w.allowed
    )
    draws = iter(w.draws * 10)
    rules = Rules(
        w.for_model,
        weights=routing.Weights(),
        policy=POLICY,
        max_attempts=w.max_attempts,
        draw=lambda: next(draws),
    )
    planner = Planner(chain, rules, start)
    now = start
    attempts: list[Attempt] = []
    times: list[float] = []
    settled_by = ""
    last: Retry | None = None
    for i in range(len(w.outcomes)):
        now += w.steps[i]
        step = planner.next(now)
        if not isinstance(step, Attempt):
            return Run(chain, attempts, step, [planner.next(now)], settled_by, last, times)
        attempts.append(step)
        times.append(now)
        kind, f = w.outcomes[i]
        if kind == "ok":
            planner.answered()
            settled_by = "ok"
        elif kind == "after":
            planner.failed(FAILURES[f], after_first_byte=True)
            settled_by = "after"
        else:
            last = FAILURES[f]
            planner.failed(last)
            continue
        after = [planner.next(now + 1.0) for _ in range(3)]
        return Run(chain, attempts, None, after, settled_by, last, times)
    raise AssertionError("more attempts than outcomes: the planner did not stop")


@settings(max_examples=150, deadline=None)
@given(w=worlds())
def test_never_retries_after_the_first_byte(w: World) -> None:
    run = drive(w)
    if run.settled_by:
        # Answered, or cut after the first byte: nothing more is offered, ever.
        assert run.after_end == [None, None, None]
        kinds = [k for k, _ in w.outcomes[: len(run.attempts)]]
        assert kinds[-1] in ("ok", "after")
        assert all(k == "before" for k in kinds[:-1])
    else:
        assert isinstance(run.end, Refusal)
        assert run.after_end == [None]  # a refusal is final too


@settings(max_examples=150, deadline=None)
@given(w=worlds())
def test_tries_each_endpoint_at_most_once(w: World) -> None:
    run = drive(w)
    ids = [a.endpoint.id for a in run.attempts]
    assert len(ids) == len(set(ids))


@settings(max_examples=150, deadline=None)
@given(w=worlds())
def test_honours_the_fallback_order(w: World) -> None:
    run = drive(w)
    profile = w.profiles[w.asked]
    # The chain: the model asked for, then its fallbacks in configured order (known,
    # allowed, each once).
    expected = [profile]
    for name in profile.fallbacks:
        p = w.profiles.get(name)
        if p is not None and p not in expected and name in w.allowed:
            expected.append(p)
    assert run.chain == expected
    positions = [a.n for a in run.attempts]
    assert positions == sorted(positions)  # the model's endpoints before fallbacks'
    for a in run.attempts:
        assert a.profile is run.chain[a.n]
        assert a.profile.name in a.endpoint.models
    per_model: dict[int, int] = {}
    for a in run.attempts:
        per_model[a.n] = per_model.get(a.n, 0) + 1
    assert all(count <= w.max_attempts for count in per_model.values())


@settings(max_examples=150, deadline=None)
@given(w=worlds())
def test_only_routable_endpoints_within_the_budget_are_tried(w: World) -> None:
    run = drive(w)
    for a, at in zip(run.attempts, run.times, strict=True):
        ep = a.endpoint
        assert ep.ready  # (a draining endpoint is taken when it is the only one)
        assert breaker.allows(ep.breaker, POLICY, at)
        assert at - 100.0 < a.profile.deadlines.total_s


@settings(max_examples=150, deadline=None)
@given(w=worlds())
def test_a_refusal_carries_an_openai_error(w: World) -> None:
    run = drive(w)
    if not isinstance(run.end, Refusal):
        return
    r = run.end
    body = msgspec.json.decode(r.body())
    err = body["error"]
    assert isinstance(err["message"], str)
    assert err["message"]
    assert err["type"] == ("rate_limit_error" if r.status == 429 else "server_error")
    assert isinstance(err["code"], str)
    assert err["code"]
    assert r.status in (429, 502, 503, 504)
    if run.last is not None:
        # The last failure is what the client is told.
        assert (r.code, r.status, r.message) == (run.last.reason, run.last.status, run.last.message)
    else:
        assert (r.code, r.status) == ("no_endpoint", 503)


def test_a_fallback_is_tried_after_the_models_own_endpoints_fail() -> None:
    big = ModelProfile(name="big", fallbacks=("small",))
    small = ModelProfile(name="small")
    eps = [
        routing.EndpointState(id=f"{m}-{i}", url="http://x", models=frozenset({m}), ready=True)
        for m in ("big", "small")
        for i in range(2)
    ]
    ranked: list[tuple[int, str]] = []
    planner = Planner(
        [big, small],
        rules(lambda name: [e for e in eps if name in e.models]),
        0.0,
        on_rank=lambda n, p, r: ranked.append((n, p.name)),
    )
    seen = []
    while isinstance(step := planner.next(1.0), Attempt):
        seen.append((step.n, step.endpoint.id))
        planner.failed(FAILURES[1])
    assert sorted(seen[:2]) == [(0, "big-0"), (0, "big-1")]
    assert sorted(seen[2:]) == [(1, "small-0"), (1, "small-1")]
    assert ranked == [(0, "big"), (1, "small")]  # the fallback is ranked when reached
    assert isinstance(step, Refusal)
    assert step.code == "status_503"


def test_a_fallback_without_endpoints_leaves_the_models_own_failure_to_tell() -> None:
    """The model's endpoints failed; its fallback has none ready: the client is told the
    failure it met (the engines' 503), not that nothing serves the model it asked for."""
    big = ModelProfile(name="big", fallbacks=("small",))
    eps = [routing.EndpointState(id="big-0", url="http://x", models=frozenset({"big"}),
                                 ready=True)]  # fmt: skip
    planner = Planner([big, ModelProfile(name="small")], rules(lambda name: [
        e for e in eps if name in e.models]), 0.0)  # fmt: skip
    step = planner.next(1.0)
    assert isinstance(step, Attempt)
    planner.failed(FAILURES[1])
    step = planner.next(1.0)
    assert isinstance(step, Refusal)
    assert (step.code, step.status) == ("status_503", 502)


def test_an_endpoint_whose_breaker_opened_after_ranking_is_skipped() -> None:
    """Another request's failures opened the second endpoint's breaker after this one's
    ranking: it is not tried (the breaker is read again before each attempt)."""
    eps = [routing.EndpointState(id=f"e{i}", url="http://x", models=frozenset({"m"}),
                                 ready=True) for i in range(2)]  # fmt: skip
    planner = Planner([ModelProfile(name="m")], rules(lambda name: eps), 0.0)
    step = planner.next(1.0)
    assert isinstance(step, Attempt)
    other = eps[1] if step.endpoint is eps[0] else eps[0]
    other.breaker = breaker.Breaker(state="open", opened_at=1.0)
    planner.failed(FAILURES[0])
    assert isinstance(planner.next(2.0), Refusal)


def test_no_attempt_starts_once_the_total_deadline_is_reached() -> None:
    eps = [routing.EndpointState(id=f"e{i}", url="http://x", models=frozenset({"m"}),
                                 ready=True) for i in range(2)]  # fmt: skip
    m = ModelProfile(name="m", deadlines=Deadlines(total_s=5.0))
    planner = Planner([m], rules(lambda name: eps), 10.0)
    assert isinstance(planner.next(14.0), Attempt)
    planner.failed(FAILURES[0])
    assert isinstance(planner.next(15.0), Refusal)  # 5 s spent: none left for another


def test_no_endpoint_at_all_is_a_503() -> None:
    planner = Planner([ModelProfile(name="m")], rules(lambda name: []), 0.0)
    step = planner.next(0.0)
    assert isinstance(step, Refusal)
    assert (step.status, step.type, step.code) == (503, "server_error", "no_endpoint")
    assert "'m'" in step.message
    assert step.retry_after == 1  # "retry shortly" in the header clients act on


@given(st.integers(400, 599), st.sampled_from(["overloaded", "status_500", "no_endpoint"]))
def test_only_busy_or_unready_engines_ask_the_client_to_wait(status: int, reason: str) -> None:
    refusal = retry_refusal(Retry(reason, status, "m"))
    assert refusal.status == status
    assert refusal.retry_after == (1 if status in (429, 503) else 0)
    assert refusal.type == ("rate_limit_error" if status == 429 else "server_error")

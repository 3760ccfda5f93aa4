"""The attempt planner: which endpoint a request tries next, and when it stops trying.

Pure: no asyncio, no sockets, no clock of its own (every call is given `now`).
The dispatch loop (`llmgw.router.dispatch`) asks `Planner.next` for an attempt,
makes it, and says how it went: `failed` before the first byte (the planner
may offer another endpoint), `answered` once anything reached the client (the
planner offers nothing more: a stream that started is never moved to another
engine). When no attempt is left, `next` returns a `Refusal` carrying the last
failure as an OpenAI error.

The order: the model's own endpoints, ranked by `llmgw.core.routing.rank`, at
most `max_attempts` of them, then each fallback model's the same way, in the
configured order. A fallback is ranked only when it is reached, at that moment.
An endpoint is tried at most once per request (one that serves a model and its
fallback is not asked twice), one whose breaker is open is skipped, and once
the request's total deadline is spent no model starts another attempt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

from llmgw.core import breaker, routing
from llmgw.core.profile import ModelProfile
from llmgw.router.errors import Refusal, Retry, retry_refusal


class Attempt(msgspec.Struct, gc=False):
    """One try: this endpoint, for this model of the chain (`n` 0: the model asked for).
    (A Struct: made in C, where a NamedTuple's constructor is a Python function.)"""

    endpoint: routing.EndpointState
    profile: ModelProfile
    n: int


def fallback_chain(
    profile: ModelProfile,
    resolve: Callable[[str], ModelProfile | None],
    allowed: Callable[[str, ModelProfile], bool],
) -> tuple[list[ModelProfile], list[ModelProfile]]:
    """The models a request may be served by, in order, and the fallbacks the key may
    not use (skipped: answered as if they were down, since the client asked for a model
    it may use and a 403 would name a model it never asked for)."""
    chain = [profile]
    skipped: list[ModelProfile] = []
    if not profile.fallbacks:
        return chain, skipped
    for name in profile.fallbacks:
        p = resolve(name)
        if p is None or p in chain:
            continue
        if not allowed(name, p):
            skipped.append(p)
            continue
        chain.append(p)
    return chain, skipped


RankHook = Callable[[int, ModelProfile, routing.Ranking], None]
"""Told of each ranking (chain position, model, ranking): metrics and the fallback log."""


def _no_hook(n: int, profile: ModelProfile, ranking: routing.Ranking) -> None:
    return None


class Rules:
    """What every request's planner of one router shares: where the endpoints of a model
    are, how to rank them, the breaker policy, the attempt cap and the tie-breaking draw.
    Made once (the planner is made per request)."""

    __slots__ = ("cost", "draw", "endpoints", "max_attempts", "policy", "weights")

    def __init__(
        self,
        endpoints: Callable[[str], Sequence[routing.EndpointState]],
        *,
        weights: routing.Weights,
        policy: breaker.BreakerPolicy,
        max_attempts: int,
        draw: Callable[[], float],
        cost: routing.CostModel = routing.CostModel(),
    ) -> None:
        """`endpoints(model)` the table's endpoints of a model; `draw()` a number in [0, 1)
        for ties; at most `max_attempts` endpoints of each model are tried."""
        self.endpoints = endpoints
        self.weights = weights
        self.policy = policy
        self.max_attempts = max_attempts
        self.draw = draw
        self.cost = cost

    def drawing(self, draw: Callable[[], float]) -> Rules:
        """The same rules with ties drawn by `draw`."""
        return Rules(self.endpoints, weights=self.weights, policy=self.policy,
                     max_attempts=self.max_attempts, draw=draw, cost=self.cost)  # fmt: skip


class Planner:
    """One request's attempts, planned one at a time (see the module's docstring)."""

    __slots__ = (
        "_cache", "_chain", "_done", "_i", "_last", "_n", "_on_rank", "_order",
        "_prefix_blocks", "_prefix_hits", "_rules", "_session", "_start", "_tried",
    )  # fmt: skip

    def __init__(
        self,
        chain: Sequence[ModelProfile],
        rules: Rules,
        start: float,
        prefix_blocks: int = 0,
        prefix_hits: dict[str, int] | None = None,
        session_endpoint: str = "",
        on_rank: RankHook = _no_hook,
        cache: tuple[str, int, dict[str, int], dict[str, int], int] | None = None,
    ) -> None:
        """`chain` from `fallback_chain`; `start` when the request began (the total deadline
        runs from it, on the clock `now` is read from); `cache` (model, prompt tokens,
        endpoint -> cached tokens, endpoint -> prefix families, the tie key) ranks that
        model's endpoints by cost."""
        self._chain = chain
        self._rules = rules
        self._start = start
        self._prefix_blocks = prefix_blocks
        self._prefix_hits = prefix_hits if prefix_hits is not None else {}
        self._session = session_endpoint
        self._cache = cache
        self._on_rank = on_rank
        self._n = -1
        self._order: list[routing.EndpointState] = []
        self._i = 0
        self._tried: set[str] = set()
        self._last: Retry | None = None
        self._done = False

    @property
    def last(self) -> Retry | None:
        """The last failure: why the request moved on (or, at the end, why it failed)."""
        return self._last

    def next(self, now: float) -> Attempt | Refusal | None:
        """The next attempt; a Refusal when none is left; None once the request is answered."""
        if self._done:
            return None
        while True:
            if self._i < len(self._order):
                prof = self._chain[self._n]
                if now - self._start >= prof.deadlines.total_s:
                    # The request's whole budget is spent: another try would only time out
                    # at once and count against a healthy endpoint's breaker.
                    self._i = len(self._order)
                    continue
                ep = self._order[self._i]
                self._i += 1
                if ep.id in self._tried or not breaker.allows(ep.breaker, self._rules.policy, now):
                    continue
                self._tried.add(ep.id)
                return Attempt(ep, prof, self._n)
            self._n += 1
            if self._n >= len(self._chain):
                self._done = True
                return self._refusal()
            self._rank(now)

    def query(self, prof: ModelProfile, now: float) -> routing.Query:
        """What the endpoints of `prof`, a model of the chain, are ranked on at `now`."""
        rules = self._rules
        cache = self._cache
        if cache is not None and cache[0] == prof.name:
            return routing.Query(
                model=prof.name,
                now=now,
                policy=rules.policy,
                prompt_tokens=cache[1],
                cached_tokens=cache[2],
                families=cache[3],
                tie_key=cache[4],
                cost=rules.cost,
            )
        return routing.Query(
            model=prof.name,
            now=now,
            policy=rules.policy,
            prefix_blocks=self._prefix_blocks,
            prefix_hits=self._prefix_hits,
            session_endpoint=self._session,
        )

    def _rank(self, now: float) -> None:
        prof = self._chain[self._n]
        rules = self._rules
        q = self.query(prof, now)
        ranking = routing.rank(rules.endpoints(prof.name), q, rules.weights, rules.draw())
        self._on_rank(self._n, prof, ranking)
        self._order = ranking.order[: rules.max_attempts]
        self._i = 0
        if not ranking.order and self._last is None:
            self._last = Retry(
                "no_endpoint",
                503,
                f"no ready endpoint serves the model {prof.name!r} right now: retry shortly",
                fault=False,
            )

    def _refusal(self) -> Refusal:
        if self._last is None:
            # Every candidate's breaker closed between ranking and sending.
            self._last = Retry(
                "no_endpoint",
                503,
                f"no endpoint of the model {self._chain[0].name!r} can take requests right"
                " now: retry shortly",
                fault=False,
            )
        return retry_refusal(self._last)

    def failed(self, failure: Retry, *, after_first_byte: bool = False) -> None:
        """The attempt `next` gave failed; after the first byte nothing more is tried."""
        self._last = failure
        if after_first_byte:
            self._done = True

    def answered(self) -> None:
        """The attempt reached the client: the request is settled."""
        self._done = True

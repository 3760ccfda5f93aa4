"""Endpoint selection: a pipeline of filters, then weighted scorers, over an endpoint snapshot.

The router asks `rank` which of a model's endpoints should take a request.
Filters drop endpoints that must not get it (does not serve the model, not
ready, breaker open); preferences then drop those that should not get it while
another can (draining, see `PREFERENCES`); scorers rate the survivors between 0
(worst) and 1 (best) — the router's own in-flight count, the engine's queue depth and
KV-cache usage scraped from its /metrics, prefix affinity from
`llmgw.core.prefix`, and session affinity — and the weighted sum orders them.
Full ties go to the endpoint sent to longest ago (round robin at idle), and
exact ties beyond that by a random number the caller draws from a seeded
generator, so a run can be replayed.

Each filter, preference and scorer is a small pure function; the tables `FILTERS`,
`PREFERENCES` and `SCORERS` name them, and those names label the router's metrics.
Used by `llmgw.router.dispatch`. Purely computational: time and randomness are arguments.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import msgspec

from llmgw.core import breaker


class EndpointState(msgspec.Struct, kw_only=True):
    """What the router knows about one endpoint. Mutable: the router updates it in place.

    The static config and, later, the log's EndpointUp / EndpointDown events fill
    the table; probes refresh `ready`, `queue_depth` and `kv_usage`; the dispatch
    loop keeps `inflight` and `breaker`.
    """

    id: str
    url: str
    models: frozenset[str]
    """Served model names (canonical names, aliases resolved by the router first)."""
    api_key: str = ""
    """Sent to the engine as `Authorization: Bearer`; empty: no header."""
    node: str = ""
    """The node the engine runs on: the only one whose KV events are believed for it."""
    ready: bool = False
    draining: bool = False
    inflight: int = 0
    queue_depth: float = 0.0
    """Requests waiting in the engine (vLLM num_requests_waiting, llama.cpp requests_deferred)."""
    running: float = 0.0
    kv_usage: float = 0.0
    """KV-cache usage, 0..1."""
    breaker: breaker.Breaker = breaker.CLOSED
    last_sent: float = 0.0
    """When the router last sent this endpoint a request (its clock): ties go to the
    endpoint that waited longest, round robin when everything is idle."""


class CostModel(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the router weighs a prefix cache hit against load, in tokens of prefill.

    Where the router knows a request's tokens, each candidate costs the prompt tokens it
    would have to prefill (those its cache does not hold) plus what waiting behind its
    load costs, expressed as prefill too: `running_tokens` per request it has (`load_of`:
    running or queued), and `waiting_tokens` more per request queued in the engine (none
    by default). The cheapest wins; so a cached
    prefix is followed until the load it brings outweighs the prefill it saves. Above
    `max_imbalance` requests more than the least loaded candidate, a cache is not
    followed at all, whatever it saves: one hot prefix must not pile onto one engine.
    And each candidate pays `family_tokens` per prefix family its cache holds beyond the
    least crowded candidate's (not counting the prompt's own family, where it is already
    held), at most the prompt tokens the candidate does not hold (placing the prompt evicts
    no more than what it adds of other prefixes, each re-prefilled once). Near ties
    (`agree_tokens`) go by rendezvous hashing of the prompt's first block, so routers
    that know about the same place a prefix on the same engine.
    """

    running_tokens: float = 32.0
    waiting_tokens: float = 0.0
    """Beyond its load, per request queued in the engine (its /metrics, as of the last
    probe). Off by default: a queued request already counts as load, and a heavier
    penalty for a figure up to a probe old moved conversations off their caches in bursts
    (docs/design.md, "Routing to the cache")."""
    max_imbalance: int = 32
    agree_tokens: float = 64.0
    """Candidates within this many tokens of the cheapest count as equally good, and the
    prompt's first block picks among them by rendezvous hashing (`Query.tie_key`): routers
    whose views differ by a request or two still choose alike, and a prefix copied to two
    engines is sent to one of them until the other copy is evicted."""
    family_tokens: float = 256.0
    """Per prefix family (distinct prompt start) the candidate's cache holds beyond the
    least crowded candidate's: a prefix nobody holds goes where fewest families compete for
    the cache, so prefixes spread over the caches instead of piling into one that then
    thrashes. Bounded by the prompt's tokens, so short unique prompts (each its own family)
    are balanced by load and a fresh replica is not flooded for its empty cache."""

    def problems(self) -> list[str]:
        out = []
        if min(self.running_tokens, self.waiting_tokens, self.family_tokens,
               self.agree_tokens) < 0:  # fmt: skip
            out.append(
                "cost: running_tokens, waiting_tokens, family_tokens and agree_tokens must be >= 0"
            )
        if self.max_imbalance < 0:
            out.append("cost: max_imbalance must be >= 0")
        return out


class Query(msgspec.Struct, frozen=True, kw_only=True):
    """One request as routing sees it, plus the moment it is routed."""

    model: str
    now: float
    policy: breaker.BreakerPolicy = breaker.BreakerPolicy()
    prefix_blocks: int = 0
    """Whole prefix blocks in the prompt."""
    prefix_hits: dict[str, int] = {}
    """Endpoint id -> leading blocks it is believed to hold (`PrefixIndex.match`)."""
    session_endpoint: str = ""
    """The endpoint this request's session went to last, if any."""
    prompt_tokens: int = 0
    """The prompt's length in tokens, where the router tokenized it: ranking by `cost`."""
    cached_tokens: dict[str, int] = {}
    """Endpoint id -> prompt tokens it holds in its KV cache (known or estimated)."""
    families: dict[str, int] = {}
    """Endpoint id -> prefix families its cache holds."""
    tie_key: int = 0
    """The prompt's first block key: exact cost ties go to the endpoint it hashes highest
    with (0: as `rank` breaks ties)."""
    cost: CostModel = CostModel()


class Weights(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How much each scorer counts; 0 turns a scorer off."""

    inflight: float = 1.0
    queue: float = 1.0
    kv_cache: float = 0.5
    prefix: float = 2.0
    session: float = 3.0


Filter = Callable[[EndpointState, Query], bool]
Scorer = Callable[[Sequence[EndpointState], Query], list[float]]


def serves_model(ep: EndpointState, q: Query) -> bool:
    return q.model in ep.models


def ready(ep: EndpointState, q: Query) -> bool:
    return ep.ready


def not_draining(ep: EndpointState, q: Query) -> bool:
    return not ep.draining


def breaker_closed(ep: EndpointState, q: Query) -> bool:
    """Closed, or open past its cool-down with no probe in flight (the probe goes through)."""
    return breaker.allows(ep.breaker, q.policy, q.now)


FILTERS: tuple[tuple[str, Filter], ...] = (
    ("serves_model", serves_model),
    ("ready", ready),
    ("breaker_closed", breaker_closed),
)
PREFERENCES: tuple[tuple[str, Filter], ...] = (("not_draining", not_draining),)
"""Applied after the filters, each only when some survivor satisfies it. A draining
endpoint (its node or shard drains) keeps taking new requests while no other endpoint of
the model can: it loses them once a replacement is ready, never before, so a drain of
the node holding every replica of a model drops nothing (docs/design.md, "Drains")."""


def routable(endpoints: Sequence[EndpointState]) -> int:
    """How many of one model's endpoints take its new requests now, breakers aside: the
    ready ones not draining or, while there are none, the ready draining ones (the same
    rule as `PREFERENCES`, so readiness reports what `rank` does). Pure."""
    ready_eps = [ep for ep in endpoints if ep.ready]
    serving = sum(1 for ep in ready_eps if not ep.draining)
    return serving or len(ready_eps)


def _lower_is_better(values: list[float]) -> list[float]:
    """Min-max normalise so the lowest value scores 1 and the highest 0; all equal score 1."""
    lo = min(values)
    hi = max(values)
    span = hi - lo
    if span <= 0:
        return [1.0] * len(values)
    return [(hi - v) / span for v in values]


def score_inflight(eps: Sequence[EndpointState], q: Query) -> list[float]:
    """Fewer requests this router has in flight there is better."""
    return _lower_is_better([float(ep.inflight) for ep in eps])


def score_queue(eps: Sequence[EndpointState], q: Query) -> list[float]:
    """A shorter engine queue is better: a queued request waits for a whole batch slot."""
    return _lower_is_better([ep.queue_depth for ep in eps])


def score_kv_cache(eps: Sequence[EndpointState], q: Query) -> list[float]:
    """More free KV cache is better (absolute: a full cache preempts, whatever the others do)."""
    return [min(max(1.0 - ep.kv_usage, 0.0), 1.0) for ep in eps]


def score_prefix(eps: Sequence[EndpointState], q: Query) -> list[float]:
    """The share of the prompt's prefix blocks an endpoint is believed to have cached."""
    if q.prefix_blocks <= 0 or not q.prefix_hits:
        return [0.0] * len(eps)
    hits = q.prefix_hits
    return [min(hits.get(ep.id, 0) / q.prefix_blocks, 1.0) for ep in eps]


def score_session(eps: Sequence[EndpointState], q: Query) -> list[float]:
    """The endpoint the session used last (its conversation is in that engine's cache)."""
    if not q.session_endpoint:
        return [0.0] * len(eps)
    return [1.0 if ep.id == q.session_endpoint else 0.0 for ep in eps]


SCORERS: tuple[tuple[str, Scorer], ...] = (
    ("inflight", score_inflight),
    ("queue", score_queue),
    ("kv_cache", score_kv_cache),
    ("prefix", score_prefix),
    ("session", score_session),
)
SCORER_NAMES: tuple[str, ...] = tuple(name for name, _ in SCORERS)


class Ranking(msgspec.Struct, kw_only=True):
    """The candidates best first, with why: per-filter drops and the winner's scorer values."""

    order: list[EndpointState]
    drops: dict[str, int]
    """Filter name -> endpoints it removed (only filters that removed any)."""
    winner_scores: dict[str, float]
    """Scorer name -> the chosen endpoint's value (empty when nothing survived)."""


def apply_filters(
    endpoints: Sequence[EndpointState], q: Query
) -> tuple[list[EndpointState], dict[str, int]]:
    """Endpoints that pass every filter and preference, and how many each dropped.

    Each endpoint is charged to the first filter (in pipeline order) that drops it; a
    preference drops only when at least one survivor satisfies it, and is charged for
    what it drops.
    """
    survivors: list[EndpointState] = []
    drops: dict[str, int] = {}
    for ep in endpoints:
        for name, keep in FILTERS:
            if not keep(ep, q):
                drops[name] = drops.get(name, 0) + 1
                break
        else:
            survivors.append(ep)
    for name, prefer in PREFERENCES:
        preferred = [ep for ep in survivors if prefer(ep, q)]
        if preferred and len(preferred) < len(survivors):
            drops[name] = drops.get(name, 0) + len(survivors) - len(preferred)
            survivors = preferred
    return survivors, drops


_ACTIVE: dict[int, tuple[Weights, tuple[tuple[str, float, Scorer], ...]]] = {}


def _active(weights: Weights) -> tuple[tuple[str, float, Scorer], ...]:
    """The scorers `weights` turns on, with their weights: read once per Weights object
    (a router has one), not five attribute lookups on every request."""
    got = _ACTIVE.get(id(weights))
    if got is None or got[0] is not weights:
        active = tuple(
            (name, float(getattr(weights, name)), scorer)
            for name, scorer in SCORERS
            if getattr(weights, name) != 0
        )
        if len(_ACTIVE) > 64:
            _ACTIVE.clear()  # weights made per call (tests): never a growing cache
        got = _ACTIVE[id(weights)] = (weights, active)
    return got[1]


def load_of(ep: EndpointState) -> float:
    """Requests an endpoint has: this router's own in flight, or what the engine last
    reported running and waiting (all routers' together) when that is more."""
    return max(float(ep.inflight), ep.running + ep.queue_depth)


def costs(survivors: Sequence[EndpointState], q: Query) -> list[tuple[float, int]]:
    """(cost in tokens of prefill, cached tokens followed) of each survivor (`CostModel`)."""
    c = q.cost
    loads = [load_of(ep) for ep in survivors]
    ceiling = min(loads) + c.max_imbalance
    # The families other than the prompt's own: a cache that already holds the prompt's
    # start gains no family by taking it.
    others = [q.families.get(ep.id, 0) - (q.cached_tokens.get(ep.id, 0) > 0) for ep in survivors]
    fewest = min(others)
    out = []
    for ep, load, families in zip(survivors, loads, others, strict=True):
        crowding = c.family_tokens * (families - fewest)
        cached = q.cached_tokens.get(ep.id, 0) if load <= ceiling else 0
        cached = min(max(cached, 0), q.prompt_tokens)
        uncached = q.prompt_tokens - cached
        # Placing the prompt evicts at most what it adds to that cache: its uncached tokens.
        cost = (
            uncached
            + c.running_tokens * load
            + c.waiting_tokens * ep.queue_depth
            + min(crowding, uncached)
        )
        out.append((cost, cached))
    return out


def _rendezvous(key: int, endpoint: str) -> bytes:
    return hashlib.blake2b(key.to_bytes(8, "little") + endpoint.encode(), digest_size=8).digest()


def _by_cost(survivors: list[EndpointState], q: Query, rand: float) -> list[EndpointState]:
    """The survivors cheapest first. Near ties (`agree_tokens`) go by the prompt's tie key;
    without one, exact ties as `rank` breaks them."""
    priced = costs(survivors, q)
    best = min(cost for cost, _ in priced)
    slack = q.cost.agree_tokens if q.tie_key else 0.0
    tied = [i for i, (cost, _) in enumerate(priced) if cost - best <= slack + 1e-9]
    if len(tied) > 1 and q.tie_key:
        tied = [max(tied, key=lambda i: _rendezvous(q.tie_key, survivors[i].id))]
    if len(tied) > 1:
        oldest = min(survivors[i].last_sent for i in tied)
        tied = [i for i in tied if survivors[i].last_sent == oldest]
    first = tied[min(int(rand * len(tied)), len(tied) - 1)]
    rest = sorted((i for i in range(len(survivors)) if i != first), key=lambda i: priced[i][0])
    return [survivors[first], *(survivors[i] for i in rest)]


def rank(endpoints: Sequence[EndpointState], q: Query, weights: Weights, rand: float) -> Ranking:
    """Order the endpoints that may take `q`, best first.

    `rand` in [0, 1) picks among endpoints whose weighted scores tie exactly for
    first place (the common case at idle: all scorers equal). The remaining order
    is by score and is what retries walk. Pure.
    """
    survivors, drops = apply_filters(endpoints, q)
    if not survivors:
        return Ranking(order=[], drops=drops, winner_scores={})
    if len(survivors) == 1:
        return Ranking(order=survivors, drops=drops, winner_scores={})
    if q.prompt_tokens > 0:
        return Ranking(order=_by_cost(survivors, q, rand), drops=drops, winner_scores={})
    n = len(survivors)
    totals = [0.0] * n
    per_scorer: list[tuple[str, list[float]]] = []
    idx = range(n)
    no_prefix = q.prefix_blocks <= 0 or not q.prefix_hits
    for name, w, scorer in _active(weights):
        if (scorer is score_prefix and no_prefix) or (
            scorer is score_session and not q.session_endpoint
        ):
            # Nothing to go by (no prefix, no session): it would score every endpoint 0,
            # which moves no total; its value is still reported.
            per_scorer.append((name, [0.0] * n))
            continue
        values = scorer(survivors, q)
        per_scorer.append((name, values))
        # An index loop, not a new list per scorer: rank runs on every request.
        for i in idx:
            totals[i] += w * values[i]
    best = max(totals)
    tied = [i for i, t in enumerate(totals) if best - t <= 1e-9]
    if len(tied) > 1:
        # Equal scores (an idle fleet): the endpoint sent to longest ago, like round robin,
        # so back-to-back requests do not queue behind each other's engine step; endpoints
        # never sent to (or at the same instant) are picked among by the random number.
        oldest = min(survivors[i].last_sent for i in tied)
        tied = [i for i in tied if survivors[i].last_sent == oldest]
    first = tied[min(int(rand * len(tied)), len(tied) - 1)]
    order = [survivors[first]]
    if n == 2:
        order.append(survivors[1 - first])
    else:
        rest = sorted(range(n), key=totals.__getitem__, reverse=True)
        order.extend(survivors[i] for i in rest if i != first)
    return Ranking(
        order=order,
        drops=drops,
        winner_scores={name: values[first] for name, values in per_scorer},
    )

"""`POST /route` on the router's admin listener: where a request would go, and why.

An operator sends the body of a request, exactly as a client would, and the path the
client would send it to (`?path=`, a path of the front door; without it, a body with
`messages` is taken as a chat's, one with `prompt` as a completion's, one with `input` as
a Responses API request's):

    curl -s 'localhost:9090/route?path=/v1/chat/completions' -d '{"model": "m", "messages": [...]}'

The answer is decided by the front door's own functions (llmgw.router.choice), on the
router's state at that moment, ties drawn from a copy of its generator: `chosen` is the
endpoint (and model: a fallback's, when the model asked has none) the same body sent next
would go to, `order` every endpoint it would try, in order. For the model asked it shows
the prompt's length in tokens as the engine counts them, what each endpoint holds of it
(cached tokens and where that came from: the engines' KV events, this router's recent
routes, its approximate text index), each one's load and cost (llmgw.core.routing.
CostModel), which filters dropped whom, and how the fleet KV index stands. Nothing is sent
to any engine. A session header (the router's `session_header`) is read as the front door
reads it.

It asks what the front door asks: an API key (`Authorization: Bearer ...`) that may use
the model, unless the router takes anonymous requests, and it is one of the key's requests
for its requests/s (llmgw.router.admin), as a request sent would be. Which prompts an
engine holds is a tenant's secret; with a key, /route tells no more than sending the
prompt would, no more often, and under `tenancy.cache_isolation` it shows only the
caller's own tenant's cache: no prefix family counts nor index totals, which are every
tenant's (routing does not count them then either: llmgw.router.choice.cache_plan).
"""

from __future__ import annotations

import random
import time
from typing import Any

import msgspec

from llmgw.core import routing
from llmgw.core.profile import ModelProfile
from llmgw.router import admission, apis, choice, requests
from llmgw.router.attempts import Attempt, Planner
from llmgw.router.auth import Principal
from llmgw.router.dispatch import Dispatcher
from llmgw.router.errors import Refusal, Retry
from llmgw.router.kvroute import CachePlan

NOT_SENT = Retry("explained", 503, "not sent: /route only explains", fault=False)
"""What each attempt /route walks through is told, so that the planner offers the next."""


class ExplainError(ValueError):
    """A body that cannot be explained; the message says what to send."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _api(body: bytes, path: str | None) -> tuple[requests.Kind, str]:
    """The API of a body sent to `path`, or, without one, the API its shape names."""
    if path:
        kind = apis.PATHS.get(path)
        if kind is None:
            raise ExplainError(
                f"?path={path} is not a path the front door serves: send one of "
                + ", ".join(sorted(apis.PATHS))
            )
        return kind, path
    try:
        shape = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise ExplainError(f"the body is not JSON: {exc}") from None
    except RecursionError:
        raise ExplainError("the body nests too deeply to be a request") from None
    if not isinstance(shape, dict):
        raise ExplainError("send a request body (a JSON object)")
    for member, guessed in (("messages", "/v1/chat/completions"), ("prompt", "/v1/completions"),
                            ("input", "/v1/responses")):  # fmt: skip
        if member in shape:
            return apis.PATHS[guessed], guessed
    raise ExplainError(
        "say which API the body is for: ?path= the path a client would send it to"
        " (/v1/chat/completions, /v1/messages, ...)"
    )


def _admitted(
    kind: requests.Kind,
    path: str,
    body: bytes,
    dispatcher: Dispatcher,
    principal: Principal | None,
) -> tuple[requests.Parsed, ModelProfile]:
    """The request `body` and its model's profile, as the front door would admit them for
    `principal`; ExplainError with the front door's status when it would not."""
    try:
        parsed = requests.parse(kind, body, want_text=choice.wants_text(dispatcher.cfg))
    except requests.BadRequest as exc:
        raise ExplainError(str(exc)) from None
    profile = admission.resolve(dispatcher.catalog, parsed.model)
    if isinstance(profile, Refusal):
        raise ExplainError(profile.message, profile.status)
    refused = choice.refusal(dispatcher.cfg, kind, path, principal, parsed, profile)
    if refused is not None:
        raise ExplainError(refused.message, refused.status)
    return parsed, profile


def explain(
    body: bytes,
    dispatcher: Dispatcher,
    principal: Principal | None = None,
    *,
    path: str | None = None,
    session: str = "",
) -> dict[str, Any]:
    """The routing of `body`, sent to `path` with the session header `session`, as it
    would be decided now, for the caller `principal` (None: anonymous, on a router that
    takes anonymous requests). Raises ExplainError, also for a model the caller's key may
    not use: what the engines hold for a prompt is no more to be learnt here than by
    sending it."""
    kind, path = _api(body, path)
    d = dispatcher
    parsed, profile = _admitted(kind, path, body, d, principal)
    now = time.monotonic()
    g = choice.grounds(d, parsed, profile, principal, session, d.clock())
    models, skipped = choice.chain(d, profile, principal, kind, parsed.choices)
    planner, attempts, step, ranked = _walk(d, models, now, g)
    first = attempts[0] if attempts else None
    out: dict[str, Any] = {
        "path": path,
        "model": profile.name,
        "chosen": {"endpoint": first.endpoint.id, "model": first.profile.name} if first else None,
        "order": [a.endpoint.id for a in attempts],
        "attempts": [{"endpoint": a.endpoint.id, "model": a.profile.name} for a in attempts],
        "filtered_out": ranked[profile.name].drops if profile.name in ranked else {},
    }
    if first is None and step is not None:
        out["refused"] = step.message
    if skipped:
        out["fallbacks_skipped"] = [p.name for p in skipped]
    if session:
        out["session_endpoint"] = g.session_endpoint or None
    if d.holds.needed(profile) or d.queues.needed(profile):
        out["waits"] = "it would wait for room first (a replica, or a queue's turn)"
    query = planner.query(profile, now)
    shared = d.cfg.tenancy.cache_isolation == "shared"
    if g.plan is None:
        return {**out, **_by_weights(d, profile.name, query)}
    return {**out, **_by_cost(d, profile.name, g.plan, query, shared)}


def _walk(
    d: Dispatcher, models: list[ModelProfile], now: float, g: choice.Grounds
) -> tuple[Planner, list[Attempt], Refusal | None, dict[str, routing.Ranking]]:
    """The front door's planner over `models` on grounds `g`, walked through every attempt
    it would make at `now` (none is sent), its tie-breaks the ones the next request will
    draw: the planner, its attempts, its refusal once none is left, and each model's
    ranking."""
    ranked: dict[str, routing.Ranking] = {}

    def remember(n: int, prof: ModelProfile, ranking: routing.Ranking) -> None:
        ranked.setdefault(prof.name, ranking)

    draws = random.Random()
    draws.setstate(d.rng.getstate())  # a copy: the router's own draws are left to requests
    planner = choice.planner(d, models, now, g, remember, d.rules.drawing(draws.random))
    attempts: list[Attempt] = []
    step = planner.next(now)
    while isinstance(step, Attempt):
        attempts.append(step)
        planner.failed(NOT_SENT)
        step = planner.next(now)
    return planner, attempts, step, ranked


def _by_cost(
    d: Dispatcher, model: str, plan: CachePlan, q: routing.Query, shared: bool
) -> dict[str, Any]:
    """A model whose prompts the router tokenizes: what each endpoint holds and costs."""
    routable = d.rules.endpoints(model)
    survivors, _ = routing.apply_filters(routable, q)
    priced = dict(zip((ep.id for ep in survivors), routing.costs(survivors, q), strict=True)
                  ) if survivors else {}  # fmt: skip
    with_room = {ep.id for ep in routable}
    rows = []
    for ep in d.table.for_model(model):
        source = plan.by_endpoint.get(ep.id)
        row: dict[str, Any] = {
            "id": ep.id,
            "node": ep.node,
            "cached_tokens": source.cached_tokens if source else 0,
            "source": source.source if source else "none",
            "load": routing.load_of(ep),
            "queue": ep.queue_depth,
            "has_room": ep.id in with_room,
        }
        if shared:  # every tenant's: under isolation, neither shown nor counted
            row["prefix_families"] = plan.families.get(ep.id, 0)
        if ep.id in priced:
            row["cost_tokens"], row["cached_tokens_counted"] = priced[ep.id]
        rows.append(row)
    out: dict[str, Any] = {"tokenized": True, "prompt_tokens": plan.prompt_tokens,
                           "prompt_tokens_keyed": plan.keyed_tokens, "endpoints": rows}  # fmt: skip
    if shared:
        index = d.kv.index
        out["index"] = {"endpoints": len(index.endpoints), "blocks": len(index),
                        "updates_applied": index.applied, "updates_refused": index.refused,
                        "resyncs": index.resyncs,
                        "unlisted_dropped": index.unlisted_dropped}  # fmt: skip
    return out


def _by_weights(d: Dispatcher, model: str, q: routing.Query) -> dict[str, Any]:
    """A model whose prompts the router does not tokenize: the weighted scorers' grounds."""
    return {
        "tokenized": False,
        "why": (
            "the router does not tokenize this request's prompt (no tokenizer: set"
            " `tokenizer` in the model's profile; or an API whose prompt it does not read):"
            " it ranks by weights, with its approximate prefix index"
        ),
        "endpoints": [
            {
                "id": ep.id,
                "prefix_blocks_held": q.prefix_hits.get(ep.id, 0),
                "inflight": ep.inflight,
                "queue": ep.queue_depth,
                "session": ep.id == q.session_endpoint,
            }
            for ep in d.table.for_model(model)
        ],
    }

"""`POST /route` on the router's admin listener: where a prompt would go, and why.

An operator sends the body of a chat or completions request, exactly as a client
would:

    curl -s localhost:9090/route -d '{"model": "m", "messages": [...]}'

and gets, for the model's endpoints: the prompt's length in tokens as the engine
counts them, what each endpoint holds of it (cached tokens and where that came from:
the engines' KV events, this router's recent routes, its approximate text index),
each one's load and cost (llmgw.core.routing.CostModel), which filters dropped whom,
the order the router would try them in now, and how the fleet KV index stands (endpoints,
blocks, updates folded and refused, resyncs after a missed update, endpoints dropped for not
being in the endpoint table on their node). Nothing is sent to any engine.

It asks what the front door asks: an API key (`Authorization: Bearer ...`) that may use
the model, unless the router takes anonymous requests. Which prompts an engine holds is
a tenant's secret; with a key, /route tells no more than sending the prompt would.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from llmgw.core import routing
from llmgw.core.prefix import block_hashes
from llmgw.core.profile import ModelProfile
from llmgw.router import admission, isolation, requests
from llmgw.router.auth import Principal
from llmgw.router.dispatch import Dispatcher
from llmgw.router.errors import Refusal
from llmgw.router.kvroute import salted_hashes
from llmgw.router.table import Catalog


class ExplainError(ValueError):
    """A body that cannot be explained; the message says what to send."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _admitted(
    body: bytes, catalog: Catalog, principal: Principal | None
) -> tuple[requests.Parsed, ModelProfile]:
    """The request `body` and its model's profile, as the front door would admit them for
    `principal`; ExplainError with the front door's status when it would not."""
    try:
        shape = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise ExplainError(f"the body is not JSON: {exc}") from None
    except RecursionError:
        raise ExplainError("the body nests too deeply to be a request") from None
    if not isinstance(shape, dict):
        raise ExplainError("send a chat or completions request body (a JSON object)")
    kind: requests.Kind = "chat" if "messages" in shape else "completions"
    try:
        parsed = requests.parse(kind, body, want_text=True)
    except requests.BadRequest as exc:
        raise ExplainError(str(exc)) from None
    profile = admission.resolve(catalog, parsed.model)
    if isinstance(profile, Refusal):
        raise ExplainError(profile.message)
    refused = admission.admit(principal, parsed.model, profile)
    if refused is not None:
        raise ExplainError(refused.message, refused.status)
    return parsed, profile


def explain(
    body: bytes, catalog: Catalog, dispatcher: Dispatcher, principal: Principal | None = None
) -> dict[str, Any]:
    """The routing of `body` as it would be decided now, for the caller `principal` (None:
    anonymous, on a router that takes anonymous requests). Raises ExplainError, also for a
    model the caller's key may not use: what the engines hold for a prompt is no more to
    be learnt here than by sending it."""
    parsed, profile = _admitted(body, catalog, principal)
    cfg = dispatcher.cfg
    now = time.monotonic()
    endpoints = dispatcher.table.for_model(profile.name)
    # The caller's own view under isolation: the cache its requests would find, no other's.
    salt = isolation.request_salt(cfg.tenancy.cache_isolation, parsed, principal)
    hashes = salted_hashes(
        block_hashes(parsed.text, cfg.prefix.block_chars, cfg.prefix.max_blocks), salt
    )
    plan = dispatcher._cache_plan(parsed, profile, hashes, salt)
    survivors, drops = routing.apply_filters(endpoints, routing.Query(model=profile.name, now=now))
    out: dict[str, Any] = {"model": profile.name, "filtered_out": drops}
    if plan is None:
        return {**out, **_by_weights(dispatcher, profile.name, endpoints, hashes, now)}
    q = routing.Query(model=profile.name, now=now, prompt_tokens=plan.prompt_tokens,
                      cached_tokens=plan.cached, families=plan.families, tie_key=plan.tie_key,
                      cost=cfg.cache.cost)  # fmt: skip
    priced = dict(zip((ep.id for ep in survivors), routing.costs(survivors, q), strict=True))
    rows = []
    for ep in endpoints:
        source = plan.by_endpoint.get(ep.id)
        row: dict[str, Any] = {
            "id": ep.id,
            "node": ep.node,
            "cached_tokens": source.cached_tokens if source else 0,
            "source": source.source if source else "none",
            "load": routing.load_of(ep),
            "prefix_families": plan.families.get(ep.id, 0),
            "queue": ep.queue_depth,
        }
        if ep.id in priced:
            row["cost_tokens"], row["cached_tokens_counted"] = priced[ep.id]
        rows.append(row)
    index = dispatcher.kv.index
    out["tokenized"] = True
    out["prompt_tokens"] = plan.prompt_tokens
    out["prompt_tokens_keyed"] = plan.keyed_tokens
    out["index"] = {"endpoints": len(index.endpoints), "blocks": len(index),
                    "updates_applied": index.applied, "updates_refused": index.refused,
                    "resyncs": index.resyncs,
                    "unlisted_dropped": index.unlisted_dropped}  # fmt: skip
    out["endpoints"] = rows
    out["order"] = [ep.id for ep in routing.rank(endpoints, q, cfg.weights, 0.0).order]
    return out


def _by_weights(
    dispatcher: Dispatcher,
    model: str,
    endpoints: list[routing.EndpointState],
    hashes: list[bytes],
    now: float,
) -> dict[str, Any]:
    """A model whose prompts the router cannot tokenize: the weighted scorers' ranking."""
    text_hits = dispatcher.prefix.match(hashes) if hashes else {}
    q = routing.Query(model=model, now=now, prefix_blocks=len(hashes), prefix_hits=text_hits)
    ranking = routing.rank(endpoints, q, dispatcher.cfg.weights, 0.0)
    return {
        "tokenized": False,
        "why": (
            "the router cannot tokenize this model's prompts (no tokenizer: set `tokenizer` "
            "in its profile): it ranks by weights, with its approximate prefix index"
        ),
        "endpoints": [
            {
                "id": ep.id,
                "prefix_blocks_held": text_hits.get(ep.id, 0),
                "inflight": ep.inflight,
                "queue": ep.queue_depth,
            }
            for ep in endpoints
        ],
        "order": [ep.id for ep in ranking.order],
    }

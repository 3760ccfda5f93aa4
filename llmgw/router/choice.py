"""What decides where a request goes: one path for the front door and for `POST /route`.

The front door (llmgw.router.app, llmgw.router.dispatch) and the admin listener's
`/route` (llmgw.router.explain) both call these functions, so that what /route says of a
body is what the same body gets:

- `refusal`: the front door's answer to a model the key may not use, or whose engine
  does not serve the API;
- `grounds`: what the request is ranked on: its `cache_salt` under
  `tenancy.cache_isolation` (llmgw.router.isolation), the text index's hashes of its
  prompt under that salt, its session's endpoint, and for a model the router can
  tokenize its cache plan (llmgw.router.kvroute);
- `chain` and `planner`: the models it may be served by (its fallbacks the key may use
  and whose engines serve the API) and the attempt planner (llmgw.router.attempts) that
  ranks their endpoints with room.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from llmgw.core.profile import ModelProfile
from llmgw.router import admission, apis, isolation, requests
from llmgw.router.attempts import Planner, RankHook, Rules, fallback_chain
from llmgw.router.auth import Principal
from llmgw.router.config import RouterConfig
from llmgw.router.errors import Refusal
from llmgw.router.kvroute import CachePlan, salted_hashes
from llmgw.router.turns import Turns, chat_text

if TYPE_CHECKING:
    from llmgw.router.dispatch import Dispatcher


class Grounds(msgspec.Struct):
    """What one request is ranked on."""

    salt: str | None
    """The `cache_salt` its engine keys its prompt by."""
    hashes: list[bytes]
    """The text index's hashes of its prompt (llmgw.core.prefix), salted by `salt`."""
    session_key: str
    """What its session header is remembered by ("" without one)."""
    session_endpoint: str
    """Where its session went last ("" nowhere)."""
    plan: CachePlan | None
    """What each endpoint holds of its prompt; None where its tokens cannot be known."""


def wants_text(cfg: RouterConfig) -> bool:
    """Whether anything routes on prompts' text (the prefix scorer, the cache): else the
    front door does not read it."""
    return cfg.weights.prefix > 0 or cfg.cache.enabled


def refusal(
    cfg: RouterConfig, kind: requests.Kind, path: str, principal: Principal | None,
    parsed: requests.Parsed, profile: ModelProfile,
) -> Refusal | None:  # fmt: skip
    """Why the front door of a router of `cfg` refuses a request of API `kind` (at `path`),
    `parsed`, for the model it asks for, or None when it takes it."""
    # The key's permission first: a model it may not use tells it nothing of its engine.
    return admission.admit(principal, parsed.model, profile) or apis.unsupported(
        kind, profile, path, parsed.choices, parsed.choices_field, isolated(cfg)
    )


def isolated(cfg: RouterConfig) -> bool:
    """Whether the router keeps tenants' prefix caches apart (llmgw.router.isolation)."""
    return cfg.tenancy.cache_isolation != "shared"


def grounds(
    d: Dispatcher,
    parsed: requests.Parsed,
    profile: ModelProfile,
    principal: Principal | None,
    session_header: str,
    wall: float,
) -> Grounds:
    """The grounds of a request for `profile`, sent by `principal` with `session_header`
    (the value of the router's `session_header`), as the router's state stands at the
    wall clock's `wall`."""
    cfg, mode = d.cfg, d.cfg.tenancy.cache_isolation
    salt = isolation.request_salt(mode, parsed, principal)
    chat, text = keyed_text(parsed, profile)
    hashes = salted_hashes(d.chat_hashes.hashes(
        chat, text, cfg.prefix.block_chars, cfg.prefix.max_blocks
    ), salt)  # fmt: skip
    key = isolation.session_key(session_header, salt, mode != "shared")
    session_endpoint = d.sessions.get(key, "") if key else ""
    return Grounds(salt, hashes, key, session_endpoint, cache_plan(d, parsed, profile, hashes,
                                                                   salt, wall))  # fmt: skip


def keyed_text(parsed: requests.Parsed, profile: ModelProfile) -> tuple[Turns, str]:
    """The turns and text the text index keys a request by: vLLM's rendering, or the
    model's engine's where the difference would split a conversation's requests
    (llama-server's Messages system, `llmgw.router.llama_turns`)."""
    if profile.engine == "llamacpp" and parsed.llamacpp_chat:
        return parsed.llamacpp_chat, chat_text(parsed.llamacpp_chat)
    return parsed.chat, parsed.text


def cache_plan(
    d: Dispatcher,
    parsed: requests.Parsed,
    profile: ModelProfile,
    hashes: list[bytes],
    salt: str | None,
    wall: float,
) -> CachePlan | None:
    """What each endpoint of the model holds of the prompt (llmgw.router.kvroute), for a
    request the engine gets with `cache_salt` = `salt` (`hashes` salted already). Under
    isolation no prefix families are counted: the index's are every tenant's, and a
    tenant's routing (and /route) must not change with what another has cached."""
    cfg = d.cfg
    if not cfg.cache.enabled or not parsed.text:
        return None
    return d.kv.plan(
        parsed,
        profile,
        d.table.for_model(profile.name),
        text_index=d.prefix,
        text_hashes=hashes,
        block_chars=cfg.prefix.block_chars,
        now=wall,
        salt=salt,
        families=cfg.tenancy.cache_isolation == "shared",
    )


def chain(
    d: Dispatcher, profile: ModelProfile, principal: Principal | None, kind: requests.Kind,
    choices: int = 1,
) -> tuple[list[ModelProfile], list[ModelProfile]]:  # fmt: skip
    """The models a request for `profile` of `choices` answers may be served by, in order,
    and its fallbacks skipped (the key may not use them, or their engines do not serve the
    API, would not count its answers or keep its tenant's cache: llmgw.router.apis.serves)."""
    if not profile.fallbacks:
        return [profile], []
    return fallback_chain(
        profile,
        d.catalog.resolve,
        lambda name, p: (
            admission.may_use(principal, name, p) and apis.serves(kind, p, choices, isolated(d.cfg))
        ),
    )


def planner(
    d: Dispatcher,
    models: list[ModelProfile],
    start: float,
    g: Grounds,
    on_rank: RankHook,
    rules: Rules | None = None,
) -> Planner:
    """The attempt planner of a request that began at `start` (the monotonic clock), over
    the models of its `chain`, ranked on its grounds `g` by `rules` (the router's own
    unless given: /route draws its tie-breaks from a copy of the router's generator)."""
    plan = g.plan
    return Planner(
        models,
        rules if rules is not None else d.rules,
        start,
        len(g.hashes),
        d.prefix.match(g.hashes) if g.hashes else {},
        g.session_endpoint,
        on_rank,
        (plan.model, plan.prompt_tokens, plan.cached, plan.families, plan.tie_key)
        if plan is not None
        else None,
    )

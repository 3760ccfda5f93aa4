"""Tenants' prefix caches kept apart (the router's `tenancy.cache_isolation`).

An engine's prefix cache answers a prompt that begins as a recent one did sooner, and says
so in `usage.prompt_tokens_details.cached_tokens`: across tenants that tells one what the
other sends. vLLM keys cached blocks by a request's `cache_salt` too (folded into its first
block's hash), so requests of different salts share nothing. Isolated, the router sets
every request's salt to its tenant's (llmgw.core.tenancy.cache_salt), whatever the client
sent, and keys the prompt for routing under that salt as well (llmgw.core.kvblocks.
salt_root), so a tenant's requests are routed to its own cached prefixes, never another's.
llama.cpp has no salt: its requests go with `cache_prompt: false` instead.
"""

from __future__ import annotations

import hashlib

from llmgw import logs
from llmgw.core import tenancy
from llmgw.core.profile import ModelProfile
from llmgw.router import requests
from llmgw.router.auth import Principal

log = logs.get("llmgw.router")

SALTED_ENGINES = frozenset({"vllm", "sglang", "sim"})
"""Engines whose requests take a `cache_salt` that keeps their cached blocks to that salt."""
MAX_SESSION_KEY = 128


def request_salt(
    mode: tenancy.CacheIsolation, parsed: requests.Parsed, principal: Principal | None
) -> str | None:
    """The salt the engine keys the request's prompt by: its tenant's when isolated, the
    client's own (or none) when shared."""
    if mode == "shared":
        return parsed.cache_salt
    if principal is None:
        return tenancy.cache_salt(mode, None, "")
    return tenancy.cache_salt(mode, principal.name, principal.settings.team)


def salting(
    mode: tenancy.CacheIsolation, profile: ModelProfile, salt: str | None
) -> requests.Salting:
    """What the body sent to an engine of `profile` gets as its `cache_salt`."""
    if mode == "shared":
        return None
    return salt if profile.engine in SALTED_ENGINES else requests.UNCACHED


def unsalted_models(mode: tenancy.CacheIsolation, profiles: list[ModelProfile]) -> list[str]:
    """The models whose engines cannot keep tenants apart, so they are served uncached."""
    if mode == "shared":
        return []
    return sorted(p.name for p in profiles if p.engine not in SALTED_ENGINES)


def readiness(
    mode: tenancy.CacheIsolation, profiles: list[ModelProfile]
) -> dict[str, object] | None:
    """What `/ready` says of isolation (None under `shared`): shown to the operator's probe
    too, it names the models that pay for isolation with no prefix cache."""
    if mode == "shared":
        return None
    return {"mode": mode, "uncached_models": unsalted_models(mode, profiles)}


def warn_uncached(mode: tenancy.CacheIsolation, profiles: list[ModelProfile]) -> None:
    """One line at start naming the models served without a prefix cache, if any."""
    uncached = unsalted_models(mode, profiles)
    if uncached:
        log.warning("cache_isolation_uncached", models=uncached,
                    hint="these models' engines take no cache_salt: they are served with"
                    " cache_prompt false, with no prefix cache")  # fmt: skip


def session_key(header: str, salt: str | None, isolated: bool) -> str:
    """The key a request's session header is remembered by: a tenant's own under isolation
    (another's equal header must not follow it to its endpoint), hashed when long (keys are
    kept, 100,000 of them: a long header must not cost its length each)."""
    if isolated and header and salt:
        header = salt + "\0" + header
    if len(header) > MAX_SESSION_KEY:
        header = hashlib.blake2b(header.encode(), digest_size=16).hexdigest()
    return header

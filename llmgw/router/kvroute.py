"""Routing to the cache: what each candidate endpoint holds of a request's prompt.

For a model whose tokens the router can compute (llmgw.router.prompts), `KvRouting.plan`
turns the request into the engine's block keys (llmgw.core.kvblocks) and asks, per
candidate endpoint, how many of the prompt's tokens its KV cache holds:

1. the fleet KV index (llmgw.core.kvindex), built from the engines' own events, for
   every endpoint whose updates are fresh and come from its own node: the truth;
2. this router's recent routes, for what an engine received a moment ago and has not
   reported yet;
3. otherwise (an engine that publishes no events, such as llama.cpp, or whose events
   stopped), the router's approximate index of prompt text (llmgw.core.prefix),
   converted to tokens.

Each block size is a pass of hashing over the prompt: it is keyed for the sizes its
candidates' engines use, `kvindex.MAX_PROMPT_BLOCK_SIZES` of them at most
(`kvindex.keyed_sizes`; candidates of other sizes are predicted as in 2 and 3), and for
`DEFAULT_BLOCK_SIZE`, which the recent routes are recorded with.

The planner then ranks by `llmgw.core.routing.CostModel`. `routed` records where an
attempt goes (recent routes, the predicted cached tokens it will be compared with), and
`delivered` what the engine then reported; llmgw.router.explain shows a plan to an
operator.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence

import msgspec

from llmgw.core import routing
from llmgw.core.kvblocks import KEY_ROOT, salt_root
from llmgw.core.kvindex import KvIndex, RecentRoutes
from llmgw.core.prefix import PrefixIndex
from llmgw.core.profile import ModelProfile
from llmgw.core.promptkeys import PromptTokens
from llmgw.router import prompts
from llmgw.router.config import CacheConfig
from llmgw.router.requests import Parsed

RELIABILITY_WEIGHT = 0.1
"""Of the last request, in the moving average of predictions that came true."""
DEFAULT_BLOCK_SIZE = 16
"""The block size keys are recorded with for engines whose size is not known yet (vLLM's
and the sim's default)."""


class Source(msgspec.Struct, frozen=True):
    """Where one endpoint's predicted cached tokens came from."""

    cached_tokens: int
    source: str
    """"events" (the fleet KV index), "recent" (this router's routes), "approximate"
    (prompt text), or "none"."""


class CachePlan(msgspec.Struct, kw_only=True):
    """One request's prompt as the cache sees it, and each candidate's share of it."""

    model: str
    prompt_tokens: int
    """The prompt's tokens (estimated beyond `keyed_tokens`)."""
    keyed_tokens: int = 0
    """Those of them tokenized and keyed: the prompt's first (`cache.max_prompt_chars`)."""
    keys: dict[int, list[int]]
    """Block size -> the prompt's keys for it."""
    root: int = KEY_ROOT
    """The parent of its first key: its `cache_salt`'s (`kvblocks.salt_root`), so a salted
    prompt matches the blocks of its own salt only, as it does on the engine."""
    by_endpoint: dict[str, Source]
    families: dict[str, int] = {}
    """Endpoint -> prefix families its cache holds (from the index, and those this router
    sent there a moment ago)."""

    @property
    def tie_key(self) -> int:
        """The prompt's first block key (the same at every router)."""
        keys = self.keys.get(DEFAULT_BLOCK_SIZE)
        return keys[0] if keys else 0

    @property
    def cached(self) -> dict[str, int]:
        return {ep: s.cached_tokens for ep, s in self.by_endpoint.items()}


class KvRouting:
    """The fleet KV index and this router's recent routes, for every model it can tokenize."""

    def __init__(
        self,
        *,
        index: KvIndex | None = None,
        recent_s: float = 2.0,
        max_prompt_chars: int = prompts.MAX_CHARS,
    ) -> None:
        self.max_prompt_chars = max_prompt_chars
        """How much of a prompt is tokenized (llmgw.router.prompts)."""
        self.index = index if index is not None else KvIndex()
        self.recent = RecentRoutes(window_s=recent_s)
        self.reliability: dict[str, float] = {}
        """Endpoint -> how much of what was predicted cached there the engine then found
        (a moving average): an engine whose cache thrashes gets less credit for it."""

    @classmethod
    def configured(cls, cfg: CacheConfig) -> KvRouting:
        """As a router's `cache` section says."""
        return cls(
            index=KvIndex(stale_after_s=cfg.stale_after_s),
            recent_s=cfg.recent_s,
            max_prompt_chars=cfg.max_prompt_chars,
        )

    def keys_of(self, plan: CachePlan, block_size: int, tokens: PromptTokens) -> list[int]:
        keys = plan.keys.get(block_size)
        if keys is None:
            keys = plan.keys[block_size] = tokens.keys(block_size, plan.root)
        return keys

    def plan(
        self,
        parsed: Parsed,
        profile: ModelProfile,
        endpoints: Sequence[routing.EndpointState],
        *,
        text_index: PrefixIndex | None = None,
        text_hashes: Sequence[bytes] = (),
        block_chars: int = 256,
        now: float | None = None,
        salt: str | None = None,
        families: bool = True,
    ) -> CachePlan | None:
        """The plan of a request, or None where its tokens cannot be known. `salt`: the
        `cache_salt` the engine gets with it (its text hashes already salted the same way:
        `salted_hashes`). `families`: count each endpoint's prefix families (every
        tenant's: the index cannot tell whose a family is)."""
        tokenizer = prompts.for_profile(profile)
        if tokenizer is None:
            return None
        try:
            tokens = tokenizer.tokens(parsed, self.max_prompt_chars)
        except Exception:  # a tokenizer that fails on this input: route without a plan
            return None
        if tokens is None or not tokens.ids:
            return None
        whole = tokens.estimate
        now = time.time() if now is None else now
        plan = CachePlan(model=profile.name, prompt_tokens=whole, keyed_tokens=len(tokens.ids),
                         keys={}, by_endpoint={}, root=salt_root(salt))  # fmt: skip
        depth, sizes = self.index.match(
            lambda size: self.keys_of(plan, size, tokens),
            [(ep.id, ep.node) for ep in endpoints],
            now,
        )
        default_keys = self.keys_of(plan, DEFAULT_BLOCK_SIZE, tokens)
        recent_ep, recent_blocks = self.recent.match(default_keys, now)
        text = text_index.match(text_hashes) if text_index is not None and text_hashes else {}
        chars = len(parsed.text) or 1
        tokens_per_char = whole / chars
        for ep in endpoints:
            n = 0
            source = "none"
            if ep.id in depth:
                n, source = depth[ep.id] * sizes[ep.id], "events"
            elif ep.id in text:
                n = int(text[ep.id] * block_chars * tokens_per_char)
                source = "approximate"
            if ep.id == recent_ep and recent_blocks * DEFAULT_BLOCK_SIZE > n:
                n, source = recent_blocks * DEFAULT_BLOCK_SIZE, "recent"
            n = int(n * self.reliability.get(ep.id, 1.0))
            plan.by_endpoint[ep.id] = Source(min(n, whole), source)
            if families:
                # Families it holds by its events, and those this router just sent there.
                roots = self.index.roots(ep.id, ep.node, now) | self.recent.roots(ep.id, now)
                plan.families[ep.id] = len(roots)
        return plan

    def routed(self, plan: CachePlan, endpoint: routing.EndpointState, now: float) -> int:
        """The request goes to `endpoint`: remember its blocks there; the cached tokens
        predicted for it."""
        keys = plan.keys[DEFAULT_BLOCK_SIZE]
        self.recent.record(keys, endpoint.id, now)
        got = plan.by_endpoint.get(endpoint.id)
        return got.cached_tokens if got is not None else 0

    def delivered(self, endpoint: str, predicted: int, cached: int) -> None:
        """The engine reported `cached` tokens found where `predicted` were expected."""
        if predicted <= 0:
            return
        found = min(cached, predicted) / predicted
        old = self.reliability.get(endpoint, 1.0)
        self.reliability[endpoint] = old + RELIABILITY_WEIGHT * (found - old)

    def forget(self, endpoint: str) -> None:
        self.index.forget(endpoint)
        self.recent.forget(endpoint)
        self.reliability.pop(endpoint, None)


def salted_hashes(hashes: Sequence[bytes], salt: str | None) -> list[bytes]:
    """A prompt's text hashes (llmgw.core.prefix) as a request of `salt` may match them:
    the salt mixed into each, so the text index, like the engines, matches a prompt only to
    prompts of the same salt. Chained hashes stay chained: equal prefixes of one salt give
    equal results."""
    if salt is None:
        return list(hashes)
    key = hashlib.blake2b(salt.encode(), digest_size=32).digest()
    return [hashlib.blake2b(h, digest_size=8, key=key).digest() for h in hashes]

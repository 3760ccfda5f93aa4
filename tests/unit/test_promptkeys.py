"""Reusing the tokens and block keys of prompts seen before (llmgw.core.promptkeys) gives
exactly what tokenizing and keying from scratch gives: the sim's chat parts tokenize
independently, the cache's answers equal the slow path's for any sequence of prompts
sharing prefixes (and through evictions), and so do the router's plans. Likewise the
text index's hashes of chat prompts (llmgw.core.prefix.ChatHashes)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core import kvblocks, promptkeys, routing, simtokens
from llmgw.core.prefix import ChatHashes, block_hashes
from llmgw.core.profile import ModelProfile
from llmgw.core.promptkeys import PromptTokens, SegmentCache
from llmgw.router import prompts
from llmgw.router.kvroute import KvRouting, Source
from llmgw.router.requests import Parsed, parse

# Characters the tokenizer's patterns treat differently, and any others.
TEXT = st.text(
    alphabet=st.one_of(
        st.sampled_from(list(" \n\t\r<|>/_-.!aZ9é\u00a0\u2028\x85\x1c")), st.characters()
    ),
    max_size=60,
)
ROLE = st.sampled_from(["system", "user", "assistant", "tool", "", " x\n"])
MESSAGE = st.tuples(ROLE, TEXT)


def slow_ids(messages: Sequence[tuple[str, str]]) -> list[int]:
    return simtokens.token_ids(simtokens.tokenize(simtokens.render_chat(messages)))


@settings(max_examples=400, deadline=None)
@given(st.lists(MESSAGE, max_size=6))
def test_the_rendered_chat_tokenizes_as_its_parts_one_after_another(
    messages: list[tuple[str, str]],
) -> None:
    parts = [*simtokens.chat_parts(messages), simtokens.GENERATION_PROMPT]
    assert "".join(parts) == simtokens.render_chat(messages)
    assert [t for p in parts for t in simtokens.tokenize(p)] == simtokens.tokenize(
        simtokens.render_chat(messages)
    )


def sim_cache(max_segments: int, max_chars: int, max_parts: int = 64) -> SegmentCache:
    return SegmentCache(
        lambda s: simtokens.token_ids(simtokens.tokenize(s)),
        max_segments=max_segments,
        max_chars=max_chars,
        max_parts=max_parts,
    )


@settings(max_examples=200, deadline=None)
@given(
    pool=st.lists(MESSAGE, min_size=1, max_size=5),
    chats=st.lists(st.lists(st.integers(0, 4), max_size=5), min_size=1, max_size=12),
    sizes=st.lists(st.sampled_from([1, 2, 3, 5, 16]), min_size=1, max_size=3),
    max_segments=st.integers(1, 8),
    max_chars=st.integers(1, 400),
    max_parts=st.integers(1, 6),
)
def test_the_cache_gives_the_ids_and_keys_of_tokenizing_from_scratch(
    pool: list[tuple[str, str]],
    chats: list[list[int]],
    sizes: list[int],
    max_segments: int,
    max_chars: int,
    max_parts: int,
) -> None:
    # Chats drawn from a few messages share prefixes, so later ones hit the cache; its small
    # bounds evict entries between them, and a chat longer than `max_parts` is remembered in
    # part.
    cache = sim_cache(max_segments, max_chars, max_parts)
    for chat in chats:
        messages = [pool[i % len(pool)] for i in chat]
        got = cache.tokens(simtokens.chat_parts(messages), simtokens.GENERATION_PROMPT)
        ids = slow_ids(messages)
        assert got.ids == ids
        for size in sizes:
            assert got.keys(size) == kvblocks.block_keys(ids, size)
        got.ids.append(7)  # a caller's list: the cache's own are untouched
        assert len(cache) <= max_segments
    assert cache.hits + cache.misses == sum(min(len(c), max_parts) for c in chats)


def test_one_prompt_of_many_parts_neither_floods_the_cache_nor_evicts_what_others_share() -> None:
    cache = sim_cache(max_segments=100, max_chars=1_000_000)
    system = ("system", "You are brief. " * 40)
    cache.tokens(simtokens.chat_parts([system, ("user", "a?")]))
    flood = [system, *[("user", "")] * 20_000]
    got = cache.tokens(simtokens.chat_parts(flood), simtokens.GENERATION_PROMPT)
    assert got.ids == slow_ids(flood)
    assert got.keys(16) == kvblocks.block_keys(got.ids, 16)
    assert len(cache) <= 2 + cache.max_parts
    hits = cache.hits
    cache.tokens(simtokens.chat_parts([system, ("user", "b?")]))
    assert cache.hits == hits + 1  # the system prompt is still remembered


def test_keys_kept_for_any_block_sizes_count_against_the_bound() -> None:
    # Block sizes come from what engines report: a cache asked for many keeps keys for a
    # few, and what it keeps is weighed, so its memory stays bounded whatever they are.
    cache = sim_cache(max_segments=10_000, max_chars=20_000)
    for i in range(200):
        got = cache.tokens(simtokens.chat_parts([("user", f"question {i} " * 30)]))
        for size in (1, 2, 3, 5):
            assert got.keys(size) == kvblocks.block_keys(got.ids, size)
    remembered = list(cache._table.values())
    assert all(len(seg.keys) <= promptkeys.SIZES_KEPT for seg in remembered)
    assert cache._weight == sum(seg.weight for seg in remembered)
    one_prompt = max(seg.weight for seg in remembered)
    assert cache._weight <= cache.max_chars + one_prompt


def test_a_seen_prefix_is_neither_tokenized_nor_keyed_again() -> None:
    calls: list[str] = []

    def tokenize(s: str) -> list[int]:
        calls.append(s)
        return simtokens.token_ids(simtokens.tokenize(s))

    cache = SegmentCache(tokenize)
    system = ("system", "You are brief. " * 40)
    first = cache.tokens(simtokens.chat_parts([system, ("user", "a?")]), "<|assistant|>\n")
    first.keys(16)
    calls.clear()
    second = cache.tokens(simtokens.chat_parts([system, ("user", "b?")]), "<|assistant|>\n")
    assert calls == ["<|user|>\nb?\n", "<|assistant|>\n"]
    assert second.keys(16) == kvblocks.block_keys(second.ids, 16)
    assert cache.hits == 1


def test_tokens_without_segments_key_as_block_keys_does() -> None:
    ids = list(range(100))
    assert PromptTokens.of(ids).keys(16) == kvblocks.block_keys(ids, 16)
    assert PromptTokens.of([]).keys(16) == []


class SlowSim:
    """The sim's tokenization, from scratch every time (as the router did before)."""

    def ids(self, parsed: Parsed, max_chars: int = prompts.MAX_CHARS) -> list[int] | None:
        return slow_ids(parsed.chat) if parsed.chat else None

    def tokens(self, parsed: Parsed, max_chars: int = prompts.MAX_CHARS) -> PromptTokens | None:
        ids = self.ids(parsed, max_chars)
        return None if ids is None else PromptTokens.of(ids)


@settings(max_examples=100, deadline=None)
@given(
    pool=st.lists(st.tuples(ROLE, st.text(max_size=200)), min_size=1, max_size=4),
    chats=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), min_size=1, max_size=8),
    held=st.lists(st.integers(0, 7), max_size=3),
)
def test_plans_are_those_of_tokenizing_every_prompt_from_scratch(
    pool: list[tuple[str, str]], chats: list[list[int]], held: list[int]
) -> None:
    profile = ModelProfile(name="m", engine="sim")
    eps = [
        routing.EndpointState(
            id=f"e{i}", url="u", models=frozenset({"m"}), ready=True, node=f"n{i}"
        )
        for i in range(3)
    ]
    fast, slow = KvRouting(), KvRouting()
    cached = prompts.SimPrompts()
    chat_of = [[pool[i % len(pool)] for i in chat] for chat in chats]
    # Each endpoint holds the blocks of some of the chats (block size 16 on two, 4 on one).
    for n, ep in enumerate(eps):
        size = 4 if n == 2 else 16
        stored = [
            k
            for c, messages in enumerate(chat_of)
            if c in held[n : n + 1]
            for k in kvblocks.block_keys(slow_ids(messages), size)
        ]
        update = kvblocks.KvUpdate(
            endpoint=ep.id, model="m", block_size=size, instance="i", seq=1, full=True,
            stored=stored, roots=stored[:1],
        )  # fmt: skip
        fast.index.apply(update, ep.node, 0.0)
        slow.index.apply(update, ep.node, 0.0)
    for t, messages in enumerate(chat_of):
        parsed = Parsed(model="m", stream=False, wants_usage=False, has_options=False,
                        text=simtokens.render_chat(messages), chat=tuple(messages))  # fmt: skip
        with mock.patch.object(prompts, "for_profile", return_value=cached):
            a = fast.plan(parsed, profile, eps, now=1.0 + t)
        with mock.patch.object(prompts, "for_profile", return_value=SlowSim()):
            b = slow.plan(parsed, profile, eps, now=1.0 + t)
        assert a == b
        if a is not None and b is not None:
            # Where each goes, so the recent routes of both stay alike.
            ep = eps[t % 3]
            assert fast.routed(a, ep, 1.0 + t) == slow.routed(b, ep, 1.0 + t)


@settings(max_examples=200, deadline=None)
@given(
    pool=st.lists(st.tuples(ROLE, st.text(max_size=40)), min_size=1, max_size=5),
    chats=st.lists(st.lists(st.integers(0, 4), max_size=6), min_size=1, max_size=10),
    block_chars=st.sampled_from([1, 4, 16]),
    max_blocks=st.sampled_from([0, 2, 8, 128]),
    capacity=st.integers(1, 6),
)
def test_chat_text_hashes_are_those_of_hashing_the_text_from_scratch(
    pool: list[tuple[str, str]],
    chats: list[list[int]],
    block_chars: int,
    max_blocks: int,
    capacity: int,
) -> None:
    cache = ChatHashes(capacity=capacity, max_chars=200)
    for chat in chats:
        messages = tuple(pool[i % len(pool)] for i in chat)
        parsed = parse(
            "chat",
            json.dumps({"model": "m", "messages": [{"role": r, "content": c} for r, c in messages]})
            .encode(),
            want_text=True,
        )  # fmt: skip
        assert parsed.chat == messages
        got = cache.hashes(parsed.chat, parsed.text, block_chars, max_blocks)
        assert got == block_hashes(parsed.text, block_chars, max_blocks)
        got.append(b"x")  # a caller's list: the cache's own are untouched
        assert len(cache) <= capacity
    # Another block size, with the same messages: nothing of the first applies.
    messages = tuple(pool[i % len(pool)] for i in chats[0])
    parsed = parse("chat", json.dumps({"model": "m", "messages": [
        {"role": r, "content": c} for r, c in messages]}).encode(), want_text=True)  # fmt: skip
    assert cache.hashes(parsed.chat, parsed.text, 3, 5) == block_hashes(parsed.text, 3, 5)
    # A prompt that is no chat: its text hashed whole.
    assert cache.hashes((), parsed.text, 3, 5) == block_hashes(parsed.text, 3, 5)
    assert cache.hashes((), "", 3, 5) == []


def test_a_chat_of_many_tiny_messages_is_hashed_exactly_and_remembered_in_part() -> None:
    cache = ChatHashes()
    system = ("system", "You are brief. " * 40)
    flood = (system, *[("user", "")] * 20_000)
    text = "".join(f"{r}\n{c}\n" for r, c in flood)
    assert cache.hashes(flood, text, 16, 100_000) == block_hashes(text, 16, 100_000)
    assert len(cache) == cache.max_messages
    again = (system, ("user", "b?"))
    text = "".join(f"{r}\n{c}\n" for r, c in again)
    assert cache.hashes(again, text, 16, 100_000) == block_hashes(text, 16, 100_000)
    assert len(cache) == cache.max_messages + 1  # the system prompt's entry was reused


def test_a_long_prompts_plan_keys_its_beginning_and_estimates_its_length() -> None:
    """The router keys a prompt's first `max_prompt_chars` characters; the plan's
    `prompt_tokens` (what the cost model prices as prefill) is the whole prompt's,
    estimated, and an endpoint holding the beginning is predicted to hold it."""
    profile = ModelProfile(name="m", engine="sim")
    ep = routing.EndpointState(id="e0", url="u", models=frozenset({"m"}), ready=True, node="n0")
    text = " what is two and two?" * 10_000
    messages = [("user", text)]
    whole = slow_ids(messages)
    kv = KvRouting(max_prompt_chars=2048)
    stored = kvblocks.block_keys(whole, 16)
    kv.index.apply(kvblocks.KvUpdate(endpoint="e0", model="m", block_size=16, instance="i",
                                     seq=1, full=True, stored=stored, roots=stored[:1]),
                   "n0", 0.0)  # fmt: skip
    parsed = Parsed(model="m", stream=False, wants_usage=False, has_options=False,
                    text=simtokens.render_chat(messages), chat=tuple(messages))  # fmt: skip
    with mock.patch.object(prompts, "for_profile", return_value=prompts.SimPrompts()):
        plan = kv.plan(parsed, profile, [ep], now=1.0)
    assert plan is not None
    assert plan.keyed_tokens < 2048 < len(whole)
    assert plan.keys[16] == stored[: plan.keyed_tokens // 16]
    assert 0.95 * len(whole) <= plan.prompt_tokens <= 1.05 * len(whole)
    assert plan.by_endpoint["e0"] == Source(plan.keyed_tokens // 16 * 16, "events")

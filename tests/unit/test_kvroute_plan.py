"""What a router predicts each endpoint's cache holds of a prompt (llmgw.router.kvroute,
over llmgw.core.kvindex): the engines' events where they are fresh and synced, the
router's own recent routes for the one endpoint that just got the prompt, the prompt text
otherwise; and how an engine's reports change its credit. Pure."""

from __future__ import annotations

import pytest

from llmgw.core import kvblocks, routing, simtokens
from llmgw.core.prefix import PrefixIndex, block_hashes
from llmgw.core.profile import ModelProfile
from llmgw.core.promptkeys import PromptTokens
from llmgw.router import prompts
from llmgw.router.kvroute import DEFAULT_BLOCK_SIZE, KvRouting, Source, salted_hashes
from llmgw.router.requests import Parsed

PROFILE = ModelProfile(name="m", engine="sim")
MESSAGES = (("system", "You are a careful assistant. " * 100), ("user", "Two and two?"))
TEXT = simtokens.render_chat(MESSAGES)
PARSED = Parsed(model="m", stream=False, wants_usage=False, has_options=False, text=TEXT,
                chat=MESSAGES)  # fmt: skip


def _ids() -> list[int]:
    return simtokens.token_ids(simtokens.tokenize(TEXT))


def _endpoint(name: str, node: str = "n1") -> routing.EndpointState:
    return routing.EndpointState(id=name, url="u", models=frozenset({"m"}), ready=True, node=node)


def _update(endpoint: str, stored: list[int], *, seq: int = 1, full: bool = True,
            instance: str = "i", roots: list[int] | None = None) -> kvblocks.KvUpdate:  # fmt: skip
    return kvblocks.KvUpdate(endpoint=endpoint, model="m", block_size=DEFAULT_BLOCK_SIZE,
                             instance=instance, seq=seq, full=full, stored=stored,
                             roots=stored[:1] if roots is None else roots)  # fmt: skip


def _keys(salt: str | None = None) -> list[int]:
    return kvblocks.block_keys(_ids(), DEFAULT_BLOCK_SIZE, parent=kvblocks.salt_root(salt))


def _plan(kv: KvRouting, eps: list[routing.EndpointState], now: float = 1.0, **kw: object):  # type: ignore[no-untyped-def]
    plan = kv.plan(PARSED, PROFILE, eps, now=now, **kw)  # type: ignore[arg-type]
    assert plan is not None
    return plan


def test_a_recent_route_counts_for_the_endpoint_it_went_to_only() -> None:
    kv = KvRouting()
    kv.recent.record(_keys()[:3], "a", 1.0)
    plan = _plan(kv, [_endpoint("a"), _endpoint("b")])
    assert plan.by_endpoint["a"] == Source(3 * DEFAULT_BLOCK_SIZE, "recent")
    assert plan.by_endpoint["b"] == Source(0, "none")
    # Past the window it is forgotten.
    later = _plan(kv, [_endpoint("a")], now=1.0 + kv.recent.window_s + 1)
    assert later.by_endpoint["a"] == Source(0, "none")


def test_a_recent_route_counts_only_the_blocks_that_went_to_that_endpoint() -> None:
    kv = KvRouting()
    keys = _keys()
    kv.recent.record(keys[:4], "a", 1.0)
    kv.recent.record(keys[2:4], "b", 1.0)  # a later prompt's blocks 2-3 went to b
    assert kv.recent.match(keys, 1.0) == ("a", 2)


def test_the_engines_events_beat_the_prompt_text() -> None:
    kv = KvRouting()
    kv.index.apply(_update("a", _keys()[:2]), "n1", 1.0)
    hashes = block_hashes(TEXT, 64, 1000)
    text = PrefixIndex()
    text.record(hashes, "a")
    text.record(hashes, "b")
    plan = _plan(kv, [_endpoint("a"), _endpoint("b")], text_index=text, text_hashes=hashes,
                 block_chars=64)  # fmt: skip
    assert plan.by_endpoint["a"] == Source(2 * DEFAULT_BLOCK_SIZE, "events")
    b = plan.by_endpoint["b"]
    assert b.source == "approximate"
    assert plan.prompt_tokens - 64 < b.cached_tokens <= plan.prompt_tokens  # its whole blocks


def test_the_prompt_text_is_converted_to_tokens() -> None:
    kv = KvRouting()
    hashes = block_hashes(TEXT, 64, 1000)[:3]
    text = PrefixIndex()
    text.record(hashes, "b")
    plan = _plan(kv, [_endpoint("b")], text_index=text, text_hashes=hashes, block_chars=64)
    per_char = plan.prompt_tokens / len(TEXT)
    assert per_char < 0.5  # the sim's tokens are words: far fewer than characters
    assert plan.by_endpoint["b"] == Source(int(3 * 64 * per_char), "approximate")


def test_stale_or_unsynced_events_are_not_believed() -> None:
    kv = KvRouting()
    kv.index.apply(_update("a", _keys()[:2]), "n1", 0.0)
    assert _plan(kv, [_endpoint("a")], now=1.0).by_endpoint["a"].source == "events"
    stale = 0.0 + kv.index.stale_after_s + 1
    assert _plan(kv, [_endpoint("a")], now=stale).by_endpoint["a"] == Source(0, "none")
    # Another engine instance's delta: nothing is certain until its full update.
    kv.index.apply(_update("a", _keys()[:3], seq=2, full=False, instance="j"), "n1", 2.0)
    assert _plan(kv, [_endpoint("a")], now=2.0).by_endpoint["a"] == Source(0, "none")


def test_only_held_keys_are_families() -> None:
    kv = KvRouting()
    keys = _keys()
    kv.index.apply(_update("a", keys[:2], roots=[keys[0], 12345]), "n1", 1.0)
    assert kv.index.roots("a", "n1", 1.0) == {keys[0]}


def test_families_count_what_this_router_just_sent_there() -> None:
    kv = KvRouting()
    kv.recent.record(_keys("other")[:2], "a", 1.0)
    kv.index.apply(_update("a", _keys()[:2]), "n1", 1.0)
    assert _plan(kv, [_endpoint("a")]).families == {"a": 2}


def test_a_salted_prompt_matches_only_blocks_of_its_salt() -> None:
    kv = KvRouting()
    kv.index.apply(_update("a", _keys()[:3]), "n1", 1.0)
    kv.index.apply(_update("b", _keys("s1")[:3]), "n2", 1.0)
    eps = [_endpoint("a"), _endpoint("b", "n2")]
    assert _plan(kv, eps, salt="s1").cached == {"a": 0, "b": 3 * DEFAULT_BLOCK_SIZE}
    assert _plan(kv, eps).cached == {"a": 3 * DEFAULT_BLOCK_SIZE, "b": 0}
    hashes = block_hashes(TEXT, 64, 4)
    assert salted_hashes(hashes, None) == hashes
    assert salted_hashes(hashes, "s1") != hashes
    assert salted_hashes(hashes, "s1") != salted_hashes(hashes, "s2")


def test_a_prediction_of_nothing_changes_no_credit_and_forget_forgets_all() -> None:
    kv = KvRouting()
    kv.delivered("a", 0, 500)  # nothing predicted: nothing to learn (and no division)
    assert "a" not in kv.reliability
    kv.delivered("a", 100, 0)
    assert 0 < kv.reliability["a"] < 1
    kv.recent.record(_keys()[:2], "a", 1.0)
    kv.forget("a")
    assert "a" not in kv.reliability
    assert kv.recent.match(_keys(), 1.0) == ("", 0)


def test_a_missed_delta_unsyncs_the_endpoint_until_its_next_full_update() -> None:
    kv = KvRouting()
    keys = _keys()
    kv.index.apply(_update("a", keys[:2]), "n1", 1.0)
    kv.index.apply(_update("a", keys[2:3], seq=3, full=False), "n1", 1.0)  # 2 never came
    assert _plan(kv, [_endpoint("a")]).by_endpoint["a"] == Source(0, "none")
    kv.index.apply(_update("a", keys[:4], seq=4), "n1", 1.0)
    assert _plan(kv, [_endpoint("a")]).by_endpoint["a"] == Source(4 * DEFAULT_BLOCK_SIZE, "events")


class _Tokenizer:
    """A model's tokenizer that makes `ids` of every prompt, or fails."""

    def __init__(self, ids: list[int] | None = None, fails: bool = False) -> None:
        self.got, self.fails = ids, fails

    def tokens(self, parsed: Parsed, max_chars: int) -> PromptTokens | None:
        if self.fails:
            raise ValueError("a template this input breaks")
        return None if self.got is None else PromptTokens.of(self.got)


@pytest.mark.parametrize("tokenizer", [_Tokenizer([]), _Tokenizer(None), _Tokenizer(fails=True)])
def test_a_prompt_of_no_tokens_or_a_failing_tokenizer_is_routed_without_a_plan(
    tokenizer: _Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prompts, "for_profile", lambda profile: tokenizer)
    assert KvRouting().plan(PARSED, PROFILE, [_endpoint("a")], now=1.0) is None


def test_a_route_says_the_cached_tokens_predicted_where_it_went() -> None:
    kv = KvRouting()
    kv.recent.record(_keys()[:3], "a", 1.0)
    plan = _plan(kv, [_endpoint("a"), _endpoint("b")])
    assert kv.routed(plan, _endpoint("a"), 1.0) == 3 * DEFAULT_BLOCK_SIZE
    assert kv.routed(plan, _endpoint("c"), 1.0) == 0  # not a candidate: nothing predicted
    assert kv.recent.match(_keys(), 1.0)[1] == len(_keys())  # the whole prompt went there

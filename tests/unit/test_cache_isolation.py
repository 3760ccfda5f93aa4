"""Prefix-cache isolation: tenants' salts, what the router sends engines, and the keys both
the router and the agent give a salted prompt's blocks."""

from __future__ import annotations

import msgspec
import structlog
from hypothesis import given
from hypothesis import strategies as st

from llmgw.core import kvblocks, tenancy
from llmgw.core.profile import ModelProfile
from llmgw.core.promptkeys import PromptTokens
from llmgw.router import isolation, requests
from llmgw.sim import api, apis
from llmgw.sim.config import SimConfig

names = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)
keys = st.none() | names
modes = st.sampled_from(["team", "key"])


@given(modes, keys, st.text(max_size=12), keys, st.text(max_size=12))
def test_distinct_tenants_never_share_a_salt(
    mode: tenancy.CacheIsolation, key_a: str | None, team_a: str, key_b: str | None, team_b: str
) -> None:
    a, b = tenancy.cache_tenant(mode, key_a, team_a), tenancy.cache_tenant(mode, key_b, team_b)
    salt_a, salt_b = (
        tenancy.cache_salt(mode, key_a, team_a),
        tenancy.cache_salt(mode, key_b, team_b),
    )
    assert (salt_a == salt_b) == (a == b)
    assert salt_a is not None
    assert salt_a.startswith(tenancy.SALT_PREFIX)


def test_a_team_and_a_key_of_one_name_are_two_tenants() -> None:
    assert tenancy.cache_salt("team", "x", "") != tenancy.cache_salt("team", "y", "x")
    assert tenancy.cache_salt("team", "k1", "t") == tenancy.cache_salt("team", "k2", "t")
    assert tenancy.cache_salt("key", "k1", "t") != tenancy.cache_salt("key", "k2", "t")
    assert tenancy.cache_salt("shared", "k1", "t") is None


def _body(salt: object) -> bytes:
    msg = {"role": "user", "content": "hi"}
    return msgspec.json.encode({"model": "m", "messages": [msg], "cache_salt": salt})


@given(modes, names, st.none() | st.text(max_size=20) | st.integers(), st.booleans())
def test_a_client_salt_never_reaches_the_engine(
    mode: tenancy.CacheIsolation, key: str, client: object, llamacpp: bool
) -> None:
    body = _body(client)
    parsed = requests.parse("chat", body, want_text=True)
    salt = isolation.request_salt(mode, parsed, None)
    assert salt == tenancy.cache_salt(mode, None, "")
    profile = ModelProfile(name="m", engine="llamacpp" if llamacpp else "vllm")
    sent = msgspec.json.decode(
        requests.rewrite(
            body, model=None, include_usage=False, salt=isolation.salting(mode, profile, salt)
        )
    )
    if llamacpp:
        assert "cache_salt" not in sent
        assert sent["cache_prompt"] is False
    else:
        assert sent["cache_salt"] == salt != client


def test_shared_passes_a_client_salt_through_and_keys_the_prompt_by_it() -> None:
    parsed = requests.parse("chat", _body("mine"), want_text=True)
    assert isolation.request_salt("shared", parsed, None) == "mine"
    assert isolation.salting("shared", ModelProfile(name="m"), "mine") is None


@given(st.lists(st.integers(0, 1000), min_size=8, max_size=64), st.sampled_from([1, 4, 16]),
       st.none() | names)  # fmt: skip
def test_router_and_agent_key_a_salted_prompt_alike(
    ids: list[int], size: int, salt: str | None
) -> None:
    n = len(ids) // size
    stored = {
        "type": "BlockStored",
        "block_hashes": list(range(1, n + 1)),
        "parent_block_hash": None,
        "token_ids": ids[: n * size],
        "block_size": size,
        "medium": "GPU",
        "extra_keys": [[salt] if salt else None] + [None] * (n - 1),
    }
    batch = msgspec.msgpack.encode({"ts": 1.0, "events": [stored]})
    blocks = kvblocks.EngineBlocks()
    got, _, _ = blocks.apply(kvblocks.decode_batch(batch).events)
    router = PromptTokens.of(ids).keys(size, kvblocks.salt_root(salt))
    assert got == router
    if salt is not None:  # no salted block matches an unsalted prompt's, nor another salt's
        assert not set(got) & set(PromptTokens.of(ids).keys(size))
        other = PromptTokens.of(ids).keys(size, kvblocks.salt_root(salt + "x"))
        assert not set(got) & set(other)


SIM = SimConfig(served_model_names=("m",), max_model_len=256, block_size=4, num_blocks=64)
SIM_BODIES = {
    "chat": (api.prepare_chat, {"messages": [{"role": "user", "content": "hi"}]}),
    "completions": (api.prepare_completion, {"prompt": "hi"}),
    "responses": (apis.prepare_responses, {"input": "hi"}),
    "messages": (
        apis.prepare_messages,
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
    ),
}


@given(st.sampled_from(sorted(SIM_BODIES)), st.none() | names)
def test_the_sim_keeps_every_generation_api_to_its_salt(kind: str, salt: str | None) -> None:
    """The router salts every API's body, as vLLM takes it: a Responses or Messages
    prompt cached unsalted would tell any tenant (`cached_tokens`) what another sent."""
    prepare, fields = SIM_BODIES[kind]
    body = msgspec.json.encode({"model": "m", **fields, "cache_salt": salt})
    assert prepare(body, SIM).salt == salt


@given(st.text(max_size=400), st.text(max_size=400), modes, names, names)
def test_a_session_key_is_bounded_and_its_tenants_own(
    header_a: str, header_b: str, mode: tenancy.CacheIsolation, key_a: str, key_b: str
) -> None:
    """Kept for every session, a key is at most MAX_SESSION_KEY characters whatever its
    header's length; under isolation another tenant's equal header is another key."""
    salt_a, salt_b = tenancy.cache_salt(mode, key_a, ""), tenancy.cache_salt(mode, key_b, "")
    kept_a = isolation.session_key(header_a, salt_a, True)
    assert len(kept_a) <= isolation.MAX_SESSION_KEY
    assert kept_a == isolation.session_key(header_a, salt_a, True)
    if header_a:
        assert (kept_a == isolation.session_key(header_a, salt_b, True)) == (salt_a == salt_b)
    shared = isolation.session_key(header_b, None, False)
    assert len(shared) <= isolation.MAX_SESSION_KEY
    if header_a != header_b:
        assert isolation.session_key(header_a, None, False) != shared


def test_ready_names_the_models_served_without_a_prefix_cache() -> None:
    profiles = [ModelProfile(name=n, engine=e) for n, e in
                [("z", "llamacpp"), ("v", "vllm"), ("a", "llamacpp"), ("s", "sglang")]]  # fmt: skip
    assert isolation.readiness("team", profiles) == {"mode": "team", "uncached_models": ["a", "z"]}
    assert isolation.readiness("shared", profiles) is None


def test_the_router_says_at_start_which_models_go_uncached() -> None:
    profiles = [ModelProfile(name="z", engine="llamacpp"), ModelProfile(name="v", engine="vllm")]
    with structlog.testing.capture_logs() as logged:
        isolation.warn_uncached("key", profiles)
        isolation.warn_uncached("key", profiles[1:])
        isolation.warn_uncached("shared", profiles)
    said = [e for e in logged if e["event"] == "cache_isolation_uncached"]
    assert [e["models"] for e in said] == [["z"]]

"""Prefix-cache isolation through a real router and a real `llmgw sim`: under
`tenancy.cache_isolation: key` a key's repeated prompt is served from the cache, another
key's same prompt is not, even when it sends the first key's salt as its own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest

from llmgw.core import tenancy
from llmgw.router import auth
from tests.integration.router_kit import Router, Sim

pytestmark = pytest.mark.slow

ALICE = auth.new_key()
BOB = auth.new_key()
PROMPT = "a system prompt that only alice sends, long enough for several blocks " * 8


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    tmp: Path = tmp_path_factory.mktemp("router-isolation")
    keys = tmp / "keys.yaml"
    keys.write_text(
        "keys:\n"
        f"  - {{name: alice, sha256: {auth.digest(ALICE)}}}\n"
        f"  - {{name: bob, sha256: {auth.digest(BOB)}}}\n"
    )
    sim = Sim.start("m")
    r = Router.start(
        tmp,
        {"e": sim},
        models=[{"name": "m"}],
        endpoint_models={"e": ["m"]},
        auth={"keys_file": str(keys)},
        tenancy={"cache_isolation": "key"},
    )
    yield r
    r.stop()
    sim.stop()


def _cached(router: Router, key: str, **extra: object) -> int:
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": PROMPT}]}
    r = httpx.post(f"{router.url}/v1/chat/completions", json={**body, **extra},
                   headers={"Authorization": f"Bearer {key}"}, timeout=30)  # fmt: skip
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_a_tenant_finds_its_own_prefix_and_never_another_s(router: Router) -> None:
    alice_salt = tenancy.cache_salt("key", "alice", "")
    assert _cached(router, ALICE) == 0
    assert _cached(router, ALICE) > 0  # the salt reached the engine the same each time
    # Bob sends Alice's salt and his own: the router replaces both with Bob's.
    assert _cached(router, BOB, cache_salt=alice_salt) == 0
    assert _cached(router, BOB, cache_salt="anything") > 0
    assert _cached(router, ALICE, cache_salt="bob-s") > 0


def test_ready_says_the_mode_and_no_model_is_uncached(router: Router) -> None:
    r = httpx.get(f"{router.url}/ready", timeout=10)
    assert r.json()["cache_isolation"] == {"mode": "key", "uncached_models": []}


def test_llama_servers_messages_api_is_refused_under_isolation(tmp_path: Path) -> None:
    """llama-server has no salt: isolated, its requests go with `cache_prompt: false`. Its
    Messages API keeps only its own fields of a body, so that never reached it: through a
    router under `cache_isolation: key`, a Messages request to llama-server (b11434) read
    259 of its 260 prompt tokens from the cache that another request had left. The router
    refuses the Messages API of such a model then, saying what to send instead; its chat
    API, which keeps `cache_prompt`, is relayed."""
    sim = Sim.start("m")
    r = Router.start(tmp_path, {"e": sim}, models=[{"name": "ll", "engine": "llamacpp"}],
                     endpoint_models={"e": ["ll"]}, tenancy={"cache_isolation": "key"})  # fmt: skip
    try:
        turn = [{"role": "user", "content": PROMPT}]
        said = httpx.post(f"{r.url}/v1/messages", timeout=30,
                          json={"model": "ll", "max_tokens": 2, "messages": turn})  # fmt: skip
        assert said.status_code == 400, said.text
        error = said.json()["error"]
        assert error["type"] == "invalid_request_error", error
        assert error["code"] == "unsupported_api", error
        assert "/v1/chat/completions" in error["message"], error
        # The chat API goes to the engine (which, here, serves another model's name).
        chat = httpx.post(f"{r.url}/v1/chat/completions", timeout=30,
                          json={"model": "ll", "max_tokens": 2, "messages": turn})  # fmt: skip
        assert chat.json()["error"]["code"] == "model_not_found", chat.text
    finally:
        r.stop()
        sim.stop()

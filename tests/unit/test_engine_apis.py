"""Which APIs each engine kind serves, as the engines' own route registrations say.

`ENGINE_ROUTES` copies the POST paths each engine registers (among those the router could
relay to): SGLang 0.5.23's python/sglang/srt/entrypoints/http_server.py, llama.cpp b11434's
tools/server/server.cpp. For every engine kind and every path a client may send, the
router relays what the engine has a route for and refuses the rest with a 400 naming the
engines that do serve it; `llmgw sim` has a route for every path it claims to serve.
"""

from __future__ import annotations

import pytest

from llmgw.core.profile import ModelProfile
from llmgw.router import apis
from llmgw.sim.config import SimConfig
from llmgw.sim.server import SimServer

ENGINE_ROUTES: dict[str, frozenset[str]] = {
    "sglang": frozenset(
        {
            "/v1/completions",
            "/v1/chat/completions",
            "/v1/embeddings",
            "/v1/tokenize",
            "/tokenize",
            "/v1/detokenize",
            "/detokenize",
            "/v1/score",
            "/v1/responses",
            "/v1/rerank",
            "/v1/messages",
            "/v1/messages/count_tokens",
        }
    ),
    "llamacpp": frozenset(
        {
            "/completions",
            "/v1/completions",
            "/chat/completions",
            "/v1/chat/completions",
            "/v1/responses",
            "/responses",
            "/v1/messages",
            "/embeddings",
            "/v1/embeddings",
            "/rerank",
            "/reranking",
            "/v1/rerank",
            "/v1/reranking",
            "/tokenize",
            "/detokenize",
            "/v1/messages/count_tokens",
        }
    ),
}
"""Engine kind -> the POST paths its server registers, of those `apis.UPSTREAM` names."""

CASES = [(engine, path) for engine in sorted(ENGINE_ROUTES) for path in sorted(apis.PATHS)]


@pytest.mark.parametrize(("engine", "path"), CASES)
def test_the_router_relays_exactly_what_the_engine_has_a_route_for(engine: str, path: str) -> None:
    kind = apis.PATHS[path]
    profile = ModelProfile(name="x", engine=engine)  # type: ignore[arg-type]
    engine_has_it = apis.UPSTREAM[kind] in ENGINE_ROUTES[engine]
    assert apis.serves(kind, profile) is engine_has_it
    refusal = apis.unsupported(kind, profile, path)
    if engine_has_it:
        assert refusal is None
    else:
        assert refusal is not None
        assert refusal.status == 400
        assert refusal.code == "unsupported_api"
        assert f"runs on {engine}, which does not serve {path}" in refusal.message
        assert "vllm" in refusal.message  # names an engine that does serve it


def test_only_llama_server_lacks_an_api_and_that_api_is_score() -> None:
    lacking = {engine: frozenset(apis.UPSTREAM) - kinds for engine, kinds in apis.SERVED.items()}
    assert lacking == {"vllm": set(), "sim": set(), "sglang": set(), "llamacpp": {"score"}}


def test_the_sim_has_a_route_for_every_path_the_router_relays_to_it() -> None:
    app = SimServer(SimConfig(served_model_names=("m",))).app()
    posts = {
        r.resource.canonical
        for r in app.router.routes()
        if r.method == "POST" and r.resource is not None
    }
    served = {apis.UPSTREAM[kind] for kind in apis.SERVED["sim"]}
    assert served <= posts


@pytest.mark.parametrize("engine", ["vllm", "sglang", "sim", "llamacpp"])
def test_several_answers_are_served_only_where_their_usage_counts_them(engine: str) -> None:
    """llama-server's usage counts one answer of the `n` it generates: a fallback on it is
    skipped for such a request, and the model itself refuses it saying what to send."""
    profile = ModelProfile(name="x", engine=engine)
    assert apis.serves("chat", profile, 1)
    several = apis.serves("chat", profile, 4)
    assert several is (engine != "llamacpp")
    refused = apis.unsupported("chat", profile, "/v1/chat/completions", 4, "n_cmpl")
    assert (refused is None) is several
    if refused is not None:
        assert (refused.status, refused.code) == (400, "answers_not_counted")
        assert "(n_cmpl: 1)" in refused.message

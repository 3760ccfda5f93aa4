"""Every API clients use, through a real router to real `llmgw sim` engines, with the real
`openai` and `anthropic` SDKs: models.retrieve, the Responses API (streamed and not),
Anthropic's Messages API (messages.create, messages.stream and messages.count_tokens),
tokenize and detokenize,
rerank and score. An API the model's engine does not serve is refused saying which do; an
engine's error reaches the client in its API's shape whatever the engine wrote; and no bad
body to any of them is ever a 500.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import anthropic
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.router import apis
from tests.integration.router_kit import Router, Sim

pytestmark = pytest.mark.slow


class _OddEngine(BaseHTTPRequestHandler):
    """An engine that answers every POST with an error in a shape of its own."""

    shapes: ClassVar[dict[str, tuple[int, bytes]]] = {
        "/v1/rerank": (422, b'{"detail":[{"loc":["body","query"],"msg":"field required"}]}'),
        "/tokenize": (400, b'{"object":"error","message":"bad prompt","type":"BadRequest"}'),
        "/v1/messages": (
            400,
            b'{"type":"error","error":{"type":"invalid_request_error",'
            b'"message":"max_tokens: required"}}',
        ),
        "/v1/score": (400, b"plain text failure"),
        "/v1/messages/count_tokens": (
            400,
            b'{"object":"error","message":"messages: required","type":"BadRequestError"}',
        ),
    }

    def do_GET(self) -> None:  # the router's probe
        self.send_response(200)
        self.end_headers()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        status, body = self.shapes.get(self.path, (404, b"not here"))
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    tmp = tmp_path_factory.mktemp("apis")
    sim = Sim.start("m")
    odd = ThreadingHTTPServer(("127.0.0.1", 0), _OddEngine)
    threading.Thread(target=odd.serve_forever, daemon=True).start()
    router = Router.start(
        tmp, {"e1": sim, "odd": f"http://127.0.0.1:{odd.server_address[1]}"},
        models=[{"name": "m", "aliases": ["m-latest"]}, {"name": "sg", "engine": "sglang"},
                {"name": "ll", "engine": "llamacpp"}, {"name": "odd"}],
        endpoint_models={"e1": ["m", "sg", "ll"], "odd": ["odd"]},
    )  # fmt: skip
    try:
        yield router
    finally:
        router.stop()
        sim.stop()
        odd.shutdown()


def post(router: Router, path: str, body: Any) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(router.url + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def test_the_openai_sdk_retrieves_models_and_uses_the_responses_api(fleet: Router) -> None:
    client = openai.AsyncOpenAI(base_url=fleet.url + "/v1", api_key="none", max_retries=0)
    model = await client.models.retrieve("m-latest")
    assert (model.id, model.root) == ("m-latest", "m")  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("nope")
    r = await client.responses.create(model="m", input="hello there", max_output_tokens=8)
    assert r.status == "completed"
    assert r.output_text
    assert r.usage is not None
    assert r.usage.output_tokens == 8
    hi = [{"role": "user", "content": "hi"}]
    stream = await client.responses.create(
        model="m-latest",
        input=hi,
        max_output_tokens=5,
        stream=True,  # type: ignore[arg-type]
    )
    types = [event.type async for event in stream]
    assert types[0] == "response.created"
    assert types[-1] == "response.completed"
    assert types.count("response.output_text.delta") == 5
    metrics = fleet.metrics()
    out = [v for k, v in metrics.items()
           if k.startswith("llmgw_router_tokens_total") and 'direction="out"' in k]  # fmt: skip
    assert sum(out) >= 13, sorted(k for k in metrics if "tokens" in k)


async def test_the_anthropic_sdk_creates_and_streams_messages(fleet: Router) -> None:
    client = anthropic.AsyncAnthropic(base_url=fleet.url, api_key="none", max_retries=0)
    m = await client.messages.create(model="m", max_tokens=6,
                                     messages=[{"role": "user", "content": "hi"}])  # fmt: skip
    assert m.content[0].type == "text"
    assert m.content[0].text
    assert m.usage.output_tokens == 6
    assert m.stop_reason == "max_tokens"
    hi = [{"role": "user", "content": "hi"}]
    async with client.messages.stream(
        model="m",
        max_tokens=7,
        system="be brief",
        messages=hi,  # type: ignore[arg-type]
    ) as s:
        text = "".join([t async for t in s.text_stream])
        final = await s.get_final_message()
    assert text
    assert final.usage.output_tokens == 7
    assert final.usage.input_tokens > 0


async def test_the_anthropic_sdk_counts_a_messages_prompt(fleet: Router) -> None:
    # Claude Code asks for the count before it sends: the same number as the answer's usage.
    client = anthropic.AsyncAnthropic(base_url=fleet.url, api_key="none", max_retries=0)
    talk = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "count these words please"}]  # fmt: skip
    counted = await client.messages.count_tokens(model="m-latest", system="be brief", messages=talk)  # type: ignore[arg-type]
    answer = await client.messages.create(model="m", max_tokens=2, system="be brief", messages=talk)  # type: ignore[arg-type]
    assert counted.input_tokens == answer.usage.input_tokens > 5
    shorter = await client.messages.count_tokens(model="m", messages=talk[:1])  # type: ignore[arg-type]
    assert 0 < shorter.input_tokens < counted.input_tokens
    with pytest.raises(anthropic.NotFoundError) as nf:
        await client.messages.count_tokens(model="nope", messages=talk)  # type: ignore[arg-type]
    assert nf.value.type == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as bad:  # the engine's, in Anthropic's shape
        await client.messages.count_tokens(model="m", messages=[])
    assert bad.value.type == "invalid_request_error"
    assert "at least one message" in str(bad.value)


def test_tokenize_detokenize_rerank_and_score_are_relayed(fleet: Router) -> None:
    status, tok = post(fleet, "/tokenize", {"model": "m", "prompt": "hello world"})
    assert status == 200
    assert tok["count"] == 2
    status, back = post(fleet, "/detokenize", {"model": "m", "tokens": tok["tokens"]})
    assert (status, back["prompt"]) == (200, "hello world")
    ask = {"model": "m", "query": "q", "documents": ["a", "b", "c"], "top_n": 2}
    status, ranked = post(fleet, "/v1/rerank", ask)
    assert status == 200
    assert len(ranked["results"]) == 2
    scores = [r["relevance_score"] for r in ranked["results"]]
    assert scores == sorted(scores, reverse=True)
    status, scored = post(fleet, "/v1/score", {"model": "m", "text_1": "a", "text_2": ["b", "c"]})
    assert status == 200
    assert [d["index"] for d in scored["data"]] == [0, 1]


def test_an_api_the_models_engine_does_not_serve_is_refused_naming_those_that_do(
    fleet: Router,
) -> None:
    # llama-server has no /v1/score (its server.cpp registers none).
    status, body = post(fleet, "/v1/score", {"model": "ll", "text_1": "a", "text_2": ["b"]})
    assert status == 400
    assert body["error"]["code"] == "unsupported_api"
    assert "llamacpp" in body["error"]["message"]
    assert "vllm" in body["error"]["message"]
    assert "sglang" in body["error"]["message"]
    # What an engine serves is relayed (to an engine that, here, knows neither model): SGLang
    # and llama-server both serve the Messages API.
    ask = {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    for model in ("sg", "ll"):
        status, body = post(fleet, "/v1/messages", {**ask, "model": model})
        assert status == 404, body
        assert model in body["error"]["message"]


@pytest.mark.parametrize("path", sorted(_OddEngine.shapes))
def test_an_engines_error_reaches_the_client_in_its_apis_shape(fleet: Router, path: str) -> None:
    status, body = post(fleet, path, {"model": "odd", "max_tokens": 1, "messages": []})
    assert status == _OddEngine.shapes[path][0]
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str)
    assert err["message"]
    if path.startswith("/v1/messages"):  # Anthropic's, with OpenAI's fields besides
        assert body["type"] == "error"
        assert err["type"] == "invalid_request_error"


ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=8,
)  # fmt: skip
BODIES = st.one_of(
    st.binary(max_size=40),
    ANY_JSON.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(st.sampled_from(["model", "input", "messages", "max_tokens", "prompt",
                                     "tokens", "query", "documents", "text_1", "text_2",
                                     "stream", "top_n"]), ANY_JSON, max_size=6).map(
        lambda d: json.dumps({"model": "m", **d} if "model" not in d else d).encode()),
)  # fmt: skip


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(path=st.sampled_from(sorted(set(apis.PATHS) - {"/v1/chat/completions",
                                                     "/v1/completions"})), body=BODIES)  # fmt: skip
def test_no_bad_body_to_any_api_is_a_500(fleet: Router, path: str, body: bytes) -> None:
    req = urllib.request.Request(fleet.url + path, data=body, method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    assert status < 500, (status, raw[:300])
    if status >= 400:
        assert "error" in json.loads(raw)
    else:
        assert raw


class _NoScoreEngine(_OddEngine):
    """An engine without the score API (llama-server's): 404 to every POST."""

    shapes: ClassVar[dict[str, tuple[int, bytes]]] = {}


def test_a_fallback_whose_engine_does_not_serve_the_api_is_not_tried(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # The model asked for serves scoring (vLLM), its fallback does not (llama-server):
    # with the model's endpoint down, the fallback's engine answered 404, and the client
    # read "not found" for a model that exists. The fallback is skipped, as one the key may
    # not use is: the client learns that the model it asked for cannot answer now.
    odd = ThreadingHTTPServer(("127.0.0.1", 0), _NoScoreEngine)
    threading.Thread(target=odd.serve_forever, daemon=True).start()
    router = Router.start(
        tmp_path_factory.mktemp("fallback"),
        {"down": "http://127.0.0.1:9", "ll": f"http://127.0.0.1:{odd.server_address[1]}"},
        models=[{"name": "v", "fallbacks": ["llf"]}, {"name": "llf", "engine": "llamacpp"}],
        endpoint_models={"down": ["v"], "ll": ["llf"]},
    )  # fmt: skip
    try:
        status, body = post(router, "/v1/score", {"model": "v", "text_1": "a", "text_2": ["b"]})
        assert status == 503, body
        assert body["error"]["code"] != "unsupported_api", body
    finally:
        router.stop()
        odd.shutdown()


@pytest.mark.parametrize(
    ("path", "extra", "field"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
        ("/v1/completions", {"prompt": "x", "n_cmpl": 3}, "n_cmpl"),
        ("/v1/responses", {"input": "x", "n": 2}, "n"),
    ],
)  # fmt: skip
def test_several_answers_of_a_llama_server_model_are_refused(
    fleet: Router, path: str, extra: dict[str, Any], field: str
) -> None:
    """llama-server (b11434) generates `n_cmpl` (or `n`) answers, but its usage counts one:
    a whole answer keeps its first answer's usage, and each streamed answer ends with its
    own. Charged what the engine told, a key asking for 8 answers paid for 1. The router
    refuses it, saying what to send instead; a model on another engine is relayed (the
    sim's own refusal of n > 1 here)."""
    status, body = post(fleet, path, {"model": "ll", "max_tokens": 4, **extra})
    assert status == 400, body
    assert body["error"]["code"] == "answers_not_counted", body
    message = body["error"]["message"]
    assert "llamacpp" in message, message
    assert f"{field}: 1" in message, message
    status, body = post(fleet, path, {"model": "m", "max_tokens": 4, **extra})
    assert status == 200 or body["error"]["code"] != "answers_not_counted", body

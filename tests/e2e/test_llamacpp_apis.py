"""The real llama-server has a route for exactly the APIs `apis.SERVED` says it serves.

The router refuses, with a 400, an API the model's engine does not serve, and relays the
rest: a table that says less than the engine serves refuses what it would answer, one that
says more relays to its 404. Here a real llama-server (SmolLM2-135M on the CPU, no
`--embeddings` or `--reranking`, so those two answer 501 "start it with ..." from routes
that exist) is asked each path the router relays to: llama-server answers a path it has
no route for with 404 "File Not Found".

Needs the binary and the model as tests/e2e/test_llamacpp.py does. The last tests send
the Messages and Responses APIs to that llama-server through a real router: a Messages
stream that llama-server begins without its `message_start`, and Responses streams whose
events it sends without their indices.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from llmgw.router import apis
from llmgw.router.requests import Kind
from tests.e2e.llama_kit import GGUF, LLAMA_SERVER, NEEDS_LLAMA_SERVER
from tests.integration.router_kit import Router

pytestmark = NEEDS_LLAMA_SERVER
READY_WITHIN_S = 120.0
"""Generous: it is ready in well under a second here, on a loaded machine much later."""
TALK = [{"role": "user", "content": "hi"}]
BODIES: dict[Kind, dict[str, object]] = {
    "chat": {"messages": TALK, "max_tokens": 1},
    "completions": {"prompt": "hi", "max_tokens": 1},
    "embeddings": {"input": "hi"},
    "responses": {"input": "hi", "max_output_tokens": 1},
    "messages": {"messages": TALK, "max_tokens": 1},
    "count_tokens": {"messages": TALK},
    "tokenize": {"content": "hi"},
    "detokenize": {"tokens": [1]},
    "rerank": {"query": "q", "documents": ["a"]},
    "score": {"text_1": "a", "text_2": ["b"]},
}


@pytest.fixture(scope="module")
def llama_server() -> Iterator[str]:
    assert LLAMA_SERVER is not None
    assert GGUF is not None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [LLAMA_SERVER, "-m", GGUF, "--alias", "smol", "--host", "127.0.0.1",
            "--port", str(port), "-c", "1024", "-np", "1", "-t", "1", "--no-webui"]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def _wait_ready(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + READY_WITHIN_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"llama-server exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)
    pytest.fail(f"llama-server was not ready within {READY_WITHIN_S} s")


def _post(url: str, body: dict[str, object]) -> tuple[int, str]:
    data = json.dumps({"model": "smol", **body}).encode()
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.parametrize("kind", sorted(apis.UPSTREAM))
def test_llama_server_has_a_route_for_an_api_exactly_when_the_router_relays_it(
    llama_server: str, kind: Kind
) -> None:
    status, body = _post(llama_server + apis.UPSTREAM[kind], BODIES[kind])
    has_route = not (status == 404 and "File Not Found" in body)
    assert has_route is (kind in apis.SERVED["llamacpp"]), (status, body[:200])


def test_the_router_relays_a_llama_server_models_messages_and_responses_apis(
    llama_server: str, tmp_path: Path
) -> None:
    # The Messages API (streamed, and its token count, as Claude Code asks them) and the
    # Responses API reach the real engine through a real router and come back whole; the
    # one API llama-server has no route for is refused at the front door.
    router = Router.start(
        tmp_path, {"ll": llama_server}, models=[{"name": "smol", "engine": "llamacpp"}],
        endpoint_models={"ll": ["smol"]},
    )  # fmt: skip
    try:
        # Greedy decoding, the same answer every run.
        talk: Any = [{"role": "user", "content": "Say hello."}]
        claude = anthropic.Anthropic(base_url=router.url, api_key="none", max_retries=0)
        counted = claude.messages.count_tokens(model="smol", messages=talk)
        with claude.messages.stream(
            model="smol", max_tokens=4, messages=talk, extra_body={"temperature": 0}
        ) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert text
        assert final.usage.output_tokens > 0
        assert counted.input_tokens > 0
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
        answer = client.responses.create(
            model="smol", input="Say hello.", max_output_tokens=4, temperature=0
        )
        assert answer.output_text
        events = [e.type for e in client.responses.create(
            model="smol", input="Say hello.", max_output_tokens=4, temperature=0,
            stream=True)]  # fmt: skip
        assert events[-1] == "response.completed"
        status, body = _post(router.url + "/v1/score", BODIES["score"])
        assert status == 400
        assert json.loads(body)["error"]["code"] == "unsupported_api"
    finally:
        router.stop()


EMOJI = [{"role": "user", "content": "Answer with an emoji."}]
"""SmolLM2's greedy answer begins with an emoji, whose first token is part of a character."""


def test_a_messages_stream_whose_first_token_is_part_of_a_character_opens_with_its_message(
    llama_server: str, tmp_path: Path
) -> None:
    # llama-server b11434 sends message_start only with the first token it sends; when the
    # answer's first token is part of a character it sends nothing for it, and the stream
    # begins at content_block_start. Anthropic's SDK fails such a stream; through the router
    # it gets a message_start, with the prompt's tokens estimated, which the key is charged.
    body = {"model": "smol", "max_tokens": 4, "stream": True, "temperature": 0,
            "messages": EMOJI}  # fmt: skip
    status, direct = _post(llama_server + "/v1/messages", body)
    assert status == 200
    assert direct.startswith("event: content_block_start"), direct[:200]  # the engine's fault
    claude = anthropic.Anthropic(base_url=llama_server, api_key="none", max_retries=0)
    stream = claude.messages.stream(model="smol", max_tokens=4, messages=EMOJI,  # type: ignore[arg-type]
                                    extra_body={"temperature": 0})  # fmt: skip
    with pytest.raises(AssertionError), stream as events:  # what the SDK makes of the engine's
        events.get_final_message()
    router = Router.start(
        tmp_path, {"ll": llama_server}, models=[{"name": "smol", "engine": "llamacpp"}],
        endpoint_models={"ll": ["smol"]},
    )  # fmt: skip
    try:
        claude = anthropic.Anthropic(base_url=router.url, api_key="none", max_retries=0)
        with claude.messages.stream(model="smol", max_tokens=4, messages=EMOJI,  # type: ignore[arg-type]
                                    extra_body={"temperature": 0}) as stream:  # fmt: skip
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert text
        assert not text.isascii()
        assert final.model == "smol"
        assert final.usage.output_tokens == 4
        assert final.usage.input_tokens > 0  # the router's estimate of the prompt's
        m = router.metrics()
        assert m['llmgw_router_tokens_total{direction="in",model="smol"}'] == (
            final.usage.input_tokens)  # fmt: skip
        assert m['llmgw_router_tokens_total{direction="out",model="smol"}'] == 4
    finally:
        router.stop()


def _sdk_stream(client: openai.OpenAI, prompt: str) -> tuple[str, int, list[str]]:
    """The `openai` SDK's accumulated Responses stream: its text, output tokens, events."""
    with client.responses.stream(
        model="smol", input=prompt, max_output_tokens=6, temperature=0
    ) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_response()
    assert final.usage is not None
    return final.output_text, final.usage.output_tokens, events


def test_a_llama_server_responses_stream_reaches_the_sdks_accumulator_whole(
    llama_server: str, tmp_path: Path
) -> None:
    # llama-server b11434 names a Responses event's item only by item_id: the SDK's
    # responses.stream() fails at the first text delta (no content_index). Through the
    # router each event carries its indices and a sequence number, and an answer whose
    # first token is part of a character (for which the engine repeats response.created
    # with every chunk) has one response.created.
    direct = openai.OpenAI(base_url=llama_server + "/v1", api_key="none", max_retries=0)
    with pytest.raises(TypeError):
        _sdk_stream(direct, "Say hello.")
    raw = direct.responses.create(model="smol", input="Answer with an emoji.",
                                  max_output_tokens=6, temperature=0, stream=True)  # fmt: skip
    assert [e.type for e in raw].count("response.created") > 1  # the engine's fault
    router = Router.start(
        tmp_path, {"ll": llama_server}, models=[{"name": "smol", "engine": "llamacpp"}],
        endpoint_models={"ll": ["smol"]},
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
        text, tokens, events = _sdk_stream(client, "Say hello.")
        assert (
            text
            == direct.responses.create(
                model="smol", input="Say hello.", max_output_tokens=6, temperature=0
            ).output_text
        )
        assert tokens == 6
        assert events[-1] == "response.completed"
        text, tokens, events = _sdk_stream(client, "Answer with an emoji.")
        assert not text.isascii()
        assert events.count("response.created") == 1
        assert events.count("response.in_progress") == 1
        numbered = client.responses.create(
            model="smol",
            input="Answer with an emoji.",
            max_output_tokens=6,
            temperature=0,
            stream=True,
        )
        assert [e.sequence_number for e in numbered] == list(range(len(events)))
    finally:
        router.stop()

"""What users of the `openai` and `anthropic` SDKs send through a real router to real
`llmgw sim` engines, and what each SDK makes of the answer when something goes wrong: a
stream cut by its engine, an error that comes after keep-alive comments began the stream,
an error in Anthropic's words, an engine that stalls after a stream's opening events; what
the router counts of a stream's usage, which each API repeats in its own way; a key in
Anthropic's `x-api-key` header; and a Messages stream that ends as vLLM's does, with [DONE].
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import anthropic
import openai
import pytest
from aiohttp import web

from llmgw.router import auth
from tests.integration.router_kit import Router, Sim
from tests.kit.threaded_http import ThreadedApp, engine_app

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "hi"}]
KEEPALIVE_S = 0.2


class Fleet(NamedTuple):
    router: Router
    sim: Sim


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One sim behind one router that sends keep-alive comments every KEEPALIVE_S; its
    breaker never opens (the tests fail the engine on purpose)."""
    tmp: Path = tmp_path_factory.mktemp("sdk-compat")
    sim = Sim.start("m", "--eos-min-tokens", "4", "--eos-max-tokens", "8")
    router = Router.start(
        tmp, {"e1": sim}, keepalive_s=KEEPALIVE_S, breaker={"failures_to_open": 1000}
    )
    try:
        yield Fleet(router, sim)
    finally:
        router.stop()
        sim.stop()


@pytest.fixture
def claude(fleet: Fleet) -> Iterator[anthropic.Anthropic]:
    client = anthropic.Anthropic(base_url=fleet.router.url, api_key="none", max_retries=0)
    yield client
    fleet.sim.clear_faults()
    client.close()


def test_a_messages_stream_cut_by_its_engine_raises_in_the_anthropic_sdk(
    fleet: Fleet, claude: anthropic.Anthropic
) -> None:
    # The anthropic SDK reads only events named `error` as errors: a bare `data:` error
    # it skips, and the cut stream looked like a whole message with no stop_reason.
    fleet.sim.faults(die_mid_stream=True, after_tokens=3, count=1)
    with (
        pytest.raises(anthropic.APIStatusError, match="broke off"),
        claude.messages.stream(model="m", max_tokens=20, messages=HI) as stream,  # type: ignore[arg-type]
    ):
        for _ in stream.text_stream:
            pass
    fleet.sim.faults(die_mid_stream=True, after_tokens=3, count=1)
    events = claude.messages.create(model="m", max_tokens=20, messages=HI, stream=True)  # type: ignore[arg-type]
    with pytest.raises(anthropic.APIStatusError, match="broke off"):
        for _ in events:
            pass


def test_an_engine_error_after_keepalives_raises_in_the_anthropic_sdk(
    fleet: Fleet, claude: anthropic.Anthropic
) -> None:
    # Keep-alive comments began the stream as a 200: the engine's 400 can only be an event.
    fleet.sim.faults(stall_at="headers", stall_s=4 * KEEPALIVE_S, fail_status=400, count=1)
    events = claude.messages.create(model="m", max_tokens=5, messages=HI, stream=True)  # type: ignore[arg-type]
    with pytest.raises(anthropic.APIStatusError, match="injected failure"):
        for _ in events:
            pass


def test_messages_errors_come_in_anthropics_shape_with_its_types(
    fleet: Fleet, claude: anthropic.Anthropic
) -> None:
    # Anthropic's clients branch on `error.type` (the SDK's `APIStatusError.type`), in
    # Anthropic's words: a 404 is `not_found_error`, not OpenAI's `invalid_request_error`.
    with pytest.raises(anthropic.NotFoundError) as nf:  # the router's own refusal
        claude.messages.create(model="nope", max_tokens=5, messages=HI)  # type: ignore[arg-type]
    assert nf.value.type == "not_found_error"
    assert isinstance(nf.value.body, dict)
    assert nf.value.body["type"] == "error"
    assert "does not exist" in nf.value.body["error"]["message"]
    assert nf.value.body["error"]["code"] == "model_not_found"  # OpenAI's field, kept
    with pytest.raises(anthropic.BadRequestError) as bad:  # the engine's, in OpenAI's shape
        claude.messages.create(model="m", max_tokens=5, messages=[])
    assert bad.value.type == "invalid_request_error"
    assert isinstance(bad.value.body, dict)
    assert bad.value.body["type"] == "error"
    assert "at least one message" in bad.value.body["error"]["message"]
    fleet.sim.faults(die_mid_stream=True, after_tokens=2, count=1)
    events = claude.messages.create(model="m", max_tokens=20, messages=HI, stream=True)  # type: ignore[arg-type]
    with pytest.raises(anthropic.APIStatusError) as cut:  # the error event of a cut stream
        for _ in events:
            pass
    assert cut.value.type == "api_error"


def tokens(router: Router) -> tuple[float, float]:
    """The router's counted prompt and completion tokens of model m."""
    m = router.metrics()
    return (m.get('llmgw_router_tokens_total{direction="in",model="m"}', 0.0),
            m.get('llmgw_router_tokens_total{direction="out",model="m"}', 0.0))  # fmt: skip


def test_a_messages_streams_tokens_are_counted_once(
    fleet: Fleet, claude: anthropic.Anthropic
) -> None:
    # message_start holds the prompt's tokens; message_delta the totals, the prompt's again
    # (vLLM's, and Anthropic's own since 2025): counting both counted the prompt twice.
    before = tokens(fleet.router)
    with claude.messages.stream(model="m", max_tokens=6, messages=HI) as stream:  # type: ignore[arg-type]
        final = stream.get_final_message()
    assert final.usage.input_tokens > 0
    after = tokens(fleet.router)
    assert (after[0] - before[0], after[1] - before[1]) == (
        final.usage.input_tokens, final.usage.output_tokens)  # fmt: skip


def _chunk(doc: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


async def _continuous(request: web.Request) -> web.StreamResponse:
    """vLLM's `stream_options.continuous_usage_stats`: every chunk carries the usage so far."""
    body = await request.json()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    head = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": body["model"]}
    for n in range(1, 4):
        choice = {"index": 0, "delta": {"content": f" t{n}"}, "finish_reason": None}
        usage = {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n}
        await resp.write(_chunk({**head, "choices": [choice], "usage": usage}))
    usage = {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
    await resp.write(_chunk({**head, "choices": [], "usage": usage}) + b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def test_a_stream_with_usage_in_every_chunk_is_counted_once(tmp_path: Path) -> None:
    engine = ThreadedApp(engine_app(_continuous))
    router = Router.start(tmp_path, {"e": engine.url})
    try:
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
        options = {"include_usage": True, "continuous_usage_stats": True}
        chunks = list(client.chat.completions.create(
            model="m", messages=HI, stream=True, stream_options=options))  # type: ignore[arg-type,call-overload]  # fmt: skip
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 3
        assert tokens(router) == (10.0, 3.0)  # was (40, 9): each chunk's totals added up
    finally:
        router.stop()
        engine.stop()


def test_a_key_sent_as_anthropics_x_api_key_header_is_taken(
    fleet: Fleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Anthropic's API takes its key as `x-api-key`, and its clients (Claude Code, the SDKs
    # before they sent Bearer too, curl from Anthropic's docs) send it so.
    for name in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    key = auth.new_key()
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n" + auth.entry_yaml("k", key))
    router = Router.start(tmp_path, {"e1": fleet.sim}, auth={"keys_file": str(keys)})
    try:
        client = anthropic.Anthropic(base_url=router.url, api_key=None, max_retries=0,
                                     default_headers={"x-api-key": key})  # fmt: skip
        m = client.messages.create(model="m", max_tokens=3, messages=HI)  # type: ignore[arg-type]
        assert m.usage.output_tokens > 0
        wrong = client.with_options(default_headers={"x-api-key": "wrong"})
        with pytest.raises(anthropic.AuthenticationError):
            wrong.messages.create(model="m", max_tokens=3, messages=HI)  # type: ignore[arg-type]
        models = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0,
                               default_headers={"Authorization": "", "x-api-key": key})  # fmt: skip
        assert [m.id for m in models.models.list()] == ["m"]
    finally:
        router.stop()


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_a_stream_that_opened_but_sent_no_token_moves_to_another_engine(
    tmp_path: Path, api: str
) -> None:
    # Messages and Responses streams open with events that hold no token yet (message_start,
    # content_block_start; response.created, ...), as the chat stream opens with its role
    # chunk: held back like it, so the first-token deadline still covers the wait and a
    # stalled engine's request moves on. Counted as the first token, they pinned the request
    # to the stalled engine until idle_s, 30 s, and the client got nothing.
    sims = {f"s{i}": Sim.start("m", "--eos-min-tokens", "4", "--eos-max-tokens", "8")
            for i in range(2)}  # fmt: skip
    router = Router.start(
        tmp_path, dict(sims), weights={"prefix": 0, "session": 5},
        models=[{"name": "m", "deadlines": {"first_token_s": 1.0, "idle_s": 30.0}}],
    )  # fmt: skip
    try:
        session = {"X-Session-Id": f"conversation-{api}"}
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0,
                               default_headers=session, timeout=10.0)  # fmt: skip
        client.chat.completions.create(model="m", messages=HI, max_tokens=2)  # type: ignore[arg-type]
        sent = router.endpoint_requests()
        pinned = max(sent, key=lambda ep: sent[ep])  # the session's engine, from here on
        sims[pinned].faults(stall_at="first_token", stall_s=5, count=1)
        if api == "messages":
            claude = anthropic.Anthropic(base_url=router.url, api_key="none", max_retries=0,
                                         default_headers=session, timeout=10.0)  # fmt: skip
            with claude.messages.stream(model="m", max_tokens=5, messages=HI) as stream:  # type: ignore[arg-type]
                text = "".join(stream.text_stream)
                done = stream.get_final_message().stop_reason
        else:
            events = list(client.responses.create(model="m", input="hi", max_output_tokens=5,
                                                  stream=True))  # fmt: skip
            text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            done = events[-1].type
        assert text
        assert done in ("max_tokens", "end_turn", "response.completed")
        assert sorted(router.endpoint_requests().values()) == [1.0, 2.0]  # moved once
    finally:
        router.stop()
        for sim in sims.values():
            sim.stop()


def _event(name: str, doc: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(doc)}\n\n".encode()


async def _vllm_messages(request: web.Request) -> web.StreamResponse:
    """A Messages stream as vLLM's converter writes it (vllm/entrypoints/anthropic/
    serving.py): an event per write, and the chat stream's `data: [DONE]` after
    message_stop."""
    body = await request.json()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    usage = {"input_tokens": 9, "output_tokens": 0}
    message = {
        "id": "chatcmpl-1",
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": body["model"],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }
    events: list[tuple[str, dict[str, Any]]] = [
        ("message_start", {"message": message}),
        ("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "Hello"}}),
        ("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": " there"}}),
        ("content_block_stop", {"index": 0}),
        (
            "message_delta",
            {"delta": {"stop_reason": "end_turn"}, "usage": {**usage, "output_tokens": 2}},
        ),
        ("message_stop", {}),
    ]
    for name, doc in events:
        await resp.write(_event(name, {"type": name, **doc}))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def test_a_vllm_messages_stream_that_ends_with_done_is_whole(tmp_path: Path) -> None:
    # vLLM ends a Messages stream with [DONE] after message_stop: the router took it for a
    # stream cut short (its last event is not message_stop) and ended it with an error
    # event, which the anthropic SDK raises, after the whole message.
    app = engine_app(_continuous)
    app.router.add_post("/v1/messages", _vllm_messages)
    engine = ThreadedApp(app)
    router = Router.start(tmp_path, {"e": engine.url})
    try:
        claude = anthropic.Anthropic(base_url=router.url, api_key="none", max_retries=0)
        with claude.messages.stream(model="m", max_tokens=5, messages=HI) as stream:  # type: ignore[arg-type]
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert text == "Hello there"
        assert final.stop_reason == "end_turn"
    finally:
        router.stop()
        engine.stop()


def test_the_anthropic_sdk_reads_the_request_id_of_every_answer(
    fleet: Fleet, claude: anthropic.Anthropic
) -> None:
    # Anthropic's API names its id `request-id` (the SDK's `_request_id`, an error's
    # `request_id`); the router's is `X-Request-Id`: a Messages answer carries both.
    raw = claude.messages.with_raw_response.create(model="m", max_tokens=5, messages=HI)  # type: ignore[arg-type]
    rid = raw.headers["x-request-id"]
    assert rid
    assert raw.headers["request-id"] == rid
    assert raw.parse()._request_id == rid
    raw = claude.messages.with_raw_response.create(
        model="m",
        max_tokens=5,
        messages=HI,
        stream=True,  # type: ignore[arg-type]
    )
    assert raw.headers["request-id"] == raw.headers["x-request-id"] != rid
    for _ in raw.parse():
        pass
    with pytest.raises(anthropic.NotFoundError) as nf:  # the router's own refusal
        claude.messages.create(model="nope", max_tokens=5, messages=HI)  # type: ignore[arg-type]
    assert nf.value.request_id
    assert nf.value.request_id == nf.value.response.headers["x-request-id"]
    fleet.sim.faults(fail_status=500, count=1)  # an answer from the engine's error
    with pytest.raises(anthropic.APIStatusError) as failed:
        claude.messages.create(model="m", max_tokens=5, messages=HI)  # type: ignore[arg-type]
    assert failed.value.request_id == failed.value.response.headers["x-request-id"]
    # The OpenAI API's answers keep to OpenAI's header (its SDK reads `x-request-id`).
    with openai.OpenAI(base_url=fleet.router.url + "/v1", api_key="none", max_retries=0) as gpt:
        chat = gpt.chat.completions.with_raw_response.create(model="m", max_tokens=5, messages=HI)  # type: ignore[arg-type]
        assert chat.headers["x-request-id"] == chat.parse()._request_id
        assert "request-id" not in chat.headers


def test_engines_all_answering_429_is_a_429_with_retry_after(fleet: Fleet) -> None:
    with openai.OpenAI(base_url=fleet.router.url + "/v1", api_key="none", max_retries=0) as gpt:
        fleet.sim.faults(fail_status=429, count=3)
        with pytest.raises(openai.RateLimitError) as busy:
            gpt.chat.completions.create(model="m", max_tokens=5, messages=HI)  # type: ignore[arg-type]
        assert busy.value.response.headers["retry-after"] == "1"
        assert busy.value.body["type"] == "rate_limit_error"  # type: ignore[index]
        fleet.sim.clear_faults()
        fleet.sim.faults(fail_status=503, count=3)  # an engine's failure: no hint to wait
        with pytest.raises(openai.InternalServerError) as failed:
            gpt.chat.completions.create(model="m", max_tokens=5, messages=HI)  # type: ignore[arg-type]
        assert failed.value.status_code == 502
        assert "retry-after" not in failed.value.response.headers
        fleet.sim.clear_faults()


async def _slow_pretty(request: web.Request) -> web.Response:
    """An engine that answers a stream request late, with a whole pretty-printed JSON body:
    a 400 for a prompt of "bad", else a completion."""
    import asyncio

    body = await request.json()
    await asyncio.sleep(4 * KEEPALIVE_S)  # the router's keep-alive comments began the stream
    if body["messages"][0]["content"] == "bad":
        doc: dict[str, Any] = {"error": {"message": "bad\n\nprompt", "type": "BadRequestError",
                                         "param": None, "code": 400}}  # fmt: skip
        return web.Response(status=400, text=json.dumps(doc, indent=2) + "\n",
                            content_type="application/json")  # fmt: skip
    doc = {"id": "cmpl-pretty", "object": "chat.completion.chunk", "created": 1, "model": "m",
           "choices": [{"index": 0, "delta": {"role": "assistant", "content": "whole"},
                        "finish_reason": "stop"}]}  # fmt: skip
    return web.Response(text=json.dumps(doc, indent=2), content_type="application/json")


def test_a_pretty_printed_answer_after_keepalives_reaches_the_sdk_whole(tmp_path: Path) -> None:
    # Relayed as one `data:` event with its line breaks as they were, the body's blank
    # lines ended the event early: the SDK read half a JSON document.
    engine = ThreadedApp(engine_app(_slow_pretty))
    router = Router.start(tmp_path, {"e": engine.url}, keepalive_s=KEEPALIVE_S)
    try:
        with openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0) as gpt:
            chunks = list(gpt.chat.completions.create(model="m", messages=HI, stream=True))  # type: ignore[arg-type]
            assert [c.id for c in chunks] == ["cmpl-pretty"]
            assert chunks[0].choices[0].delta.content == "whole"
            bad = [{"role": "user", "content": "bad"}]
            with pytest.raises(openai.APIError, match="bad\n\nprompt"):
                for _ in gpt.chat.completions.create(model="m", messages=bad, stream=True):  # type: ignore[arg-type]
                    pass
    finally:
        router.stop()
        engine.stop()


def _llama_responses_events() -> list[dict[str, Any]]:
    """A llama-server (b11434) Responses stream as its server-task.cpp writes one:
    reasoning, text and two function calls, items named only by `item_id`, no index."""
    resp = {"id": "resp_1", "object": "response", "status": "in_progress"}
    opening = [{"type": "response.created", "response": resp},
               {"type": "response.in_progress", "response": resp}]  # fmt: skip
    rs = {"id": "rs_1", "summary": [], "type": "reasoning", "content": [],
          "encrypted_content": "", "status": "in_progress"}  # fmt: skip
    msg = {"content": [], "id": "msg_1", "role": "assistant", "status": "in_progress",
           "type": "message"}  # fmt: skip
    text = {"type": "output_text", "annotations": [], "logprobs": [], "text": "Hi there"}
    calls = [{"id": f"fc_{c}", "arguments": "", "call_id": f"call_{c}", "name": "look",
              "type": "function_call", "status": "in_progress"} for c in "ab"]  # fmt: skip
    whole = [{**rs, "status": "completed", "content": [{"type": "reasoning_text",
                                                        "text": "hmm"}]},
             {**msg, "status": "completed", "content": [text]},
             *({**c, "status": "completed", "arguments": '{"q":1}'} for c in calls)]  # fmt: skip
    usage = {"input_tokens": 5, "output_tokens": 9, "total_tokens": 14,
             "input_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    return [
        *opening, {"type": "response.output_item.added", "item": rs},
        {"type": "response.reasoning_text.delta", "delta": "hmm", "item_id": "rs_1"},
        {"type": "response.output_item.added", "item": msg},
        {"type": "response.content_part.added", "item_id": "msg_1",
         "part": {"type": "output_text", "text": ""}},
        {"type": "response.output_text.delta", "item_id": "msg_1", "delta": "Hi"},
        *opening,  # as after a first token that was part of a character
        {"type": "response.output_text.delta", "item_id": "msg_1", "delta": " there"},
        *(e for c in calls for e in (
            {"type": "response.output_item.added", "item": c},
            {"type": "response.function_call_arguments.delta", "delta": '{"q":',
             "item_id": c["id"]},
            {"type": "response.function_call_arguments.delta", "delta": "1}",
             "item_id": c["id"]})),
        {"type": "response.output_item.done", "item": whole[0]},
        {"type": "response.output_text.done", "item_id": "msg_1", "text": "Hi there"},
        {"type": "response.content_part.done", "item_id": "msg_1", "part": text},
        *({"type": "response.output_item.done", "item": item} for item in whole[1:]),
        {"type": "response.completed", "response": {
            **resp, "status": "completed", "created_at": 0, "model": "m", "output": whole,
            "usage": usage}},
    ]  # fmt: skip


async def _llama_responses(request: web.Request) -> web.StreamResponse:
    """The stream above, written in reads that cut events anywhere."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    body = b"".join(
        f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in _llama_responses_events()
    )
    for at in range(0, len(body), 97):
        await resp.write(body[at : at + 97])
    await resp.write_eof()
    return resp


@pytest.mark.parametrize("engine", ["llamacpp", "vllm"])
def test_a_llama_server_responses_stream_reaches_the_sdk_whole(tmp_path: Path, engine: str) -> None:
    # llama-server's Responses events carry no output_index or content_index, which the
    # SDK's responses.stream() places every event by; the router adds them (and drops the
    # repeated response.created) for llama-server models, and only for them.
    app = engine_app(_continuous)
    app.router.add_post("/v1/responses", _llama_responses)
    canned = ThreadedApp(app)
    router = Router.start(tmp_path, {"e": canned.url}, models=[{"name": "m", "engine": engine}])
    try:
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
        stream = client.responses.stream(model="m", input="hi")
        if engine != "llamacpp":
            with pytest.raises((TypeError, RuntimeError)), stream as events:  # the SDK fails it
                events.get_final_response()
            return
        with stream as events:
            types = [e.type for e in events]
            final = events.get_final_response()
        assert types.count("response.created") == 1
        assert final.output_text == "Hi there"
        assert [o.type for o in final.output] == [
            "reasoning", "message", "function_call", "function_call"]  # fmt: skip
        assert [o.arguments for o in final.output if o.type == "function_call"] == [
            '{"q":1}', '{"q":1}']  # fmt: skip
        assert tokens(router) == (5.0, 9.0)
    finally:
        router.stop()
        canned.stop()

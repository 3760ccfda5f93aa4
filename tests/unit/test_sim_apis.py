"""The sim's Anthropic Messages and OpenAI Responses wire formats in process
(llmgw.sim.apis, .bodies): what a prompt is made of, the bodies and the streamed events
with their order, sequence numbers, stop reasons and usage, as vLLM sends them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from llmgw.core import simtokens as tokens
from llmgw.sim import api, apis, bodies
from tests.unit.test_sim_api import CFG


def _events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each SSE event."""
    out = []
    for block in raw.split(b"\n\n")[:-1]:
        name, data = block.split(b"\n")
        out.append(
            (name.removeprefix(b"event: ").decode(), json.loads(data.removeprefix(b"data: ")))
        )
    return out


def _messages(**kw: Any) -> bytes:
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **kw}
    return json.dumps(body).encode()


@pytest.mark.parametrize(("finish", "reason"), [("length", "max_tokens"), ("stop", "end_turn")])
def test_a_messages_answer_has_anthropics_shape(finish: str, reason: str) -> None:
    p = apis.prepare_messages(_messages(), CFG)
    body = json.loads(apis.full_body(p, "r1", 5, "hello", finish, (7, 3, 2)))
    assert body == {
        "id": "msg_r1", "type": "message", "role": "assistant", "model": "m",
        "content": [{"type": "text", "text": "hello"}], "stop_reason": reason,
        "stop_sequence": None,
        "usage": {"input_tokens": 7, "output_tokens": 3, "cache_read_input_tokens": 2},
    }  # fmt: skip


def test_a_streamed_messages_answer_sends_anthropics_events_in_order() -> None:
    p = apis.prepare_messages(_messages(stream=True), CFG)
    fmt = apis.MessagesFormat(p, "r1", 5, 7)
    raw = (
        fmt.opening() + fmt.pieces(["a", "b"]) + fmt.closing("length", apis.messages_usage(7, 2, 0))
    )
    got = _events(raw)
    assert [name for name, _ in got] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    assert all(data["type"] == name for name, data in got)
    start = got[0][1]["message"]
    assert (start["id"], start["model"], start["usage"]) == (
        "msg_r1", "m", {"input_tokens": 7, "output_tokens": 0}
    )  # fmt: skip
    assert [d["delta"]["text"] for n, d in got if n == "content_block_delta"] == ["a", "b"]
    delta = got[5][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"] == {"input_tokens": 7, "output_tokens": 2}


def test_a_streamed_responses_answer_numbers_its_events_and_ends_with_the_whole() -> None:
    p = apis.prepare_responses(b'{"model": "m", "input": "hi", "stream": true}', CFG)
    fmt = apis.ResponsesFormat(p, "r1", 5)
    use = apis.responses_usage(7, 2, 1)
    raw = fmt.opening() + fmt.pieces(["a", "b"]) + fmt.closing("stop", use)
    got = _events(raw)
    assert [name for name, _ in got] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [data["sequence_number"] for _, data in got] == list(range(len(got)))
    done = got[-1][1]["response"]
    assert done["status"] == "completed"
    assert done["output"][0]["content"][0]["text"] == "ab"
    assert done["usage"] == {
        "input_tokens": 7, "output_tokens": 2, "total_tokens": 9,
        "input_tokens_details": {"cached_tokens": 1},
        "output_tokens_details": {"reasoning_tokens": 0},
    }  # fmt: skip


def test_a_responses_prompt_is_its_instructions_then_its_input() -> None:
    body = b'{"model": "m", "input": "hi", "instructions": "be brief"}'
    p = apis.prepare_responses(body, CFG)
    assert p.prompt == tokens.tokenize(tokens.render_chat([("system", "be brief"), ("user", "hi")]))


def test_a_messages_prompt_keeps_an_empty_message_and_counts_as_its_count_tokens() -> None:
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""},
            {"role": "user", "content": [{"type": "text", "text": "go"}]}]  # fmt: skip
    p = apis.prepare_messages(_messages(messages=msgs, system="sys", stop_sequences=["x"]), CFG)
    assert p.prompt == tokens.tokenize(
        tokens.render_chat([("system", "sys"), ("user", "hi"), ("assistant", ""), ("user", "go")])
    )
    assert p.stops == ("x",)
    counted = json.loads(apis.count_tokens(_messages(messages=msgs, system="sys"), CFG))
    assert counted == {"input_tokens": len(p.prompt)}


@pytest.mark.parametrize("max_tokens", [0, -1])
def test_a_messages_request_for_no_tokens_is_refused(max_tokens: int) -> None:
    with pytest.raises(api.ApiError, match="max_tokens"):
        apis.prepare_messages(_messages(max_tokens=max_tokens), CFG)


def test_openai_usage_counts_the_total_and_the_cached_prompt() -> None:
    assert bodies.usage(7, 3, 2) == {
        "prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 2},
    }  # fmt: skip
    p = api.prepare_chat(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}', CFG)
    opening = json.loads(bodies.StreamFormat(p, "r1", 5).opening().removeprefix(b"data: "))
    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_tokenize_takes_a_prompt_or_messages_and_detokenize_gives_the_text_back() -> None:
    doc = json.loads(apis.tokenize(b'{"model": "m", "prompt": "a b"}', CFG))
    assert doc["count"] == len(doc["tokens"]) == len(tokens.tokenize("a b"))
    assert doc["max_model_len"] == 64
    back = apis.detokenize(json.dumps({"model": "m", "tokens": doc["tokens"]}).encode(), CFG)
    assert json.loads(back) == {"prompt": "a b"}
    both = {"model": "m", "prompt": "a", "messages": [{"role": "user", "content": "a"}]}
    for body in ({"model": "m"}, both):
        with pytest.raises(api.ApiError) as info:
            apis.tokenize(json.dumps(body).encode(), CFG)
        assert info.value.param == "prompt"


def test_rerank_puts_the_most_relevant_first_and_keeps_top_n() -> None:
    docs = ["blue sky", "red apple", "green apple pie", "a car"]
    body = {"model": "m", "query": "red apple", "documents": docs}
    results = json.loads(apis.rerank(json.dumps(body).encode(), CFG, "r1")[0])["results"]
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    assert (results[0]["index"], results[0]["document"]["text"]) == (1, "red apple")
    assert sorted(r["index"] for r in results) == [0, 1, 2, 3]
    top = json.loads(apis.rerank(json.dumps({**body, "top_n": 2}).encode(), CFG, "r1")[0])
    assert top["results"] == results[:2]
    with pytest.raises(api.ApiError) as info:
        apis.rerank(json.dumps({**body, "top_n": 0}).encode(), CFG, "r1")
    assert info.value.param == "top_n"

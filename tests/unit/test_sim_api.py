"""The sim's OpenAI wire format in-process: validation, SSE framing, embeddings, config."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core import simtokens as tokens
from llmgw.sim import api, bodies
from llmgw.sim.config import Faults, LatencyModel, SimConfig

CFG = SimConfig(served_model_names=("m", "alias"), max_model_len=64, block_size=4, num_blocks=32)


def chat(**kw: Any) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}
    return json.dumps(body).encode()


def test_a_valid_chat_request_is_prepared() -> None:
    p = api.prepare_chat(
        chat(max_completion_tokens=5, stop="x", seed=3, stream=True,
             stream_options={"include_usage": True}, some_future_field=1),
        CFG,
    )  # fmt: skip
    assert (p.kind, p.model, p.max_tokens, p.stops, p.seed) == ("chat", "m", 5, ("x",), 3)
    assert p.stream
    assert p.include_usage
    assert "".join(p.prompt) == tokens.render_chat([("user", "hi")])


def test_max_tokens_defaults_to_what_the_context_leaves() -> None:
    p = api.prepare_completion(b'{"model": "alias", "prompt": "a b c"}', CFG)
    assert p.max_tokens == 64 - 3
    assert p.model == "alias"


def test_prompt_and_output_fill_the_context_exactly() -> None:
    """vLLM's rule: the prompt and the output together fit max_model_len (64 here), and a
    prompt that fills it leaves no room for even one token."""

    def completion(n: int, **kw: Any) -> bytes:
        return json.dumps({"model": "m", "prompt": list(range(n)), **kw}).encode()

    assert api.prepare_completion(completion(60, max_tokens=4), CFG).max_tokens == 4
    assert api.prepare_completion(completion(63), CFG).max_tokens == 1
    for body in (completion(60, max_tokens=5), completion(64)):
        with pytest.raises(api.ApiError) as info:
            api.prepare_completion(body, CFG)
        assert info.value.code == "context_length_exceeded"


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{", 400, "invalid_json"),
        (b"   ", 400, "invalid_json"),
        (b"[]", 400, "invalid_value"),
        (chat(model="zzz"), 404, "model_not_found"),
        (b'{"messages": [{"role": "user", "content": "x"}]}', 404, "model_not_found"),
        (chat(max_tokens=0), 400, None),
        (chat(max_tokens=60), 400, "context_length_exceeded"),
        (chat(n=3), 400, "unsupported_parameter"),
        (chat(logprobs=True), 400, "unsupported_parameter"),
        (chat(response_format={"type": "json_schema"}), 400, "unsupported_parameter"),
        (chat(max_tokens="ten"), 400, "invalid_value"),
        (chat(temperature=5), 400, None),
        (chat(messages=[]), 400, None),
        (chat(messages=[{"role": "wizard", "content": "x"}]), 400, None),
        (chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
         "unsupported_parameter"),
        (chat(messages=[{"role": "user", "content": "word " * 70}]), 400,
         "context_length_exceeded"),
    ],
)  # fmt: skip
def test_bad_chat_requests_say_what_is_wrong(body: bytes, status: int, code: str | None) -> None:
    with pytest.raises(api.ApiError) as info:
        api.prepare_chat(body, CFG)
    assert info.value.status == status
    assert info.value.code == code
    doc = json.loads(info.value.body())
    assert set(doc["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    "fields",
    [{"temperature": 0}, {"temperature": 2}, {"top_p": 1}, {"frequency_penalty": -2},
     {"presence_penalty": 2}, {"stop": [f"s{i}" for i in range(16)]}, {"n": 1}],
)  # fmt: skip
def test_the_edges_of_what_openai_accepts_are_accepted(fields: dict[str, Any]) -> None:
    api.prepare_chat(chat(**fields), CFG)


@pytest.mark.parametrize(
    "fields",
    [{"temperature": -0.01}, {"temperature": 2.01}, {"top_p": 0}, {"top_p": 1.01},
     {"frequency_penalty": -2.01}, {"presence_penalty": 2.01},
     {"stop": [f"s{i}" for i in range(17)]}, {"n": 2}],
)  # fmt: skip
def test_just_beyond_them_is_refused_naming_the_parameter(fields: dict[str, Any]) -> None:
    with pytest.raises(api.ApiError) as info:
        api.prepare_chat(chat(**fields), CFG)
    assert info.value.status == 400
    assert info.value.param == next(iter(fields))


def test_an_empty_stop_string_stops_nothing() -> None:
    assert api.prepare_chat(chat(stop=["", "x"]), CFG).stops == ("x",)
    assert api.prepare_chat(chat(stop=""), CFG).stops == ()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ["a"] * 2049}, "input"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "dimensions": 257}, "dimensions"),
        ({"input": [[1, -1]]}, "input"),
    ],
)
def test_embeddings_beyond_their_bounds_are_refused(body: dict[str, Any], param: str) -> None:
    with pytest.raises(api.ApiError) as info:
        api.embeddings(json.dumps({"model": "m", **body}).encode(), CFG)
    assert info.value.status == 400
    assert info.value.param == param
    one, _ = api.embeddings(b'{"model": "m", "input": [[1, 0]], "dimensions": 1}', CFG)
    assert len(json.loads(one)["data"][0]["embedding"]) == 1


def test_wrong_types_name_the_parameter() -> None:
    with pytest.raises(api.ApiError) as info:
        api.prepare_chat(chat(max_tokens="ten"), CFG)
    assert info.value.param == "max_tokens"


@settings(max_examples=400)
@given(st.binary(max_size=300) | st.text(max_size=200).map(str.encode))
def test_any_body_is_prepared_or_refused_with_a_4xx(body: bytes) -> None:
    refused: list[int] = []
    for fn in (api.prepare_chat, api.prepare_completion, api.embeddings):
        try:
            fn(body, CFG)
        except api.ApiError as exc:
            refused.append(exc.status)
    assert all(400 <= status < 500 for status in refused)


@given(st.lists(st.text(), max_size=5), st.sampled_from(["chat", "completion"]))
def test_stream_chunks_are_valid_json_for_any_text(texts: list[str], kind: str) -> None:
    prepare = api.prepare_chat if kind == "chat" else api.prepare_completion
    body = chat() if kind == "chat" else b'{"model": "m", "prompt": "p"}'
    p = prepare(body, CFG)
    fmt = bodies.StreamFormat(p, 'id-"quoted"', 123)
    raw = fmt.opening() + fmt.pieces(texts) + fmt.closing("stop", bodies.usage(3, len(texts), 0))
    events = raw.split(b"\n\n")
    assert events[-1] == b""
    assert events[-2] == b"data: [DONE]"
    docs = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
    got = [
        d["choices"][0]["delta"].get("content") if kind == "chat" else d["choices"][0]["text"]
        for d in docs
        if d["choices"] and d["choices"][0]["finish_reason"] is None
    ]
    if kind == "chat":
        assert got == ["", *texts]
    else:
        assert got == texts
    assert docs[-1]["usage"]["completion_tokens"] == len(texts)
    assert all(d["id"] == 'id-"quoted"' for d in docs)


def test_embeddings_are_deterministic_and_normalised() -> None:
    body, n = api.embeddings(b'{"model": "m", "input": ["a b", "a b", "c"]}', CFG)
    doc = json.loads(body)
    vecs = [d["embedding"] for d in doc["data"]]
    assert vecs[0] == vecs[1] != vecs[2]
    assert abs(sum(v * v for v in vecs[0]) - 1.0) < 1e-9
    assert n == doc["usage"]["prompt_tokens"] == 5
    assert api.embed(["x"], 8) == api.embed(["x"], 8)


def test_default_config_is_usable_and_bad_ones_say_what_to_change() -> None:
    assert SimConfig().problems() == []
    problems = SimConfig(
        served_model_names=(),
        num_blocks=2,
        eos_min_tokens=10,
        eos_max_tokens=5,
        latency=LatencyModel(decode_base_ms=-1),
        faults=Faults(fail_status=200),
    ).problems()
    text = " | ".join(problems)
    assert "--served-model-name" in text
    assert "raise --num-blocks or lower --max-model-len" in text
    assert "eos_min_tokens" in text
    assert "latency" in text
    assert "fail_status" in text
    assert "lower --block-size" in " ".join(SimConfig(block_size=20_000).problems())


@pytest.mark.parametrize(
    ("setting", "flag"),
    [("num_blocks", "--num-blocks"), ("embedding_dim", "--embedding-dim")],
)
def test_sizes_the_sim_allocates_are_bounded(setting: str, flag: str) -> None:
    # Each block is an object made at start (10**12 of them filled the machine's memory
    # before the sim listened); an embedding is a list of embedding_dim floats per input.
    problems = SimConfig(**{setting: 10**12, "max_model_len": 16}).problems()
    assert any(setting in p and flag in p for p in problems), problems
    big = {"num_blocks": 1 << 20, "embedding_dim": 65_536}[setting]
    assert SimConfig(**{setting: big}).problems() == []


def test_latency_model() -> None:
    lat = LatencyModel(decode_base_ms=2, decode_per_seq_ms=0.5, prefill_per_token_ms=0.1)
    assert lat.step_s(4, 100) == pytest.approx(0.014)
    assert not lat.zero
    assert LatencyModel().zero


@pytest.mark.parametrize(
    ("prepare", "body", "param"),
    [
        (api.prepare_chat, chat(functions=[{"name": "f"}]), "tools"),
        (api.prepare_chat, chat(tool_choice="required"), "tool_choice"),
        (api.prepare_chat, chat(response_format={"type": "json_object"}), "response_format"),
        (api.prepare_completion, b'{"model": "m", "prompt": "p", "echo": true}', "echo"),
        (api.prepare_completion, b'{"model": "m", "prompt": "p", "suffix": "s"}', "suffix"),
        (api.prepare_completion, b'{"model": "m", "prompt": "p", "best_of": 2}', "best_of"),
    ],
)
def test_what_the_sim_cannot_do_is_refused_as_unsupported(
    prepare: Any, body: bytes, param: str
) -> None:
    with pytest.raises(api.ApiError) as info:
        prepare(body, CFG)
    assert (info.value.status, info.value.code, info.value.param) == (
        400, "unsupported_parameter", param
    )  # fmt: skip


def test_a_chat_prompt_is_rendered_as_vllm_renders_it() -> None:
    """Every chat role, a message's text parts joined by a newline, and
    max_completion_tokens over the deprecated max_tokens."""
    msgs = [
        {"role": "developer", "content": "d"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""},
                                     {"type": "text", "text": "b"}]},
        {"role": "tool", "content": None},
    ]  # fmt: skip
    p = api.prepare_chat(chat(messages=msgs, max_tokens=9, max_completion_tokens=2), CFG)
    assert p.prompt == tokens.tokenize(
        tokens.render_chat([("developer", "d"), ("user", "a\nb"), ("tool", "")])
    )
    assert p.max_tokens == 2

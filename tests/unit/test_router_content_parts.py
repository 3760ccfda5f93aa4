"""A message whose content is a list of text parts is rendered as the engine renders it.

Cache-aware routing predicts the engine's cached prefix from the prompt it renders, so the
router must join a message's parts exactly as the engine does: vLLM (and `llmgw sim`,
which stands in for it) gives a text-only chat template the non-empty texts with a newline
between two, for a chat, a Messages and a Responses request alike; the Messages API's
`system` blocks are concatenated. A single part is its text, as a string is.
"""

from __future__ import annotations

import tracemalloc
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core.prefix import ChatHashes
from llmgw.core.profile import ModelProfile
from llmgw.core.simtokens import token_ids
from llmgw.router import prompts, requests, turns
from llmgw.sim import api as sim_api
from llmgw.sim import apis as sim_apis
from llmgw.sim.config import SimConfig

TEXT = st.text(alphabet=st.sampled_from("ab1 \n\t?.é-_<|>"), max_size=60)
PARTS = st.lists(TEXT, max_size=6)
SIM = prompts.for_profile(ModelProfile(name="m", engine="sim"))
SIM_CFG = SimConfig(served_model_names=("m",), max_model_len=1_000_000)


def blocks(texts: list[str], kind: str = "text") -> list[dict[str, str]]:
    return [{"type": kind, "text": t} for t in texts]


def chat(system: str, turns: list[tuple[str, list[str]]]) -> bytes:
    said = [{"role": "system", "content": system}] if system else []
    said += [{"role": role, "content": blocks(texts)} for role, texts in turns]
    return msgspec.json.encode({"model": "m", "messages": said})


def sim_ids(kind: str, body: bytes) -> list[int]:
    prepare = {
        "chat": sim_api.prepare_chat,
        "messages": sim_apis.prepare_messages,
        "responses": sim_apis.prepare_responses,
    }[kind]
    return token_ids(prepare(body, SIM_CFG).prompt)


def router_ids(kind: requests.Kind, body: bytes) -> list[int]:
    assert SIM is not None
    return list(SIM.ids(requests.parse(kind, body, want_text=True)) or [])


ROLES = st.sampled_from(["user", "assistant"])
TURNS = st.lists(st.tuples(ROLES, PARTS), min_size=1, max_size=4)


@settings(max_examples=300)
@given(system=TEXT, system_parts=PARTS, turns=TURNS)
def test_any_parts_are_rendered_and_tokenized_as_the_engine_does(
    system: str, system_parts: list[str], turns: list[tuple[str, list[str]]]
) -> None:
    """For any text parts, the router's prompt tokens are the sim engine's, whichever API."""
    body = chat(system, turns)
    rendered = [(role, "\n".join(t for t in texts if t)) for role, texts in turns]
    said = requests.parse("chat", body, want_text=True).chat
    assert list(said) == ([("system", system)] if system else []) + rendered
    assert router_ids("chat", body) == sim_ids("chat", body)
    responses = msgspec.json.encode({"model": "m", "instructions": system or None, "input": [
        {"role": role, "content": blocks(texts, "input_text")} for role, texts in turns
    ]})  # fmt: skip
    assert router_ids("responses", responses) == sim_ids("responses", responses)
    messages: dict[str, Any] = {"model": "m", "max_tokens": 4, "messages": [
        {"role": role, "content": blocks(texts)} for role, texts in turns
    ]}  # fmt: skip
    if system_parts:
        messages["system"] = blocks(system_parts)
    body = msgspec.json.encode(messages)
    if any(any(texts) for _, texts in turns):  # else no message is rendered: no prompt
        assert router_ids("messages", body) == sim_ids("messages", body)


def turn_texts(kind: requests.Kind, doc: dict[str, Any]) -> list[str]:
    return [text for _, text in requests.parse(kind, msgspec.json.encode(doc), want_text=True).chat]


def test_a_messages_parts_are_joined_as_vllm_joins_them() -> None:
    """vLLM's chat rendering for a text-only template, of a message's parts:

        text_prompt = "\\n".join(texts)

    after `if parse_res: content.append(parse_res)` (an empty text adds nothing). Its
    Anthropic Messages API concatenates the system blocks:

        system_prompt += block.text

    and turns a message's text blocks into chat parts (one alone into the string)."""
    parts = blocks(["Hello", "", "world"])
    chat_doc = {"model": "m", "messages": [{"role": "user", "content": parts}]}
    assert turn_texts("chat", chat_doc) == ["Hello\nworld"]
    responses = {
        "model": "m",
        "input": [{"role": "user", "content": blocks(["a", "b"], "input_text")}],
    }
    assert turn_texts("responses", responses) == ["a\nb"]
    messages = {"model": "m", "system": blocks(["be ", "brief"]),
                "messages": [{"role": "user", "content": parts}]}  # fmt: skip
    assert turn_texts("messages", messages) == ["be brief", "Hello\nworld"]


def test_a_messages_api_message_of_no_text_is_left_out_as_vllm_does() -> None:
    """vLLM skips a Messages API message whose blocks give it no content (`continue`)."""
    doc = {"model": "m", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": blocks(["", ""])},
        {"role": "user", "content": []},
        {"role": "user", "content": "again"},
    ]}  # fmt: skip
    assert turn_texts("messages", doc) == ["hi", "again"]
    body = msgspec.json.encode(doc | {"max_tokens": 4})
    assert router_ids("messages", body) == sim_ids("messages", body)


@given(text=TEXT)
def test_a_single_part_is_keyed_as_its_string(text: str) -> None:
    """The text index's hashes of a one-part message are those of its text as a string."""
    bodies = [
        {"model": "m", "messages": [{"role": "user", "content": c}]} for c in (text, blocks([text]))
    ]
    parsed = [requests.parse("chat", msgspec.json.encode(b), want_text=True) for b in bodies]
    assert parsed[0].chat == parsed[1].chat
    hashes = [ChatHashes().hashes(p.chat, p.text, 16, 64) for p in parsed]
    assert hashes[0] == hashes[1]


def test_a_chat_messages_string_parts_are_text_parts_as_vllm_reads_them() -> None:
    """vLLM's chat takes a string among a message's parts as a text part:

        if isinstance(part, str):  # Handle plain text parts

    and reads only a text part's `text` (not an image part's). The router routes such a
    body, keyed as the engine renders it, instead of refusing it."""
    parts = ["Hello", {"type": "image_url", "image_url": {"url": "x"}, "text": "not read"}, "you"]
    doc = {"model": "m", "messages": [{"role": "user", "content": parts}]}
    assert turn_texts("chat", doc) == ["Hello\nyou"]
    messages = {"model": "m", "messages": [{"role": "user", "content": ["", "hi"]}]}
    assert turn_texts("messages", messages) == ["hi"]


TINY = 200_000
"""Parts of a hostile body: a few megabytes, within the router's default `max_body_bytes`."""


@pytest.mark.parametrize("kind", ["chat", "messages", "responses"])
@pytest.mark.parametrize("text", ["a", ""])
def test_a_body_of_many_tiny_parts_is_read_in_proportion_to_its_size(
    kind: requests.Kind, text: str
) -> None:
    """Hundreds of thousands of one-letter (or empty) parts are read without raising, into
    no more text than the body holds, tokenized on the prompt's beginning only, at a few
    times the body's size in memory."""
    part = msgspec.json.encode(
        {"type": "input_text" if kind == "responses" else "text", "text": text}
    )
    parts = b"[" + b",".join([part] * TINY) + b"]"
    member = b'"input"' if kind == "responses" else b'"messages"'
    body = (
        b'{"model":"m","max_tokens":4,' + member + b':[{"role":"user","content":' + parts + b"}]}"
    )
    tracemalloc.start()
    try:
        parsed = requests.parse(kind, body, want_text=True)
        ids = SIM.ids(parsed) if SIM is not None and parsed.chat else []
        sglang = turns.worked_out(parsed.sglang_chat)  # as an SGLang model asks for them
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(parsed.text) <= len(body)
    assert all(len(content) <= len(body) for _, content in sglang)
    assert len(ids or []) <= prompts.MAX_CHARS
    assert peak <= 10 * len(body)


@pytest.mark.parametrize("kind", ["messages", "responses"])
@pytest.mark.parametrize("where", ["member", "content", "part"])
def test_a_conversation_nested_past_what_msgspec_decodes_has_no_turns(
    kind: str, where: str
) -> None:
    """Read on its own (the front door refuses such a body first), a conversation nested
    deeper than the decoder goes yields no turns rather than an error."""
    deep = b"[" * 100_000 + b"]" * 100_000
    item = {
        "member": deep,
        "content": b'[{"role":"user","content":' + deep + b"}]",
        "part": b'[{"role":"user","content":[{"type":"text","text":"x","more":' + deep + b"}]}]",
    }[where]
    member = b'"input"' if kind == "responses" else b'"messages"'
    vllm, sglang, llama = turns.of_body(kind, b'{"model":"m",' + member + b":" + item + b"}")
    assert vllm == sglang() == llama == ()

"""A Messages or Responses API body is keyed, for an SGLang model, as SGLang renders it.

SGLang 0.5.23 turns either body into a chat request (its Anthropic adapter's
`_convert_to_chat_completion_request`, its Responses serving's `_construct_input_messages`)
and gives a text-only chat template each message's content flattened
(`process_content_for_template_format`, "string" format). `_anthropic_chat`,
`_responses_chat` and `_flattened` below re-implement those steps on plain dicts, as the
source writes them, for a template that renders a system turn anywhere; the router's
turns for SGLang must equal what they give, over generated bodies of text, images,
reasoning, function calls and their outputs (whose text the router does not reproduce).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from llmgw.router import requests, sglang_turns, turns

LABEL = "Developer instructions:"


def _anthropic_chat(body: dict[str, Any]) -> list[dict[str, Any]]:
    """SGLang's Messages body -> chat messages (text, image, tool_use and tool_result)."""
    out: list[dict[str, Any]] = []
    system_parts: list[str] = []
    system = body.get("system")
    if system:
        if isinstance(system, str):
            if system.strip():
                system_parts.append(system)
        else:
            system_parts += [b["text"] for b in system if b["type"] == "text" and b["text"]]
    if system_parts:
        out.append({"role": "system", "content": "\n".join(system_parts)})
    for msg in body["messages"]:
        if isinstance(msg["content"], str):
            out.append({"role": msg["role"], "content": msg["content"]})
            continue
        new: dict[str, Any] = {"role": msg["role"]}
        parts: list[dict[str, Any]] = []
        calls: list[str] = []
        for block in msg["content"]:
            if block["type"] == "text":
                parts.append({"type": "text", "text": block["text"]})
            elif block["type"] == "image":
                parts.append({"type": "image_url", "image_url": {"url": "u"}})
            elif block["type"] == "tool_use":
                calls.append(block["name"])
            elif block["type"] == "tool_result" and msg["role"] == "user":
                if parts:
                    out.append({"role": "user", "content": list(parts)})
                    parts.clear()
                out.append({"role": "tool", "content": block["content"]})
            elif block["type"] == "tool_result":
                parts.append({"type": "text", "text": f"Tool result: {block['content']}"})
        if calls:
            new["tool_calls"] = calls
        if parts:
            one = len(parts) == 1 and parts[0]["type"] == "text"
            new["content"] = parts[0]["text"] if one else parts
            out.append(new)
        elif calls:
            out.append(new)
        elif msg["role"] != "user":
            out.append({**new, "content": ""})
    return out


def _responses_chat(body: dict[str, Any]) -> list[dict[str, Any]]:
    """SGLang's Responses body -> chat messages, system turns left where they stand."""
    out: list[dict[str, Any]] = []
    if body.get("instructions"):
        out.append({"role": "system", "content": body["instructions"]})
    given_input = body["input"]
    items = (
        [{"role": "user", "content": given_input}] if isinstance(given_input, str) else given_input
    )
    for item in items:
        msg = _responses_message(item)
        if msg is not None:
            out.append(msg)
    merged: list[dict[str, Any]] = []
    for msg in out:
        prev = merged[-1] if merged else None
        if (
            prev is not None
            and msg.get("role") == "assistant"
            and prev.get("role") == "assistant"
            and (
                prev.get("phase") == msg.get("phase") or set(prev) == {"role", "reasoning_content"}
            )
        ):
            prev = merged[-1] = dict(prev)
            if msg.get("phase") is not None:
                prev["phase"] = msg["phase"]
            new = msg.get("content")
            if new is not None and new != "":
                old = prev.get("content")
                if old is None or old == "":
                    prev["content"] = new
                elif isinstance(old, str) and isinstance(new, str):
                    prev["content"] = old + ("\n\n" if old and new else "") + new
                else:
                    prev["content"] = _as_parts(old) + _as_parts(new)
            if msg.get("tool_calls"):
                prev["tool_calls"] = prev.get("tool_calls", []) + msg["tool_calls"]
            if msg.get("reasoning_content"):
                prev["reasoning_content"] = msg["reasoning_content"]
            continue
        merged.append(msg)
    return merged


def _as_parts(content: Any) -> list[Any]:
    if isinstance(content, list):
        return list(content)
    return [{"type": "text", "text": content}] if isinstance(content, str) and content else []


def _responses_message(item: dict[str, Any]) -> dict[str, Any] | None:
    if item.get("role") == "developer":
        item = {**item, "role": "system", "content": _labelled(item.get("content"))}
    kind = item.get("type")
    if kind == "function_call":
        return {"role": "assistant", "tool_calls": [item["name"]]}
    if kind == "function_call_output":
        return {"role": "tool", "content": item["output"]}
    if kind == "reasoning":
        texts = [p["text"] for p in item.get("summary") or [] if p.get("text")]
        texts = texts or [p["text"] for p in item.get("content") or [] if p.get("text")]
        return {"role": "assistant", "reasoning_content": "\n".join(texts)} if texts else None
    content = item.get("content")
    kept = {k: v for k, v in item.items() if v is not None and k not in ("id", "status", "type")}
    if isinstance(content, list):
        kept["content"] = [_part(p) for p in content]
    return kept


def _labelled(content: Any) -> Any:
    if isinstance(content, str):
        return f"{LABEL}\n{content}"
    for index, part in enumerate(content):
        if isinstance(part.get("text"), str):
            return [
                *content[:index],
                {**part, "text": f"{LABEL}\n{part['text']}"},
                *content[index + 1 :],
            ]
    return [{"type": "input_text", "text": LABEL}, *content]


def _part(part: dict[str, Any]) -> dict[str, Any]:
    if part["type"] in ("input_text", "output_text"):
        return {"type": "text", "text": part.get("text", "")}
    if part["type"] == "input_image":
        return {"type": "image_url", "image_url": {"url": part["image_url"]}}
    return part


def _flattened(msg: dict[str, Any]) -> tuple[str, str]:
    """A chat message as a text-only template gets it; a tool turn's text is not keyed."""
    content = msg.get("content")
    if msg["role"] == "tool":
        return "tool", ""
    if isinstance(content, list):
        content = " ".join(c["text"] for c in content if c.get("type") in ("text", "input_text"))
    return msg["role"], content or ""


def keyed_for_sglang(kind: str, body: dict[str, Any]) -> turns.Turns:
    """The router's turns for an SGLang model: SGLang's (a chat of none, which SGLang
    refuses to render, is keyed by vLLM's)."""
    vllm, sglang, _ = turns.of_body(kind, json.dumps(body).encode())
    return sglang() or vllm


text = st.text(st.sampled_from("ab \n"), max_size=4)
roles = st.sampled_from(["user", "assistant"])
blocks = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, text),
    st.just({"type": "image", "source": {"type": "url", "url": "http://i/x.png"}}),
)
tool_blocks = st.one_of(
    blocks,
    st.just({"type": "tool_use", "id": "t1", "name": "f", "input": {}}),
    st.builds(lambda t: {"type": "tool_result", "tool_use_id": "t1", "content": t}, text),
)
systems = st.one_of(
    st.none(), text, st.lists(st.builds(lambda t: {"type": "text", "text": t}, text), max_size=3)
)


def messages_bodies(block: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    message = st.builds(
        lambda role, content: {"role": role, "content": content},
        roles,
        st.one_of(text, st.lists(block, max_size=3)),
    )
    return st.builds(
        lambda system, said: (
            {"model": "m", "max_tokens": 1, "messages": said}
            | ({} if system is None else {"system": system})
        ),
        systems,
        st.lists(message, max_size=5),
    )


@settings(max_examples=300, deadline=None)
@given(body=messages_bodies(blocks))
def test_a_messages_body_is_keyed_as_sglang_renders_it(body: dict[str, Any]) -> None:
    expected = tuple(_flattened(m) for m in _anthropic_chat(body))
    assume(expected)
    assert keyed_for_sglang("messages", body) == expected


def _before_tools(body: dict[str, Any]) -> dict[str, Any]:
    """The body with its messages before the first that holds a tool block."""
    said = body["messages"]
    first = next((i for i, m in enumerate(said) if _has_tools(m)), len(said))
    return {**body, "messages": said[:first]}


def _has_tools(message: dict[str, Any]) -> bool:
    content = message["content"]
    return isinstance(content, list) and any(b["type"].startswith("tool_") for b in content)


@settings(max_examples=300, deadline=None)
@given(body=messages_bodies(tool_blocks))
def test_a_messages_body_with_tools_is_keyed_exactly_up_to_its_first_tool_block(
    body: dict[str, Any],
) -> None:
    exact = tuple(_flattened(m) for m in _anthropic_chat(_before_tools(body)))
    assert keyed_for_sglang("messages", body)[: len(exact)] == exact


parts = st.one_of(
    st.builds(
        lambda k, t: {"type": k, "text": t}, st.sampled_from(["input_text", "output_text"]), text
    ),
    st.just({"type": "input_image", "image_url": "http://i/x.png"}),
)
phases = st.sampled_from([None, "commentary", "final_answer"])
message_items = st.builds(
    lambda typed, role, content, phase: (
        ({"type": "message"} if typed else {})
        | {"role": role, "content": content}
        | ({} if phase is None else {"phase": phase})
    ),
    st.booleans(),
    st.sampled_from(["user", "assistant", "assistant", "system", "developer"]),
    st.one_of(text, st.lists(parts, max_size=3)),
    phases,
)
other_items = st.one_of(
    st.builds(
        lambda summary, content: {"type": "reasoning", "summary": summary, "content": content},
        st.lists(st.builds(lambda t: {"type": "summary_text", "text": t}, text), max_size=2),
        st.lists(st.builds(lambda t: {"type": "reasoning_text", "text": t}, text), max_size=2),
    ),
    st.just({"type": "function_call", "name": "f", "arguments": "{}", "call_id": "c"}),
    st.builds(lambda t: {"type": "function_call_output", "call_id": "c", "output": t}, text),
)
responses_bodies = st.builds(
    lambda instructions, said: (
        {"model": "m", "input": said}
        | ({} if instructions is None else {"instructions": instructions})
    ),
    st.one_of(st.none(), text),
    st.one_of(text, st.lists(st.one_of(message_items, message_items, other_items), max_size=6)),
)


REASONED = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "r"}], "content": []}


@settings(max_examples=400, deadline=None)
@given(body=responses_bodies)
# Reasoning, then an empty message of one phase: a message of another phase is a new turn.
@example(
    body={
        "model": "m",
        "input": [
            REASONED,
            {"role": "assistant", "content": "", "phase": "commentary"},
            {"role": "assistant", "content": "x", "phase": "final_answer"},
        ],
    }
)
# Reasoning, then messages of one phase: the phase the merged turn took lets the next in.
@example(
    body={
        "model": "m",
        "input": [
            REASONED,
            {"role": "assistant", "content": "x", "phase": "commentary"},
            {"role": "assistant", "content": "y", "phase": "commentary"},
        ],
    }
)
# A phase of null is none.
@example(
    body={
        "model": "m",
        "input": [
            {"role": "assistant", "content": "a", "phase": None},
            {"role": "assistant", "content": "b"},
        ],
    }
)
def test_a_responses_body_is_keyed_as_sglang_renders_it(body: dict[str, Any]) -> None:
    expected = tuple(_flattened(m) for m in _responses_chat(body))
    assume(expected)
    assert keyed_for_sglang("responses", body) == expected


def test_the_parsed_request_carries_sglangs_turns_for_an_sglang_model_to_ask_for() -> None:
    body = {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]}]}  # fmt: skip
    parsed = requests.parse("responses", json.dumps(body).encode(), want_text=True)
    assert parsed.chat == (("user", "a\nb"),)
    assert isinstance(parsed.sglang_chat, turns.Later)
    assert parsed.sglang_chat() == (("user", "a b"),)
    plain = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    parsed = requests.parse("messages", json.dumps(plain).encode(), want_text=True)
    assert isinstance(parsed.sglang_chat, turns.Later)
    assert parsed.chat == parsed.sglang_chat() == (("user", "hi"),)


def test_sglangs_turns_are_worked_out_only_when_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    # Parsing runs for every request on the router's loop, whatever the model's engine:
    # SGLang's rendering (a third as much work again) waits for an SGLang model to ask.
    asked: list[str] = []
    real = sglang_turns.of_messages

    def counted(*parts: Any) -> turns.Turns:
        asked.append("of_messages")
        return real(*parts)

    monkeypatch.setattr(sglang_turns, "of_messages", counted)
    plain = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    parsed = requests.parse("messages", json.dumps(plain).encode(), want_text=True)
    assert asked == []
    assert turns.worked_out(parsed.sglang_chat) == (("user", "hi"),)
    assert asked == ["of_messages"]


def test_a_responses_message_without_a_role_adds_no_turn() -> None:
    body = {"model": "m", "input": [{"type": "message", "content": "x"}, {"role": "user",
            "content": "u"}]}  # fmt: skip
    assert keyed_for_sglang("responses", body) == (("user", "u"),)

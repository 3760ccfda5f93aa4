"""A llama-server model's Messages requests are keyed with the system llama-server renders.

Claude Code's system begins with a billing header whose `cch` changes on every request;
llama.cpp b11434's Anthropic adapter (`normalize_anthropic_billing_header` in
tools/server/server-chat.cpp) overwrites those five characters with `fffff` when a `;`
follows them, in a system string or in each system text block that begins with the
header. `_llama_normalized` re-implements it, index for index, as the source writes it.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from llmgw.core.profile import ModelProfile
from llmgw.router import choice, llama_turns, requests

HEADER = "x-anthropic-billing-header:"


def _llama_normalized(text: str) -> str:
    if not text.startswith(HEADER):  # rfind(HEADER, 0) != 0
        return text
    index_cch = text.find("cch=", len(HEADER))
    if index_cch == -1:
        return text
    index_replace = index_cch + 4
    if index_replace + 5 < len(text) and text[index_replace + 5] == ";":
        return text[:index_replace] + "fffff" + text[index_replace + 5 :]
    return text


pieces = st.sampled_from([HEADER, " cc_version=2.1.101.e51;", " cch=", "cch=", ";", "a5", "1c8b4",
                          "x", " ", "\n", "You are Claude Code."])  # fmt: skip
texts = st.lists(pieces, max_size=8).map("".join)


@settings(max_examples=500, deadline=None)
@given(text=texts)
@example(text=f"You are Claude Code. {HEADER} cch=1c8b4;")  # the header not at the start
@example(text=f"{HEADER} cch=1c8b4;")
def test_a_system_text_is_normalized_as_llama_server_normalizes_it(text: str) -> None:
    assert llama_turns.normalized(text) == _llama_normalized(text)


def claude_code(cch: str, *, blocks: bool) -> bytes:
    header = f"{HEADER} cc_version=2.1.101.e51; cc_entrypoint=cli; cch={cch};"
    rest = "You are Claude Code, Anthropic's official CLI for Claude."
    system: Any = (
        [{"type": "text", "text": header}, {"type": "text", "text": rest}]
        if blocks
        else f"{header}\n{rest}"
    )
    talk = [{"role": "user", "content": "explain this repository"}]
    return json.dumps({"model": "m", "max_tokens": 8, "system": system, "messages": talk}).encode()


def keyed(engine: str, body: bytes) -> tuple[Any, str]:
    parsed = requests.parse("messages", body, want_text=True)
    return choice.keyed_text(parsed, ModelProfile(name="m", engine=engine))  # type: ignore[arg-type]


@settings(max_examples=100, deadline=None)
@given(
    first=st.text("0123456789abcdef", min_size=5, max_size=5),
    second=st.text("0123456789abcdef", min_size=5, max_size=5),
    blocks=st.booleans(),
)
def test_claude_codes_requests_share_their_prefix_on_llama_server_only(
    first: str, second: str, blocks: bool
) -> None:
    # llama-server caches a conversation's prefix across its requests, so the router
    # keys them alike; vLLM and SGLang render each checksum, and their caches miss past it.
    one, two = claude_code(first, blocks=blocks), claude_code(second, blocks=blocks)
    assert keyed("llamacpp", one) == keyed("llamacpp", two)
    chat, text = keyed("llamacpp", one)
    assert chat[0][1].startswith(f"{HEADER} cc_version=2.1.101.e51; cc_entrypoint=cli; cch=fffff;")
    assert text.startswith("system\n" + chat[0][1])
    for engine in ("vllm", "sglang", "sim"):
        assert (keyed(engine, one) == keyed(engine, two)) is (first == second)


def test_a_system_without_the_header_is_keyed_alike_on_every_engine() -> None:
    body = json.dumps({"model": "m", "max_tokens": 8, "system": "be brief",
                       "messages": [{"role": "user", "content": "hi"}]}).encode()  # fmt: skip
    parsed = requests.parse("messages", body, want_text=True)
    assert parsed.llamacpp_chat == ()
    assert keyed("llamacpp", body) == keyed("vllm", body) == (parsed.chat, parsed.text)

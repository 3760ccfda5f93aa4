"""What llama.cpp's llama-server renders differently of a Messages API body: its system.

Claude Code begins the `system` of every request with a line such as
`x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch=a5145;`,
whose `cch` changes from one request to the next. llama-server's Anthropic adapter
(read from llama.cpp b11434's tools/server/server-chat.cpp) writes those five characters
as `fffff` in a system string, or in each system text block, that begins with the header,
so that a conversation's requests share their prefix in its cache: the router keys a
llama-server model's prompt the same way, or each request would look new to it and a
conversation would not stay where its prefix is cached. vLLM and SGLang render the header
as it is (their cache misses after it), and their models are keyed as they render it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from llmgw.router.turns import Part

HEADER = "x-anthropic-billing-header:"
CCH = "cch="
CCH_LENGTH = 5
"""The characters after `cch=` that llama-server overwrites, when a `;` follows them."""


def normalized(text: str) -> str:
    """`text` as llama-server renders a system text: a billing header's `cch` as `fffff`."""
    if not text.startswith(HEADER):
        return text
    at = text.find(CCH, len(HEADER))
    if at < 0:
        return text
    start = at + len(CCH)
    end = start + CCH_LENGTH
    if end < len(text) and text[end] == ";":
        return text[:start] + "f" * CCH_LENGTH + text[end:]
    return text


def system(given: str | list[str | Part]) -> str | list[str | Part]:
    """A Messages API `system` (a string or blocks) with each text normalized."""
    if isinstance(given, str):
        return normalized(given)
    return [
        part if isinstance(part, str) or part.type != "text" else _with_text(part) for part in given
    ]


def _with_text(part: Part) -> Part:
    text = normalized(part.text)
    return part if text == part.text else msgspec.structs.replace(part, text=text)

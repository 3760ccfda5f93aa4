"""The simulated engine's tokenizer, chat template and text generator (`llmgw sim`).

In the core because routers tokenize prompts for sim models exactly as the sim does
(llmgw.router.prompts), to key their KV index with the token ids the sim's KV events
carry.

An approximation of a real tokenizer, not a copy of one: a token is a run of at
most six word characters with at most one leading space, a single punctuation
character with at most one leading space, or a run of other whitespace. That
gives roughly the four characters per token of BPE tokenizers on English text,
and it is lossless (the tokens join back into the text), which the prefix cache
needs: equal text prefixes give equal token prefixes. The sim keeps tokens as their
strings; `token_id` gives each a stable id for its KV events.

Generated text is drawn from a small vocabulary of short words, each of which is
exactly one token, so `usage.completion_tokens`, the generation-token metrics and
re-tokenizing the output all agree. The generator is a 64-bit LCG seeded per
request: the same seed and prompt give the same text on every run.

Used by `llmgw.sim.engine` (requests carry their prompt tokens), `llmgw.sim.api`
(prompts are rendered and counted) and `llmgw.router.prompts`. Purely computational.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable, Iterator, Sequence

_TOKEN = re.compile(r" ?\w{1,6}| ?[^\w\s]|\s+")

_VOCAB: tuple[str, ...] = tuple(
    " " + w
    # A paragraph of words reads better than 128 quoted strings.
    for w in (  # noqa: SIM905
        "the of and to in is it that was for on are as with his they at be this from "
        "have or by one had not but what all were when we there can an your which "
        "their said if do will each about how up out them then she many some so "
        "these would other into has more her two like him see time could no make "
        "than first been its who now people my made over did down only way find use "
        "may water long little very after words called just where most know get "
        "still back much before go good new write our used me man too any day "
        "same right look think also around year work part place live small thing "
        "name great help"
    ).split()
)
assert len(set(_VOCAB)) == 128, "the generator indexes 128 distinct words"

_MASK = (1 << 64) - 1
_MUL = 6364136223846793005
_INC = 1442695040888963407


def tokenize(text: str) -> list[str]:
    """Split `text` into tokens; `"".join(tokenize(t)) == t` for every string."""
    return _TOKEN.findall(text)


_IDS: dict[str, int] = {}


def token_id(piece: str) -> int:
    """The id of one token: stable across processes (a CRC of its text, 31 bits), so that a
    router tokenizing a prompt as the sim does computes the ids the sim's KV events carry."""
    got = _IDS.get(piece)
    if got is None:
        got = zlib.crc32(piece.encode("utf-8", "surrogatepass")) & 0x7FFFFFFF
        if len(_IDS) < 1_000_000:
            _IDS[piece] = got
    return got


def token_ids(pieces: Iterable[str]) -> list[int]:
    ids = _IDS
    return [ids.get(p) or token_id(p) for p in pieces]


def vocabulary() -> tuple[str, ...]:
    """The generator's words (each one token)."""
    return _VOCAB


def count(text: str) -> int:
    return len(_TOKEN.findall(text))


GENERATION_PROMPT = "<|assistant|>\n"
"""What follows a chat's messages: the assistant's turn opened."""


def chat_parts(messages: Iterable[tuple[str, str]]) -> list[str]:
    """Each (role, content) framed as `render_chat` frames it, one string a message.

    `tokenize` of the rendered chat is the concatenation of `tokenize` of each part and of
    `GENERATION_PROMPT`: every part ends with a newline and the next begins with "<". A
    token never spans that boundary (a newline is only ever part of a whitespace run, which
    stops before "<", and only a space can lead another token), and where a token begins
    depends only on the text from there on (no pattern looks behind or at the end), so the
    tokens after a boundary are those of the text after it alone. The router reuses the
    tokens of messages it has seen on that account (llmgw.router.prompts)."""
    return list(framed(messages))


def framed(messages: Iterable[tuple[str, str]]) -> Iterator[str]:
    """`chat_parts`, one at a time: a caller that stops early frames no more."""
    for role, content in messages:
        yield f"<|{role}|>\n{content}\n"


def render_chat(messages: Iterable[tuple[str, str]]) -> str:
    """The prompt a chat model would see: each (role, content) framed, then the
    assistant's turn opened. Every message therefore costs a few tokens of framing,
    as with real chat templates."""
    parts = chat_parts(messages)
    parts.append(GENERATION_PROMPT)
    return "".join(parts)


def text_seed(seed: int, text: str) -> int:
    """A stable seed from a request's seed and its prompt (stable across processes,
    unlike `hash`, which Python randomizes per process for strings)."""
    return (seed * 0x9E3779B97F4A7C15 + zlib.crc32(text.encode("utf-8", "surrogatepass"))) & _MASK


class Generator:
    """Deterministic stream of generated tokens for one request."""

    __slots__ = ("state",)

    def __init__(self, seed: int) -> None:
        self.state = (seed * _MUL + _INC) & _MASK

    def next_token(self) -> str:
        self.state = (self.state * _MUL + _INC) & _MASK
        return _VOCAB[self.state >> 57]

    def below(self, n: int) -> int:
        """A number in [0, n)."""
        self.state = (self.state * _MUL + _INC) & _MASK
        return (self.state >> 32) % n


def block_hashes(
    tokens: Sequence[str], block_size: int, start: int, prev: list[int], root: int = 0
) -> None:
    """Extend `prev` with the chained hashes of the full blocks of `tokens` from
    block index `start` on. A block's hash covers its own tokens and the hash of the
    block before it, so two prompts share a cached block only if everything before
    it is equal too. Python's tuple hash is used: it is only compared inside one
    process, and a 64-bit collision between two live prefixes is negligible here. `root`
    is the first block's parent: a salted request's own (`salt_root`)."""
    parent = prev[-1] if prev else root
    for i in range(start, len(tokens) // block_size):
        parent = hash((parent, tuple(tokens[i * block_size : (i + 1) * block_size])))
        prev.append(parent)


def salt_root(salt: str | None) -> int:
    """The parent hash of a salted prompt's first block, as vLLM folds a request's
    `cache_salt` into its first block: prompts of different salts share no block."""
    return 0 if salt is None else hash(("salt", salt))

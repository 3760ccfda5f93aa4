"""A request's prompt as the engine's token ids: what the router keys the KV index with.

The engine caches blocks of the token ids its tokenizer makes of the prompt its chat
template renders, so the router must tokenize the same way to predict a cache hit:

- `SimPrompts`: `llmgw sim`'s own tokenizer and chat framing (llmgw.core.simtokens);
- `HfPrompts`: a Hugging Face tokenizer (`tokenizer.json`, read by the `tokenizers`
  library) and the chat template of its `tokenizer_config.json` (Jinja, as the
  engines render it), for vLLM and SGLang models;
- None: the router has no way to know the tokens (no tokenizer files found) and
  routes on its approximate index of prompt text instead.

`for_profile` finds the right one for a model: the profile's `tokenizer` (a file or a
directory on the router's host), else the model's own directory when `model` is a local
path, else the sim's for sim models. Tokenizers are loaded once per path and engine
(SGLang joins a message's text parts, and turns the Messages and Responses APIs into a
chat, its own way: `turns.of_chat`, `llmgw.router.sglang_turns`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from llmgw import logs
from llmgw.core import simtokens as sim_tokens
from llmgw.core.profile import Engine, ModelProfile
from llmgw.core.promptkeys import PromptTokens, SegmentCache
from llmgw.router.requests import Parsed
from llmgw.router.turns import Turns, chat_text_length, worked_out

log = logs.get("llmgw.router")


MAX_CHARS = 32_768
"""The default of how much of a prompt is tokenized (`cache.max_prompt_chars`): the text
index's reach too (`prefix`: 128 blocks of 256 characters)."""
MAX_MESSAGES = 512
"""A chat's messages rendered through a model's template at most: a template renders per
message, and a body of hundreds of thousands of tiny messages renders for tens of
milliseconds."""
MARGIN = 256
"""Characters at the end of a cut prompt whose tokens are left out: a tokenizer's last
tokens of a cut text need not be its tokens of the whole (a word, a run of spaces or a
template's closing marker cut short), and a template closes what it rendered last."""


class Prompts(Protocol):
    """Token ids of a parsed request's prompt, or None when they cannot be known.

    Only the first `max_chars` characters of a prompt are tokenized: tokenizing runs on
    the router's loop, about a microsecond a token, and a body of megabytes would hold
    every other request for seconds. A longer prompt is predicted on its beginning (the
    part that prefix caches share), its length estimated (`PromptTokens.estimate`)."""

    def ids(self, parsed: Parsed, max_chars: int = MAX_CHARS) -> Sequence[int] | None: ...

    def tokens(self, parsed: Parsed, max_chars: int = MAX_CHARS) -> PromptTokens | None:
        """The ids and, per block size, the block keys of the prompt."""
        ...


def _sim_ids(text: str) -> list[int]:
    return sim_tokens.token_ids(sim_tokens.tokenize(text))


class SimPrompts:
    """`llmgw sim`'s tokenizer and chat framing.

    A chat's messages are tokenized and keyed once per prefix of messages (a system prompt,
    a conversation's earlier turns), which the sim's tokenizer allows exactly
    (`simtokens.chat_parts`); this is most of a router's work per request otherwise."""

    def __init__(self) -> None:
        self.cache = SegmentCache(_sim_ids)

    def tokens(self, parsed: Parsed, max_chars: int = MAX_CHARS) -> PromptTokens | None:
        if parsed.chat:
            parts: list[str] = []
            room, covered = max_chars, 0  # covered: of the chat's `text`, for the estimate
            framed = sim_tokens.framed(parsed.chat)
            for (role, content), part in zip(parsed.chat, framed, strict=True):
                own = chat_text_length(role, content)
                if len(part) > room:
                    # The sim's tokens of a cut text are the whole text's but the last
                    # (a word, a space or a run of them cut short): left out.
                    got = self.cache.tokens(parts, part[:room], cut=room > 0)
                    return _estimated(got, parsed, covered + own * room // len(part))
                parts.append(part)
                room -= len(part)
                covered += own
            return self.cache.tokens(parts, sim_tokens.GENERATION_PROMPT)
        if parsed.text:
            if len(parsed.text) <= max_chars:
                return PromptTokens.of(_sim_ids(parsed.text))
            got = PromptTokens.of(_sim_ids(parsed.text[:max_chars])[:-1])
            return _estimated(got, parsed, max_chars)
        return None

    def ids(self, parsed: Parsed, max_chars: int = MAX_CHARS) -> Sequence[int] | None:
        got = self.tokens(parsed, max_chars)
        return None if got is None else got.ids


def _estimated(got: PromptTokens, parsed: Parsed, chars: int) -> PromptTokens:
    """`got`, the tokens of a prompt's first `chars` characters, with the whole prompt's
    count estimated at the same tokens per character."""
    got.estimate = max(len(got.ids), round(len(got.ids) * len(parsed.text) / max(chars, 1)))
    return got


class TokenizerFilesError(ValueError):
    """Tokenizer files that cannot be used; the message says which and why."""


class HfPrompts:
    """A Hugging Face tokenizer and chat template, as vLLM and SGLang apply them."""

    def __init__(
        self,
        tokenizer_file: Path,
        template: str | None,
        specials: dict[str, str],
        engine: Engine = "vllm",
    ) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:  # pragma: no cover - a dependency of llmgw
            raise TokenizerFilesError("the `tokenizers` package is not installed") from None
        try:
            self._tok = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:
            raise TokenizerFilesError(f"{tokenizer_file} is not a tokenizer: {exc}") from None
        self._template: Any = None
        self._specials = specials
        self._engine = engine  # SGLang and llama-server render some turns their own way
        if template:
            import jinja2.sandbox

            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            try:
                self._template = env.from_string(template)
            except (jinja2.TemplateError, RecursionError) as exc:  # Recursion: nested deep
                raise TokenizerFilesError(f"the chat template does not parse: {exc}") from None

    @classmethod
    def load(cls, where: Path, engine: Engine = "vllm") -> HfPrompts:
        """From a directory (tokenizer.json, tokenizer_config.json) or a tokenizer.json, as
        `engine` renders a chat."""
        folder = where if where.is_dir() else where.parent
        tokenizer_file = where / "tokenizer.json" if where.is_dir() else where
        if not tokenizer_file.is_file():
            raise TokenizerFilesError(f"no tokenizer.json at {where}")
        template: str | None = None
        specials: dict[str, str] = {}
        config_file = folder / "tokenizer_config.json"
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text())
            except (OSError, ValueError, RecursionError) as exc:  # Recursion: nested deep
                raise TokenizerFilesError(f"{config_file} is not JSON: {exc}") from None
            # Anything else escaped for_profile, which then tried again on every request.
            if not isinstance(config, dict):
                raise TokenizerFilesError(
                    f"{config_file} holds a {type(config).__name__}, not a JSON object"
                )
            raw = config.get("chat_template")
            if isinstance(raw, list):  # named templates: the default one
                raw = next(
                    (
                        t.get("template")
                        for t in raw
                        if isinstance(t, dict) and t.get("name") == "default"
                    ),
                    None,
                )
            template = raw if isinstance(raw, str) else None
            for name in ("bos_token", "eos_token"):
                value = config.get(name)
                if isinstance(value, dict):
                    value = value.get("content")
                if isinstance(value, str):
                    specials[name] = value
        return cls(tokenizer_file, template, specials, engine)

    def tokens(self, parsed: Parsed, max_chars: int = MAX_CHARS) -> PromptTokens | None:
        # No segments are reused: a BPE tokenizer's tokens of a concatenation are not in
        # general its tokens of the parts (a pre-tokenizer marking a text's start, added
        # tokens that strip the spaces beside them), nor does a chat template say where
        # each message's text lies in what it renders.
        found = self._ids(parsed, max_chars)
        if found is None:
            return None
        ids, cut = found
        got = PromptTokens.of(ids)
        return _estimated(got, parsed, cut) if cut else got

    def ids(self, parsed: Parsed, max_chars: int = MAX_CHARS) -> Sequence[int] | None:
        found = self._ids(parsed, max_chars)
        return None if found is None else found[0]

    def _ids(self, parsed: Parsed, max_chars: int) -> tuple[list[int], int] | None:
        """The ids of the prompt's first `max_chars` characters (those of the whole, when
        it is no longer), and the characters of the prompt's text they stand for (0: the
        whole)."""
        if parsed.chat:
            if self._template is None:
                return None
            messages: list[dict[str, str]] = []
            room, cut, covered = max_chars, False, 0  # covered: of the chat's `text`
            for role, content in self._turns(parsed):
                if len(messages) == MAX_MESSAGES:
                    cut = True
                    break
                if len(content) > room:
                    messages.append({"role": role, "content": content[:room]})
                    covered += chat_text_length(role, content[:room]) - 1
                    room, cut = 0, True
                    break
                messages.append({"role": role, "content": content})
                room -= len(content)
                covered += chat_text_length(role, content)
            try:
                # A cut chat's turn is not the assistant's yet: its end is left out anyway.
                text = self._template.render(
                    messages=messages, add_generation_prompt=not cut, **self._specials
                )
            except Exception as exc:  # a template that refuses these messages: no prediction
                log.debug("chat_template_failed", error=str(exc))
                return None
            # The rendered template carries its special tokens itself. What it renders of
            # the kept messages is bounded by them: no further cut.
            return self._encode(text, False, cut, covered)
        if parsed.text:
            text = parsed.text
            if len(text) <= max_chars:
                return self._encode(text, True, False, 0)
            return self._encode(text[:max_chars], True, True, max_chars)
        return None

    def _turns(self, parsed: Parsed) -> Turns:
        """The turns the engine renders: SGLang's or llama-server's own where they differ
        from vLLM's."""
        if self._engine == "sglang":
            return worked_out(parsed.sglang_chat) or parsed.chat
        if self._engine == "llamacpp":
            return parsed.llamacpp_chat or parsed.chat
        return parsed.chat

    def _encode(
        self, text: str, specials: bool, cut: bool, stands_for: int
    ) -> tuple[list[int], int]:
        """`text`'s ids, and the prompt's characters they stand for (0: all of it); of a
        cut text, only those of tokens ending before its last `MARGIN` characters."""
        encoding = self._tok.encode(text, add_special_tokens=specials)
        ids: list[int] = encoding.ids
        if not cut:
            return ids, 0
        keep = len(text) - MARGIN
        n = len(ids)
        offsets = encoding.offsets
        while n and offsets[n - 1][1] > keep:
            n -= 1
        # The prompt's characters the kept tokens stand for, in proportion to the text's.
        covered = offsets[n - 1][1] if n else 0
        return ids[:n], max(round(stands_for * covered / max(len(text), 1)), 1)


def _raise(message: str) -> None:
    raise ValueError(message)


_LOADED: dict[tuple[str, Engine], Prompts | None] = {}
_SIM = SimPrompts()


def for_profile(profile: ModelProfile) -> Prompts | None:
    """The tokenization of `profile`'s engine, or None where the router cannot know it."""
    if profile.engine == "sim" and not profile.tokenizer:
        return _SIM
    where = profile.tokenizer or profile.engine_model
    key = (where, profile.engine)
    if key in _LOADED:
        return _LOADED[key]
    found: Prompts | None = None
    if not where or not Path(where).exists():
        # Remembered, like a found one: this runs on every request of the model.
        if len(_LOADED) < 10_000:
            _LOADED[key] = None
        return None
    try:
        found = HfPrompts.load(Path(where), profile.engine)
        log.info("tokenizer_loaded", model=profile.name, path=where)
    except TokenizerFilesError as exc:
        log.warning("tokenizer_unusable", model=profile.name, path=where, error=str(exc))
        found = None
    _LOADED[key] = found
    return found

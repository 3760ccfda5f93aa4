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
path, else the sim's for sim models. Tokenizers are loaded once per path.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from llmgw import logs
from llmgw.core import simtokens as sim_tokens
from llmgw.core.profile import ModelProfile
from llmgw.core.promptkeys import PromptTokens, SegmentCache
from llmgw.router.requests import Parsed

log = logs.get("llmgw.router")


class Prompts(Protocol):
    """Token ids of a parsed request's prompt, or None when they cannot be known."""

    def ids(self, parsed: Parsed) -> Sequence[int] | None: ...

    def tokens(self, parsed: Parsed) -> PromptTokens | None:
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

    def tokens(self, parsed: Parsed) -> PromptTokens | None:
        if parsed.chat:
            return self.cache.tokens(
                sim_tokens.chat_parts(parsed.chat), sim_tokens.GENERATION_PROMPT
            )
        if parsed.text:
            return PromptTokens.of(_sim_ids(parsed.text))
        return None

    def ids(self, parsed: Parsed) -> Sequence[int] | None:
        got = self.tokens(parsed)
        return None if got is None else got.ids


class TokenizerFilesError(ValueError):
    """Tokenizer files that cannot be used; the message says which and why."""


class HfPrompts:
    """A Hugging Face tokenizer and chat template, as vLLM and SGLang apply them."""

    def __init__(
        self, tokenizer_file: Path, template: str | None, specials: dict[str, str]
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
        if template:
            import jinja2.sandbox

            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            try:
                self._template = env.from_string(template)
            except jinja2.TemplateError as exc:
                raise TokenizerFilesError(f"the chat template does not parse: {exc}") from None

    @classmethod
    def load(cls, where: Path) -> HfPrompts:
        """From a directory (tokenizer.json, tokenizer_config.json) or a tokenizer.json."""
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
            except (OSError, ValueError) as exc:
                raise TokenizerFilesError(f"{config_file} is not JSON: {exc}") from None
            raw = config.get("chat_template")
            if isinstance(raw, list):  # named templates: the default one
                raw = next((t.get("template") for t in raw if t.get("name") == "default"), None)
            template = raw if isinstance(raw, str) else None
            for name in ("bos_token", "eos_token"):
                value = config.get(name)
                if isinstance(value, dict):
                    value = value.get("content")
                if isinstance(value, str):
                    specials[name] = value
        return cls(tokenizer_file, template, specials)

    def tokens(self, parsed: Parsed) -> PromptTokens | None:
        # No segments are reused: a BPE tokenizer's tokens of a concatenation are not in
        # general its tokens of the parts (a pre-tokenizer marking a text's start, added
        # tokens that strip the spaces beside them), nor does a chat template say where
        # each message's text lies in what it renders.
        ids = self.ids(parsed)
        return None if ids is None else PromptTokens.of(list(ids))

    def ids(self, parsed: Parsed) -> Sequence[int] | None:
        if parsed.chat:
            if self._template is None:
                return None
            try:
                text = self._template.render(
                    messages=[{"role": r, "content": c} for r, c in parsed.chat],
                    add_generation_prompt=True,
                    **self._specials,
                )
            except Exception as exc:  # a template that refuses these messages: no prediction
                log.debug("chat_template_failed", error=str(exc))
                return None
            # The rendered template carries its special tokens itself.
            ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
            return ids
        if parsed.text:
            plain: list[int] = self._tok.encode(parsed.text, add_special_tokens=True).ids
            return plain
        return None


def _raise(message: str) -> None:
    raise ValueError(message)


_LOADED: dict[str, Prompts | None] = {}
_SIM = SimPrompts()


def for_profile(profile: ModelProfile) -> Prompts | None:
    """The tokenization of `profile`'s engine, or None where the router cannot know it."""
    if profile.engine == "sim" and not profile.tokenizer:
        return _SIM
    where = profile.tokenizer or profile.engine_model
    if where in _LOADED:
        return _LOADED[where]
    found: Prompts | None = None
    if not where or not Path(where).exists():
        # Remembered, like a found one: this runs on every request of the model.
        if len(_LOADED) < 10_000:
            _LOADED[where] = None
        return None
    try:
        found = HfPrompts.load(Path(where))
        log.info("tokenizer_loaded", model=profile.name, path=where)
    except TokenizerFilesError as exc:
        log.warning("tokenizer_unusable", model=profile.name, path=where, error=str(exc))
        found = None
    _LOADED[where] = found
    return found

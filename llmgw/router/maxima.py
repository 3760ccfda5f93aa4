"""How many tokens a request may generate, as every engine reads its body.

A key's token limits hold what a request may cost before it runs (llmgw.router.quotas), so
the hold must cover the largest maximum any engine behind the model obeys, and every
answer it generates. Engines read different fields of the same body:

- OpenAI, vLLM and SGLang: a chat's `max_completion_tokens or max_tokens` (OpenAI prefers
  the first when it is there at all), a completion's `max_tokens`, the Responses API's
  `max_output_tokens`, the Messages API's `max_tokens`; `n` answers (a completion's
  `best_of` when larger);
- llama-server (its `params_from_json_cmpl`, on every path but the Messages API, whose
  conversion keeps only its own fields): `n_predict`, else `max_completion_tokens`, else
  `max_tokens`, the first one not null, whatever the others say (below 0: no maximum at
  all); its Responses API renames `max_output_tokens` to `max_tokens` (a null one too) and
  keeps the rest of the body; `n_cmpl` answers, else `n`.

So a body naming a small `max_tokens` and a large `n_predict` was held to the small one
while llama-server generated the large. Each engine's reading is taken, and the hold
covers the largest, named by the field the client sent it in, so that a refusal says what
to lower. A field an engine ignores only makes the hold larger, never smaller. Pure.
"""

from __future__ import annotations

from typing import Any

import msgspec

Cap = tuple[int | None, str]
"""A maximum (None: none, the engine generates up to its context) and its field."""


def largest(*caps: int | None) -> int | None:
    """The largest of the maxima a body names, None when it names none. vLLM's chat reads
    `max_completion_tokens or max_tokens`, so a 0 there is no maximum at all: a 0 counts as
    none, and of two the larger counts."""
    named = [cap for cap in caps if cap]
    return max(named) if named else None


def maximum(
    kind: str,
    max_tokens: int | None,
    max_completion_tokens: int | None = None,
    max_output_tokens: int | msgspec.UnsetType | None = msgspec.UNSET,
    n_predict: int | None = None,
) -> Cap:
    """The most tokens each answer of API `kind` may generate, by any engine, and the field
    the client named it in (`_openai`'s when it names none). `max_output_tokens` is UNSET
    when the body has no such member (null is not the same to llama-server)."""
    own = _openai(kind, max_tokens, max_completion_tokens, max_output_tokens)
    if kind == "messages":
        return own
    llama = _llama(kind, max_tokens, max_completion_tokens, max_output_tokens, n_predict)
    if own[0] is None or llama[0] is None:
        return None, own[1]
    return llama if llama[0] > own[0] else own


def _openai(
    kind: str,
    max_tokens: int | None,
    max_completion_tokens: int | None,
    max_output_tokens: int | msgspec.UnsetType | None,
) -> Cap:
    """OpenAI's, vLLM's and SGLang's maximum."""
    if kind == "chat":
        newer = (max_completion_tokens or 0) >= (max_tokens or 1)
        field = "max_completion_tokens" if newer else "max_tokens"
        return largest(max_tokens, max_completion_tokens), field
    if kind == "responses":
        out = None if isinstance(max_output_tokens, msgspec.UnsetType) else max_output_tokens
        return largest(out), "max_output_tokens"
    return largest(max_tokens), "max_tokens"


def _llama(
    kind: str,
    max_tokens: int | None,
    max_completion_tokens: int | None,
    max_output_tokens: int | msgspec.UnsetType | None,
    n_predict: int | None,
) -> Cap:
    """llama-server's maximum: the first field of its order that is not null (none of them:
    its own default, no maximum); a 0 generates nothing, below 0 is no maximum."""
    older: Cap = (max_tokens, "max_tokens")
    if kind == "responses" and not isinstance(max_output_tokens, msgspec.UnsetType):
        older = (max_output_tokens, "max_output_tokens")
    for cap, field in ((n_predict, "n_predict"),
                       (max_completion_tokens, "max_completion_tokens"), older):  # fmt: skip
        if cap is not None:
            return (None if cap < 0 else cap), field
    return None, older[1]


def answers(kind: str, n: int | None, best_of: int | None = None, n_cmpl: int | None = None) -> Cap:
    """How many answers any engine generates for the request (at least one), and the field
    that asks for them: `n` (or `best_of`, which vLLM generates and returns the best of), or
    llama-server's `n_cmpl`, which it obeys over `n`."""
    own = max(n or 1, best_of or 1) if kind in ("chat", "completions") else 1
    field = "best_of" if (best_of or 1) > (n or 1) else "n"
    if kind == "messages":
        return own, field
    llama = max(1, (n_cmpl if n_cmpl is not None else n) or 1)
    if llama <= own:
        return own, field
    return llama, "n_cmpl" if n_cmpl is not None else "n"


def prompts(prompt: str | list[Any]) -> int:
    """The prompts of a completions request's `prompt`, each answered `answers` times: a
    list of strings or of token lists is one each; a string, a list of token ids, or any
    other list (llama-server reads one mixing ids and strings as one prompt) is one."""
    if isinstance(prompt, list) and prompt and all(isinstance(x, str | list) for x in prompt):
        return len(prompt)
    return 1

"""What an answer's tokens count for: the router's metrics, the key's limits and usage
(llmgw.router.quotas), and the check of the cache's predictions (llmgw.router.kvroute).

The engines say how many tokens an answer took in its usage: in a whole answer's body, in a
stream's last chunk (or several times along it, each time the totals so far). A stream cut
after its first token (the client hung up, the engine broke off) may never get to that last
chunk, so what its engine did not tell is estimated (`requests.estimated_usage`): else a
client could read all but the end of every answer, hang up, and pay for nothing. A whole
stream whose engine was asked for its usage and sent none (an engine that ignores
`stream_options.include_usage`) gets the same estimate: else it cost nothing. A stream
whose usage nobody asked for (the router's `count_stream_tokens: false` and a client that
did not) is charged nothing, cut or whole: cutting it must not cost more than reading it. A
whole answer of a generating API without a usage it can count is estimated too (a
completion token per `CHARS_PER_TOKEN` of the answer's body). Used by
`llmgw.router.dispatch`, whose relay hook `usage` is `Accounting.usage`.
"""

from __future__ import annotations

from llmgw import logs
from llmgw.core.profile import ModelProfile
from llmgw.router import requests
from llmgw.router.kvroute import KvRouting
from llmgw.router.metrics import Metrics
from llmgw.router.quotas import Quotas
from llmgw.router.relay import ClientStream

log = logs.get("llmgw.router")

BOUNDED = frozenset({"chat", "messages", "completions"})
"""The APIs whose usage the request bounds: each prompt by the model's context, each answer
by the body's maximum and the context (a completions request may list prompts, each
answered alike). An embeddings request's inputs, and a Responses answer's turns (vLLM's
built-in tools, its usage their sum), only by what a usage field holds."""


def asked_out(
    kind: requests.Kind, max_out: int | None, choices: int, prompts: int = 1
) -> tuple[int, int, int]:
    """(the most tokens each answer may take as the body says, 0 where it names none; the
    answers it asks for, of all its prompts; its prompts): `ClientStream.asked_out`."""
    per_answer = max_out if kind in BOUNDED and max_out is not None and max_out > 0 else 0
    return per_answer, choices * prompts, prompts


def bounds(prof: ModelProfile, client: ClientStream) -> tuple[int, int]:
    """The most prompt and completion tokens an engine's usage may charge `client`'s request.

    An engine says what its answer took, up to `requests.MAX_TOKENS` a field: two billion
    tokens charged to a key spent its budget and put its windows in debt for weeks. No
    engine reads a prompt longer than its context (the profile's `max_model_len`) nor
    generates more than the request's maximum, or the context, for each answer asked;
    past them its usage is a lie, counted only up to them."""
    most = requests.MAX_TOKENS
    if client.kind not in BOUNDED:
        return most, most
    context = max(prof.max_model_len or 0, 0)  # the catalog refuses one under 1
    per_answer, answers, prompts = client.asked_out
    # llama-server may shift its context (`--context-shift`) and write on past it.
    longest = 0 if prof.engine == "llamacpp" else context
    known = [n for n in (per_answer, longest) if n > 0]
    read = min(context * prompts, most) if context else most
    return read, min(min(known) * answers, most) if known else most


class Accounting:
    """One router process's counting of tokens, shared by its requests."""

    def __init__(self, metrics: Metrics, kv: KvRouting, quotas: Quotas) -> None:
        self.metrics = metrics
        self.kv = kv
        self.quotas = quotas

    def answer(self, prof: ModelProfile, client: ClientStream, data: bytes) -> None:
        """A whole answer's body: its usage; where a generating API's carries none it can
        count (an engine that does not report it, or reports nonsense), estimated from the
        prompt and the answer's length: else it cost nothing."""
        u = requests.usage_of(data)
        if u is not None and u.usage is not None:
            self.usage(prof, client, u.usage)
        elif client.kind in requests.GENERATES:
            answered = len(data) // requests.CHARS_PER_TOKEN
            self.usage(
                prof, client, requests.estimated_usage((0, 0), client.prompt_chars, answered)
            )

    def cut(self, prof: ModelProfile, client: ClientStream, events: int) -> None:
        """A stream cut after `events` events reached the client: what its engine did not
        tell of its usage, estimated; nothing for a stream whose usage nobody asked for
        (`count_stream_tokens: false`), which whole would not have been charged either."""
        if not client.usage_coming:
            return
        told = client.tokens
        self.usage(prof, client, requests.estimated_usage(told, client.prompt_chars, events))

    def ended(self, prof: ModelProfile, client: ClientStream, events: int) -> None:
        """A whole stream of `events` events: when its engine told no completion tokens,
        though asked for its usage, estimated as a cut one's."""
        if client.tokens[1] == 0:
            self.cut(prof, client, events)

    def usage(self, prof: ModelProfile, client: ClientStream, u: requests.Usage) -> None:
        # A stream may carry its usage more than once, each time the totals so far (vLLM's
        # continuous_usage_stats: every chunk; the Messages API: the prompt's tokens in
        # message_start, again in message_delta's totals): what is counted is what the
        # request's totals grew by, so no token is counted twice.
        details = u.prompt_tokens_details
        cached = details.cached_tokens if details is not None else None
        # Once, tokens added or not: continuous_usage_stats' cached tokens come in the last.
        if cached is not None and client.cached_predicted >= 0 and not client.cache_reported:
            client.cache_reported = True
            self.metrics.cache_delivered(prof.name, cached)
            self.kv.delivered(client.cached_endpoint, client.cached_predicted, cached)
        was_in, was_out = client.tokens
        most_in, most_out = bounds(prof, client)
        now_in = max(was_in, min(u.prompt_tokens, most_in))
        now_out = max(was_out, min(u.completion_tokens, most_out))
        # Said once per request: the first usage past a bound (later ones find it reached).
        if (u.prompt_tokens > most_in > was_in) or (u.completion_tokens > most_out > was_out):
            log.warning("usage_capped", request_id=client.rid, model=prof.name,
                        said_in=u.prompt_tokens, said_out=u.completion_tokens,
                        counted_in=now_in, counted_out=now_out,
                        detail="the engine said more tokens than its request could take "
                        "(its maximum per answer, the model's max_model_len): counted up to "
                        "them; an engine that does this is broken or its node lies")  # fmt: skip
        more_in, more_out = now_in - was_in, now_out - was_out
        if not (more_in or more_out):
            return
        client.tokens = (now_in, now_out)
        self.metrics.count_tokens(prof.name, more_in, more_out)
        principal = client.principal
        if principal is not None:
            self.metrics.key_usage(principal.name, principal.settings.team, prof.name,
                                   more_in, more_out)  # fmt: skip
            self.quotas.usage.used(principal, prof.name, more_in, more_out)

"""What an answer's tokens count for (llmgw.router.accounting) and the usage rows a router
owes the fleet's counters (llmgw.router.usage): told usages, estimates where the engine
told none, nothing where nobody asked, totals that never shrink, each key's own tokens in
its own direction; rows only for the log's keys, owed once while a flush is under way,
and kept whole when the flush fails or is cancelled."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from llmgw.core import tenancy
from llmgw.core.profile import ModelProfile
from llmgw.router import auth, requests
from llmgw.router.accounting import Accounting, asked_out, bounds
from llmgw.router.relay import ClientStream
from llmgw.router.requests import MAX_TOKENS, Kind
from llmgw.router.usage import UsageRows
from tests.unit.test_quotas import Store, key

PROF = ModelProfile(name="m")


class Recorded:
    """The metrics, KV routing and quotas an Accounting tells, recorded; the quotas' usage
    rows are the real ones."""

    def __init__(self) -> None:
        self.tokens = [0, 0]
        self.keys: dict[tuple[str, str, str], list[int]] = {}
        self.cached: list[int] = []
        self.compared: list[tuple[str, int, int]] = []
        self.usage = UsageRows()

    def count_tokens(self, _: str, prompt: int, completion: int) -> None:
        assert prompt >= 0, prompt
        assert completion >= 0, completion
        self.tokens[0] += prompt
        self.tokens[1] += completion

    def key_usage(self, name: str, team: str, model: str, prompt: int, completion: int) -> None:
        row = self.keys.setdefault((name, team, model), [0, 0])
        row[0] += prompt
        row[1] += completion

    def cache_delivered(self, _: str, cached: int) -> None:
        self.cached.append(cached)

    def delivered(self, endpoint: str, predicted: int, cached: int) -> None:
        self.compared.append((endpoint, predicted, cached))


def _counted(
    steps: Any, *, kind: requests.Kind = "chat", principal: auth.Principal | None = None,
    usage_coming: bool = True, predicted: int = -1,
) -> tuple[Recorded, ClientStream]:  # fmt: skip
    """`steps(accounting, client)` run for one request of `kind`, a prompt of 40
    characters: what was counted."""
    rec = Recorded()

    async def run() -> ClientStream:
        client = ClientStream(None, "r", 0.0, kind=kind, stream=False, drop_usage=False,  # type: ignore[arg-type]
                              principal=principal, prompt_chars=40,
                              usage_coming=usage_coming)  # fmt: skip
        client.cached_predicted, client.cached_endpoint = predicted, "e"
        steps(Accounting(rec, rec, rec), client)  # type: ignore[arg-type]
        return client

    return rec, asyncio.run(run())


def test_a_whole_answer_counts_its_engines_usage_for_the_key_in_each_direction() -> None:
    p = key(team="t")
    body = b'{"choices":[],"usage":{"prompt_tokens":11,"completion_tokens":4}}'
    rec, client = _counted(lambda a, c: a.answer(PROF, c, body), principal=p)
    assert rec.tokens == [11, 4]
    assert client.tokens == (11, 4)
    assert rec.keys == {("k", "t", "m"): [11, 4]}
    assert rec.usage.pending() == [("k", "m", 11, 4, 0)]


@pytest.mark.parametrize("body", [b'{"choices":[{"text":"' + b"x" * 100 + b'"}]}',
                                  b'{"choices":[],"usage":null}', b"not json at all"])  # fmt: skip
def test_a_generating_answer_without_a_usage_is_estimated_not_free(body: bytes) -> None:
    rec, _ = _counted(lambda a, c: a.answer(PROF, c, body))
    assert rec.tokens == [40 // requests.CHARS_PER_TOKEN, len(body) // requests.CHARS_PER_TOKEN]


def test_an_answer_of_an_api_that_generates_nothing_is_not_estimated() -> None:
    rec, _ = _counted(lambda a, c: a.answer(PROF, c, b'{"data":[]}'), kind="embeddings")
    assert rec.tokens == [0, 0]


def test_a_cut_stream_nobody_asked_the_usage_of_is_charged_nothing() -> None:
    rec, _ = _counted(lambda a, c: a.cut(PROF, c, 9), usage_coming=False)
    assert rec.tokens == [0, 0]
    rec, _ = _counted(lambda a, c: a.cut(PROF, c, 9))
    assert rec.tokens == [10, 9]


def test_usage_totals_that_shrink_count_nothing_back() -> None:
    """An engine repeating its totals, once with smaller ones: what was counted stays,
    and no count is negative."""

    def steps(a: Accounting, c: ClientStream) -> None:
        a.usage(PROF, c, requests.Usage(prompt_tokens=10, completion_tokens=5))
        a.usage(PROF, c, requests.Usage(prompt_tokens=8, completion_tokens=3))
        a.usage(PROF, c, requests.Usage(prompt_tokens=10, completion_tokens=7))

    rec, client = _counted(steps, principal=key())
    assert rec.tokens == [10, 7]
    assert client.tokens == (10, 7)
    assert rec.usage.pending() == [("k", "m", 10, 7, 0)]


def test_cached_tokens_are_compared_even_with_none_predicted() -> None:
    """A route that predicted nothing cached (0) is still checked against what the engine
    found: that is the prediction missing a cache."""
    details = requests.PromptDetails(cached_tokens=6)
    told = requests.Usage(prompt_tokens=10, completion_tokens=1, prompt_tokens_details=details)
    rec, _ = _counted(lambda a, c: a.usage(PROF, c, told), predicted=0)
    assert (rec.cached, rec.compared) == ([6], [("e", 0, 6)])
    rec, _ = _counted(lambda a, c: a.usage(PROF, c, told))  # not routed on the cache
    assert (rec.cached, rec.compared) == ([], [])


def test_only_the_logs_keys_owe_usage_rows() -> None:
    """A keys file's key is no key of the fleet's: `llmgw ctl usage` has no row of it."""
    rows = UsageRows()
    local = auth.Principal(tenancy.KeySettings(name="local"), "b" * 64, 0.0)
    rows.used(local, "m", 5, 5)
    rows.request_done(local, "m")
    fleet = key()
    rows.used(fleet, "z", 0, 0)  # nothing to owe
    assert rows.pending() == []
    rows.request_done(fleet, "m")
    assert rows.pending() == [("k", "m", 0, 0, 1)]


class _Held(Store):
    """Counters whose adds wait until `go` is set (or fail, `down`)."""

    def __init__(self) -> None:
        super().__init__()
        self.go = asyncio.Event()
        self.waiting = asyncio.Event()

    async def add(self, subject: str, amount: int) -> int:
        self.waiting.set()
        await self.go.wait()
        return await super().add(subject, amount)


def _owing(rows: UsageRows) -> None:
    p = key()
    rows.used(p, "m", 10, 5)
    rows.request_done(p, "m")


def test_a_flush_under_way_still_owes_its_rows_once_and_nothing_after() -> None:
    async def run() -> tuple[list[Any], list[Any], dict[str, int]]:
        rows, store = UsageRows(), _Held()
        _owing(rows)
        flush = asyncio.create_task(rows.flush(store, 7))  # type: ignore[arg-type]
        await asyncio.wait_for(store.waiting.wait(), 30)
        rows.used(key(), "m", 1, 0)  # a response counted meanwhile
        during = rows.pending()
        store.go.set()
        await flush
        return during, rows.pending(), store.totals

    during, after, totals = asyncio.run(run())
    assert during == [("k", "m", 11, 5, 1)]
    assert after == [("k", "m", 1, 0, 0)]
    assert sorted(totals.values()) == [1, 5, 10]


def test_a_flush_that_fails_or_is_cancelled_owes_every_count_once() -> None:
    async def run() -> tuple[list[Any], list[Any], dict[str, int]]:
        rows, store = UsageRows(), _Held()
        _owing(rows)
        flush = asyncio.create_task(rows.flush(store, 7))  # type: ignore[arg-type]
        await asyncio.wait_for(store.waiting.wait(), 30)
        flush.cancel()  # a stopping router
        with pytest.raises(asyncio.CancelledError):
            await flush
        cancelled = rows.pending()
        store.down, store.go = True, asyncio.Event()
        store.go.set()
        with pytest.raises(Exception, match="down"):
            await rows.flush(store, 7)  # type: ignore[arg-type]
        failed = rows.pending()
        store.down = False
        await rows.flush(store, 7)  # type: ignore[arg-type]
        assert rows.pending() == []
        return cancelled, failed, store.totals

    cancelled, failed, totals = asyncio.run(run())
    assert cancelled == failed == [("k", "m", 10, 5, 1)]
    assert sorted(totals.values()) == [1, 5, 10]


class _Asked:
    """What `accounting.bounds` reads of a request's `ClientStream`."""

    def __init__(self, kind: str, max_out: int | None, choices: int, prompts: int) -> None:
        self.kind = kind
        self.asked_out = asked_out(cast(Kind, kind), max_out, choices, prompts)


def _bounds(
    prof: ModelProfile, kind: str, max_out: int | None, choices: int, prompts: int = 1
) -> tuple[int, int]:
    return bounds(prof, cast(ClientStream, _Asked(kind, max_out, choices, prompts)))


def test_what_an_engines_usage_may_charge_is_bounded_where_the_request_says() -> None:
    """A chat, Messages or completions request: its maximum per answer, the model's context
    (not llama-server's answers: it may shift its context), each of a completions request's
    prompts answered alike. Others (an embeddings request's inputs, a Responses answer's
    turns) only by what a usage field holds."""
    vllm = msgspec.convert({"name": "m", "max_model_len": 1000}, ModelProfile)
    llama = msgspec.convert(
        {"name": "m", "engine": "llamacpp", "max_model_len": 1000}, ModelProfile
    )
    bare = msgspec.convert({"name": "m"}, ModelProfile)
    assert _bounds(bare, "chat", 5, 2) == (MAX_TOKENS, 10)
    assert _bounds(vllm, "messages", None, 1) == (1000, 1000)
    assert _bounds(vllm, "chat", 5000, 3) == (1000, 3000)
    assert _bounds(llama, "chat", None, 1) == (1000, MAX_TOKENS)
    assert _bounds(llama, "chat", -1, 1) == (1000, MAX_TOKENS)
    assert _bounds(vllm, "completions", 5, 1) == (1000, 5)
    assert _bounds(vllm, "completions", 5, 2, prompts=3) == (3000, 30)
    assert _bounds(vllm, "completions", None, 1, prompts=4) == (4000, 4000)
    assert _bounds(llama, "completions", None, 1, prompts=4) == (4000, MAX_TOKENS)
    assert _bounds(bare, "completions", 7, 1, prompts=4) == (MAX_TOKENS, 28)
    huge = msgspec.convert({"name": "m", "max_model_len": 2**30}, ModelProfile)
    assert _bounds(huge, "completions", None, 1, prompts=4) == (MAX_TOKENS, MAX_TOKENS)
    for kind in ("responses", "embeddings"):
        assert _bounds(vllm, kind, 5, 1) == (MAX_TOKENS, MAX_TOKENS)


def test_an_engines_usage_past_what_its_request_could_take_is_logged_once() -> None:
    """An operator learns of an engine that says more than its request could take (a broken
    or lying node): one line per request, however often its stream says so."""
    prof = ModelProfile(name="m", max_model_len=1000)

    def steps(a: Accounting, c: ClientStream) -> None:
        for said in (400, 2000, 3000, 5000):
            a.usage(prof, c, requests.Usage(prompt_tokens=10, completion_tokens=said))

    with capture_logs() as logged:
        rec, client = _counted(steps)
    assert client.tokens == (10, 1000)
    assert rec.tokens == [10, 1000]
    lines = [line for line in logged if line["event"] == "usage_capped"]
    assert len(lines) == 1, logged
    assert lines[0]["said_out"] == 2000
    assert lines[0]["counted_out"] == 1000
    assert lines[0]["request_id"] == "r"


@given(
    st.one_of(
        st.text(max_size=20),
        st.lists(st.integers(0, 50_000), max_size=20),
        st.lists(st.text(max_size=5), min_size=1, max_size=20),
        st.lists(st.lists(st.integers(0, 50_000), max_size=5), min_size=1, max_size=20),
        st.lists(st.integers(0, 9) | st.text(max_size=3), min_size=1, max_size=20),
    )
)
def test_a_completions_request_has_one_prompt_per_string_or_token_list(prompt: Any) -> None:
    """A string, or one list of token ids, is one prompt; a list of either, one each: what
    every engine answers `n` times over (vLLM, SGLang and llama-server alike). A list mixing
    ids and strings llama-server reads as one prompt: one."""
    raw = msgspec.json.encode({"model": "m", "prompt": prompt})
    parsed = requests.parse("completions", raw, want_text=True)
    one = isinstance(prompt, str) or not prompt or any(isinstance(x, int) for x in prompt)
    assert parsed.prompts == (1 if one else len(prompt))
    assert requests.parse("chat", b'{"model": "m", "messages": []}', want_text=False).prompts == 1

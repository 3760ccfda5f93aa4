"""What a request's hold covers and what becomes of it: a hold covers whatever maximum an
engine may read in its body, times the answers it asks for; a hold is never lost when the
lease it waits for fails or its client leaves, nor is a lease of requests; a debt is paid
however large, never forgiven by waiting; a request never holds nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.bus.counters import CounterError
from llmgw.core import quota, subjects
from llmgw.router import holds, requests
from llmgw.router.errors import Refusal
from llmgw.router.holds import Held
from llmgw.router.quotas import Quotas
from tests.unit.test_quotas import Store, key

CAPS = st.none() | st.integers(0, 3) | st.integers(0, 10**7)


def body(**fields: Any) -> bytes:
    return msgspec.json.encode({k: v for k, v in fields.items() if v is not None})


def covers(parsed: requests.Parsed, engine_reads: int | None) -> bool:
    """Whether the hold covers an engine reading `engine_reads` as the body's maximum (None:
    no maximum, generating up to its context: the hold is then the default's)."""
    if engine_reads is None:
        return parsed.max_out is None
    return parsed.max_out is None or parsed.max_out >= engine_reads


@given(CAPS, CAPS, st.none() | st.integers(1, 16))
def test_a_chats_hold_covers_the_maximum_any_engine_reads(
    max_tokens: int | None, max_completion_tokens: int | None, n: int | None
) -> None:
    raw = body(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=max_tokens,
               max_completion_tokens=max_completion_tokens, n=n)  # fmt: skip
    parsed = requests.parse("chat", raw, want_text=False)
    # OpenAI prefers the newer field when it is there at all; vLLM and SGLang read
    # `max_completion_tokens or max_tokens`, so a 0 there leaves the other, or no maximum.
    openai = max_tokens if max_completion_tokens is None else max_completion_tokens
    vllm = max_completion_tokens or max_tokens
    assert covers(parsed, openai)
    assert covers(parsed, vllm or None)
    assert parsed.choices == (n or 1)


@given(CAPS, CAPS, st.sampled_from(["messages", "responses"]))
def test_the_messages_and_responses_holds_cover_their_own_maximum(
    max_tokens: int | None, max_output_tokens: int | None, kind: requests.Kind
) -> None:
    raw = body(model="m", max_tokens=max_tokens, max_output_tokens=max_output_tokens)
    parsed = requests.parse(kind, raw, want_text=False)
    # Each API obeys its own field and ignores the other's, which a client may add too.
    own = max_tokens if kind == "messages" else max_output_tokens
    assert covers(parsed, own or None)


@given(st.none() | st.integers(1, 16), st.none() | st.integers(1, 16))
def test_a_completion_holds_every_sequence_it_generates(n: int | None, best_of: int | None) -> None:
    raw = body(model="m", prompt="hi", max_tokens=10, n=n, best_of=best_of)
    assert requests.parse("completions", raw, want_text=False).choices == max(n or 1, best_of or 1)


def test_a_request_of_several_answers_holds_each_of_them() -> None:
    q = Quotas(Store())  # type: ignore[arg-type]
    p = key(tokens_per_min=1000.0)
    assert q.hold_now(p, 0, 100, 0.0, 8) == 800
    assert q.hold_now(p, 0, None, 0.0, 8) == 1000  # the default for each, to the limit
    refused = q.hold_now(p, 0, 100, 0.0, 20)
    assert isinstance(refused, Refusal)
    assert (refused.status, refused.code) == (400, "request_over_token_limit")
    assert "20 answers (n) of up to 100 completion tokens each" in refused.message
    assert "so that their product is at most 1000" in refused.message


def test_a_request_never_holds_nothing() -> None:
    """An empty prompt asking for no tokens still holds one: a hold of nothing would be
    admitted by a window its key's debt filled; and a key of under a token a minute is
    granted one a window, not none."""

    async def run() -> tuple[object, object]:
        q = Quotas(Store())  # type: ignore[arg-type]
        p = key(tokens_per_min=100.0)
        held = await q.hold(p, 100, 60.5, 0.0)
        assert isinstance(held, Held)
        q.settle(held, 300)
        await q.pay_owed(60.5)
        need = q.hold_now(p, 0, 0, 120.5)
        in_debt = need if not isinstance(need, int) else await q.hold(p, need, 120.5, 0.0)
        slow, other = key(tokens_per_min=0.5), Quotas(Store())  # type: ignore[arg-type]
        first = other.hold_now(slow, 0, 0, 0.0)
        if isinstance(first, int):
            first = await other.hold(slow, first, 0.0, 0.0)
        return in_debt, first

    in_debt, slow = asyncio.run(run())
    assert isinstance(in_debt, Refusal)
    assert in_debt.code == "tokens_exceeded"
    assert isinstance(slow, Held)
    assert slow.tokens == 1


class FailsOn(Store):
    """Fails every add to a subject holding `part` while `failing`."""

    def __init__(self, part: str) -> None:
        super().__init__()
        self.part = part
        self.failing = True

    async def add(self, subject: str, amount: int) -> int:
        if self.failing and self.part in subject:
            raise CounterError("no answer")
        return await super().add(subject, amount)


def test_a_budgets_hold_is_given_back_when_the_windows_lease_fails() -> None:
    """The budget leased and held 600 of 1000; the window's lease then failed (the request
    fell back to this router's bucket). Those 600 go back: the whole budget is there for
    the next request once the counters answer."""

    async def run() -> object:
        store = FailsOn(".t.")
        q = Quotas(store)  # type: ignore[arg-type]
        p = key(tokens_per_min=1000.0, budget_tokens=1000)
        fell_back = await q.hold(p, 600, 1e9, 0.0)
        assert isinstance(fell_back, Held)
        assert fell_back.local
        q.settle(fell_back, 0)
        store.failing = False
        return await q.hold(p, 1000, 1e9 + 1, 0.0)

    assert isinstance(asyncio.run(run()), Held)


class Stalls(Store):
    """Holds every add to a subject holding `part` until `go` is set."""

    def __init__(self, part: str) -> None:
        super().__init__()
        self.part = part
        self.waiting = asyncio.Event()
        self.go = asyncio.Event()

    async def add(self, subject: str, amount: int) -> int:
        if self.part in subject and not self.go.is_set():
            self.waiting.set()
            await self.go.wait()
        return await super().add(subject, amount)


async def cancelled_mid_lease(store: Stalls, request: Coroutine[Any, Any, object]) -> None:
    """Run `request` until its lease is under way, cancel it (its client left), then let
    the lease's answer come and its own task end."""
    gone = asyncio.ensure_future(request)
    await store.waiting.wait()
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    assert gone.cancelled()
    store.go.set()
    for _ in range(10):  # the lease's own task ends: no clock, only turns of the loop
        await asyncio.sleep(0)


def test_a_client_gone_during_a_lease_loses_neither_the_lease_nor_the_budgets_hold() -> None:
    """A request of the whole limit holds the budget, then waits for the window's lease; its
    client leaves (the handler is cancelled). The lease, counted by the server anyway, is
    this router's when it answers, and the budget's hold is back: the next request of the
    whole limit is admitted from them, with no lease of its own."""

    async def run() -> tuple[object, dict[str, int]]:
        store = Stalls(".t.")
        q = Quotas(store)  # type: ignore[arg-type]
        p = key(tokens_per_min=1000.0, budget_tokens=1000)
        await cancelled_mid_lease(store, q.hold(p, 1000, 1e9, 0.0))
        return q.hold_now(p, 4000, 0, 1e9 + 1), dict(store.totals)

    held, totals = asyncio.run(run())
    assert isinstance(held, Held)
    assert sorted(totals.values()) == [1000, 1000]  # one lease of each, no more


LIMIT_AND_OVER = st.integers(1, 200).flatmap(
    lambda n: st.tuples(st.just(n), st.integers(0, 30 * n))
)


@settings(max_examples=40, deadline=None)
@given(LIMIT_AND_OVER)
def test_a_debt_is_paid_however_large_never_forgiven_by_waiting(
    limit_over: tuple[int, int],
) -> None:
    """A key's request used `over` tokens beyond a window's whole limit. With the flusher
    running in every window after, the key is refused in exactly the windows that debt
    fills, however many: the windows past the counters' lifetime included."""

    limit, over = limit_over

    async def run() -> list[bool]:
        q = Quotas(Store())  # type: ignore[arg-type]
        p = key(tokens_per_min=float(limit))
        start = 120 * quota.TOKENS_WINDOW_S + 0.5
        held = await q.hold(p, limit, start, 0.0)
        assert isinstance(held, Held)
        q.settle(held, limit + over)
        await q.pay_owed(start)
        refused = []
        for ahead in range(1, 33):
            wall = start + ahead * quota.TOKENS_WINDOW_S
            await q.pay_owed(wall)
            refused.append(isinstance(await q.hold(p, 1, wall, 0.0), Refusal))
        return refused

    refused = asyncio.run(run())
    full = over // limit
    assert refused == [True] * full + [False] * (len(refused) - full)


def test_a_debt_past_the_counters_lifetime_waits_for_its_window_and_is_added_once() -> None:
    """What a key owes beyond the windows the counters keep is added when its window
    comes: the flusher's next turns meanwhile (four a second) add nothing, or every turn
    would count that debt again."""

    async def run() -> tuple[dict[str, int], dict[str, int]]:
        store = Store()
        q = Quotas(store)  # type: ignore[arg-type]
        p = key(tokens_per_min=100.0)
        start = 120 * quota.TOKENS_WINDOW_S + 0.5
        held = await q.hold(p, 100, start, 0.0)
        assert isinstance(held, Held)
        q.settle(held, 100 + 100 * 20)
        await q.pay_owed(start)
        paid = dict(store.totals)
        for turn in range(1, 5):
            await q.pay_owed(start + turn * 0.25)
        return paid, store.totals

    paid, after = asyncio.run(run())
    past = subjects.limit_counter("k", "t", 120 + holds.DEBT_WINDOWS)
    assert past not in paid  # owed, not added yet
    assert after == paid


class AnswersLate(Stalls):
    """Counts every add at once, as the server does when it gets it, and holds the answer
    to a subject holding `part` until `go` is set."""

    async def add(self, subject: str, amount: int) -> int:
        self.totals[subject] = self.totals.get(subject, 0) + amount
        if self.part in subject and not self.go.is_set():
            self.waiting.set()
            await self.go.wait()
        return self.totals[subject]


def test_a_client_gone_during_a_requests_lease_does_not_lose_the_lease() -> None:
    """A key of 100 requests/s: its first request waits for a lease of two; its client
    leaves meanwhile. The server counted the lease, so it is this router's when the answer
    comes: the next two requests are admitted from it with no round trip."""

    async def run() -> tuple[list[bool], dict[str, int]]:
        store = AnswersLate(".r.")
        q = Quotas(store)  # type: ignore[arg-type]
        p = key(requests_per_s=100.0)
        await cancelled_mid_lease(store, q.admit(p, 100.5, 0.0))
        return [q.admit_now(p, 100.6) for _ in range(3)], dict(store.totals)

    admitted, totals = asyncio.run(run())
    assert totals == {"llmgw.limits.k.r.100": 2}
    assert admitted == [True, True, False]


@given(st.sampled_from(["budget_tokens", "tokens_per_min"]), st.integers(20, 1000))
def test_a_limit_raised_after_it_was_reached_is_leased_again_at_once(
    limit_name: str, more: int
) -> None:
    """A key whose budget (or tokens/min) a router found spent is raised by the operator,
    as the 429 tells its client to ask: the next request is leased of the raised limit. The
    router kept the pool spent until its period ended (a month, for a monthly budget). (The
    refused request's lease was counted, ungranted: the raise must pass it.)"""

    async def run() -> tuple[object, object]:
        q = Quotas(Store())  # type: ignore[arg-type]
        small = key(**{limit_name: 100})
        spent = await q.hold(small, 100, 1e9, 0.0)
        assert isinstance(spent, Held)
        q.settle(spent, 100)
        refused = await q.hold(small, 10, 1e9, 0.0)
        raised = await q.hold(key(**{limit_name: 100 + more}), 10, 1e9, 0.0)
        return refused, raised

    refused, raised = asyncio.run(run())
    assert isinstance(refused, Refusal)
    assert refused.status == 429
    assert isinstance(raised, Held)


@given(st.sampled_from(["budget_tokens", "tokens_per_min"]))
def test_a_limit_found_spent_is_not_asked_again_until_it_is_raised(limit_name: str) -> None:
    """Once a lease of a key's window or budget was granted less than it asked, the next
    requests of the key are refused by this router without a round trip: each would be
    counted and granted nothing, a busy key then costing a round trip per request."""

    async def run() -> tuple[object, object, dict[str, int], dict[str, int]]:
        store = Store()
        q = Quotas(store)  # type: ignore[arg-type]
        p = key(**{limit_name: 100})
        spent = await q.hold(p, 100, 1e9, 0.0)
        assert isinstance(spent, Held)
        q.settle(spent, 100)
        first = await q.hold(p, 10, 1e9, 0.0)  # leases, and is granted nothing
        before = dict(store.totals)
        again = await q.hold(p, 10, 1e9, 0.0)
        return first, again, before, store.totals

    first, again, before, after = asyncio.run(run())
    assert isinstance(first, Refusal)
    assert isinstance(again, Refusal)
    assert after == before


def test_a_connection_closed_during_a_budgets_lease_falls_back_not_crashes() -> None:
    """The counters' connection closes (the router stopping) while a request's budget lease
    is under way: its window's lease falls back as for a counter that does not answer,
    rather than fail the request as a bug (a 500)."""

    async def run() -> object:
        store = Stalls(".b.")
        q = Quotas(store)  # type: ignore[arg-type]
        p = key(tokens_per_min=1000.0, budget_tokens=1000)
        request = asyncio.ensure_future(q.hold(p, 100, 1e9, 0.0))
        await store.waiting.wait()
        q.counters = None  # what the flusher's end does, its connection closed
        store.go.set()
        return await request

    held = asyncio.run(run())
    assert isinstance(held, Held)
    assert held.local


PREDICT = st.none() | st.integers(-2, 3) | st.integers(0, 10**7)


def llama_reads(n_predict: int | None, newer: int | None, older: int | None) -> int | None:
    """llama-server's maximum (its `params_from_json_cmpl`): `n_predict`, else
    `max_completion_tokens`, else `max_tokens`, the first one there; below 0, none at all."""
    read = next((cap for cap in (n_predict, newer, older) if cap is not None), None)
    return None if read is not None and read < 0 else read


@given(PREDICT, CAPS, CAPS, st.none() | st.integers(1, 16), st.none() | st.integers(1, 16),
       st.sampled_from(["chat", "completions", "responses"]))  # fmt: skip
def test_a_hold_covers_what_llama_server_reads(
    n_predict: int | None, newer: int | None, older: int | None, n: int | None,
    n_cmpl: int | None, kind: requests.Kind,
) -> None:  # fmt: skip
    """llama-server obeys `n_predict` over the OpenAI fields, reads `max_completion_tokens`
    on every path (its Responses API renames `max_output_tokens` to `max_tokens` and keeps
    the rest of the body), and generates `n_cmpl` answers over `n`: a client naming a
    small `max_tokens` and a large `n_predict` held a token and had thousands generated."""
    own = {"chat": "messages", "completions": "prompt", "responses": "input"}[kind]
    text: object = [{"role": "user", "content": "hi"}] if kind == "chat" else "hi"
    oldest = "max_output_tokens" if kind == "responses" else "max_tokens"
    fields = {own: text, "n_predict": n_predict, "max_completion_tokens": newer,
              oldest: older, "n": n, "n_cmpl": n_cmpl}  # fmt: skip
    parsed = requests.parse(kind, body(model="m", **fields), want_text=False)
    assert covers(parsed, llama_reads(n_predict, newer, older))
    assert parsed.choices >= (n_cmpl or n or 1)


def test_a_maximum_named_for_llama_server_is_the_one_a_refusal_names() -> None:
    q = Quotas(Store())  # type: ignore[arg-type]
    p = key(tokens_per_min=1000.0)
    raw = body(model="m", prompt="hi", max_tokens=10, n_predict=5000)
    parsed = requests.parse("completions", raw, want_text=False)
    refused = q.hold_now(p, 0, parsed.max_out, 0.0, parsed.choices, parsed.max_field,
                         parsed.choices_field)  # fmt: skip
    assert isinstance(refused, Refusal)
    assert "lower n_predict to at most 1000" in refused.message
    raw = body(model="m", prompt="hi", max_tokens=100, n=1, n_cmpl=20)
    parsed = requests.parse("completions", raw, want_text=False)
    refused = q.hold_now(p, 0, parsed.max_out, 0.0, parsed.choices, parsed.max_field,
                         parsed.choices_field)  # fmt: skip
    assert isinstance(refused, Refusal)
    assert "20 answers (n_cmpl) of up to 100 completion tokens each" in refused.message
    assert "or n_cmpl so that" in refused.message

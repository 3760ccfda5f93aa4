"""A router's share of the fleet's counters (llmgw.router.quotas) over an in-memory counter
store that adds as the server does: several routers' Quotas on one store never admit more
than a key's limit in a window, admit all of it between them, fall back to their own
buckets when the counters fail, and refuse a spent budget saying so."""

from __future__ import annotations

import asyncio
import json
import math
import time
import types
from pathlib import Path
from typing import Any

import nats
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from llmgw import config
from llmgw.bus import provisioning
from llmgw.bus.counters import CounterError
from llmgw.core import quota, tenancy
from llmgw.router import auth
from llmgw.router import quotas as quotas_module
from llmgw.router.errors import Refusal
from llmgw.router.holds import AnsweredCounters, Held
from llmgw.router.quotas import Quotas


class Store:
    """Counters as the server keeps them: one total per subject, increments in order."""

    def __init__(self) -> None:
        self.totals: dict[str, int] = {}
        self.down = False

    async def add(self, subject: str, amount: int) -> int:
        if self.down:
            raise CounterError("down")
        await asyncio.sleep(0)  # another router may go in between
        self.totals[subject] = self.totals.get(subject, 0) + amount
        return self.totals[subject]


def key(**settings_: object) -> auth.Principal:
    p = auth.Principal(tenancy.KeySettings(name="k", **settings_), "a" * 64, 0.0)  # type: ignore[arg-type]
    p.fleet = True
    return p


async def admitted(q: Quotas, p: auth.Principal, wall: float) -> bool:
    if q.admit_now(p, wall):
        return True
    return await q.admit(p, wall, 0.0) is None


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 400), st.integers(1, 5), st.integers(1, 800))
def test_routers_together_admit_exactly_the_limit_in_a_window(
    limit: int, routers: int, requests: int
) -> None:
    async def run() -> int:
        store = Store()
        quotas = [Quotas(store) for _ in range(routers)]  # type: ignore[arg-type]
        keys = [key(requests_per_s=float(limit)) for _ in range(routers)]
        got = await asyncio.gather(*(admitted(quotas[i % routers], keys[i % routers], 100.5)
                                     for i in range(requests)))  # fmt: skip
        return sum(got)

    n = asyncio.run(run())
    assert n <= limit
    # Unused leases are the only waste: at most a lease (2 % of the limit) per router.
    assert n >= min(requests, limit) - routers * max(1, limit // 50)


@settings(max_examples=50, deadline=None)
@given(st.floats(1.0, 60.0), st.integers(1, 4), st.integers(1, 200))
def test_routers_together_admit_no_more_than_a_fractional_rate_in_a_window(
    per_s: float, routers: int, requests: int
) -> None:
    """A rate of 2.5/s is 2 requests in a window of a second, never 3: the fleet's count
    rounds what a window allows down, whatever the routers."""

    async def run() -> int:
        store = Store()
        quotas = [Quotas(store) for _ in range(routers)]  # type: ignore[arg-type]
        p = key(requests_per_s=per_s)
        got = await asyncio.gather(*(admitted(quotas[i % routers], p, 100.5)
                                     for i in range(requests)))  # fmt: skip
        return sum(got)

    assert asyncio.run(run()) <= per_s * quota.rate_window_s(per_s) + 1e-6


@given(st.floats(0.0, 1e7))
def test_a_retry_after_is_never_zero_nor_sooner_than_the_reset(reset_s: float) -> None:
    # `Retry-After: 0` tells a client to retry at once, into the same refusal.
    assert quota.retry_after(reset_s) >= max(1.0, reset_s)


@given(st.sampled_from(["requests", "tokens"]), st.floats(-1e6, 1e6), st.floats(0.0, 1e4))
def test_the_remaining_a_refusal_says_is_never_negative(
    kind: str, remaining: float, reset_s: float
) -> None:
    """A window overshot by a charge, or a budget in debt, has nothing left: `0`, never a
    negative count a client would read as a bug (OpenAI's clients parse it as a count)."""
    headers = dict(quota.rate_headers(kind, 100.0, remaining, reset_s))
    left = int(headers[f"x-ratelimit-remaining-{kind}"])
    assert left == max(0, math.floor(remaining))


@given(st.floats(0.0, 1e5))
def test_a_reset_is_never_written_as_no_wait(seconds: float) -> None:
    # `x-ratelimit-reset-requests: 0ms` tells a client to retry at once, into the refusal.
    assert quota.reset_text(seconds) not in ("0ms", "0s")


def test_an_outage_is_said_once_then_every_thousandth_failure_not_at_each() -> None:
    """Every request that falls back during an outage fails a round trip: the log says
    the outage began, then every 1,000th failure, not each of them."""
    outage = quotas_module.OutageLog()
    with capture_logs() as logged:
        for _ in range(2500):
            outage.failed(CounterError("no answer"))
    warned = [e["errors"] for e in logged if e["event"] == "fleet_limits_unavailable"]
    assert warned == [1, 1000, 2000]


def test_without_counters_a_router_limits_by_its_own_buckets() -> None:
    async def run() -> list[bool]:
        store = Store()
        store.down = True
        q = Quotas(store)  # type: ignore[arg-type]
        p = key(requests_per_s=2.0)
        return [await admitted(q, p, 100.0) for _ in range(4)]

    assert asyncio.run(run()) == [True, True, False, False]


def test_a_spent_budget_is_refused_by_every_router_once_it_reads_the_total() -> None:
    async def run() -> tuple[object, object]:
        store = Store()
        a, b = Quotas(store), Quotas(store)  # type: ignore[arg-type]
        p = key(budget_tokens=100)
        held = await a.hold(p, 70, 1e9, 0.0)
        assert isinstance(held, Held)
        a.settle(held, 110)  # over its hold by 40 (a prompt longer than estimated)
        await a.pay_owed(1e9)  # the flusher
        return await a.hold(p, 1, 1e9, 0.1), await b.hold(p, 1, 1e9, 0.0)

    mine, other = asyncio.run(run())
    for refusal in (mine, other):
        assert isinstance(refusal, Refusal)
        assert refusal.code == "budget_exceeded"
        assert "0 tokens left of its budget of 100 tokens per day" in refusal.message


async def hold_all(quotas: list[Quotas], p: auth.Principal, needs: list[int]) -> list[Held]:
    async def one(i: int, need: int) -> Held | Refusal:
        q = quotas[i % len(quotas)]
        got = q.hold_now(p, 0, need, 120.5)
        return await q.hold(p, got, 120.5, 0.0) if isinstance(got, int) else got

    got = await asyncio.gather(*(one(i, n) for i, n in enumerate(needs)))
    return [h for h in got if isinstance(h, Held)]


@settings(max_examples=60, deadline=None)
@given(st.integers(100, 20_000), st.integers(1, 4),
       st.lists(st.integers(1, 4_000), min_size=1, max_size=60))  # fmt: skip
def test_routers_starting_requests_at_once_hold_no_more_than_the_tokens_per_min(
    limit: int, routers: int, needs: list[int]
) -> None:
    async def run() -> int:
        store = Store()
        quotas = [Quotas(store) for _ in range(routers)]  # type: ignore[arg-type]
        held = await hold_all(quotas, key(tokens_per_min=float(limit)), needs)
        return sum(h.tokens for h in held)

    assert asyncio.run(run()) <= limit


def test_a_window_overshot_is_carried_into_the_next_as_a_debt() -> None:
    """A key of 100 tokens/min whose request used 250 beyond its hold of 50: its window went
    200 over, so the next two windows are full of that debt, and the third is the key's:
    300 tokens in three minutes."""

    async def run() -> tuple[dict[str, int], object, object]:
        store = Store()
        q = Quotas(store)  # type: ignore[arg-type]
        p = key(tokens_per_min=100.0)
        held = await q.hold(p, 50, 120.5, 0.0)
        assert isinstance(held, Held)
        q.settle(held, 300)
        await q.pay_owed(121.0)
        next_window = await q.hold(p, 1, 180.5, 0.0)
        full = await q.hold(p, 1, 240.5, 0.0)
        assert isinstance(full, Refusal)
        after = await q.hold(p, 100, 300.5, 0.0)
        return store.totals, next_window, after

    totals, next_window, after = asyncio.run(run())
    assert isinstance(next_window, Refusal)
    assert next_window.code == "tokens_exceeded"
    assert isinstance(after, Held)
    w = quota.window(120.5, quota.TOKENS_WINDOW_S)
    t = "llmgw.limits.k.t."
    assert totals[f"{t}{w}"] == 300  # the lease (50) and the charge (250)
    assert totals[f"{t}{w + 1}"] >= 100  # the debt's first 100 (and a refused lease)
    assert totals[f"{t}{w + 2}"] >= 100  # its last 100
    assert totals[f"{t}{w + 3}"] == 100  # the key's own


def test_a_request_that_can_never_fit_is_refused_saying_what_to_lower() -> None:
    q = Quotas(Store())  # type: ignore[arg-type]
    p = key(tokens_per_min=1000.0)
    refused = q.hold_now(p, 40, 4000, 0.0)  # 40 characters: about 10 tokens
    assert isinstance(refused, Refusal)
    assert (refused.status, refused.code) == (400, "request_over_token_limit")
    assert "lower max_tokens to at most 1000" in refused.message
    assert q.hold_now(p, 40, 990, 0.0) == 1000  # to hold, with the counters
    assert q.hold_now(p, 40, None, 0.0) == 1000  # no maximum named: the default, to the limit
    # A prompt estimated past the limit (a body of images, say) is held to the whole limit,
    # never refused on the estimate: what it really uses is charged when it ends.
    assert q.hold_now(p, 1_000_000, 100, 0.0) == 1000


def test_a_keys_file_keys_hold_is_given_back_when_it_used_less() -> None:
    p = key(tokens_per_min=100.0)
    p.fleet = False
    q = Quotas()
    # The bucket's own clock, which `settle` reads: from 0.0 it would refill it whole.
    now = time.monotonic()
    assert q.hold_now(p, 0, 80, 0.0) == 80
    first = asyncio.run(q.hold(p, 80, 0.0, now))
    assert isinstance(first, Held)
    assert isinstance(asyncio.run(q.hold(p, 80, 0.0, now)), Refusal)  # 20 left
    q.settle(first, 10)  # 70 back
    assert isinstance(asyncio.run(q.hold(p, 80, 0.0, now)), Held)


def test_a_usage_flush_that_fails_keeps_every_row_it_did_not_send() -> None:
    """The counters fail on the second add of a flush: what was sent stays sent, the rest
    (other models' rows, the failed row's other counts) waits for the next flush."""

    class FailsOnce(Store):
        def __init__(self) -> None:
            super().__init__()
            self.adds = 0

        async def add(self, subject: str, amount: int) -> int:
            self.adds += 1
            if self.adds == 2:
                raise CounterError("timeout")
            return await super().add(subject, amount)

    async def run() -> dict[str, int]:
        store = FailsOnce()
        q = Quotas(store)  # type: ignore[arg-type]
        p = key()
        for model in ("a", "b", "c"):
            q.usage.used(p, model, 10, 5)
            q.usage.request_done(p, model)
        with pytest.raises(CounterError):
            await q._flush_usage()
        await q._flush_usage()
        return store.totals

    totals = asyncio.run(run())
    by_what = {"in": 0, "out": 0, "req": 0}
    for subject, n in totals.items():
        by_what[subject.rsplit(".", 1)[-1]] += n
    assert by_what == {"in": 30, "out": 15, "req": 3}


@given(st.floats(min_value=0.0, exclude_min=True, max_value=1e308) | st.sampled_from([5e-324]))
def test_no_rate_window_outlives_the_counters_that_hold_it(per_s: float) -> None:
    # The limits' counters live LIMITS_MAX_AGE_S: a window of 1,000 s (0.001 req/s) was
    # forgotten after 600 and its key admitted again within it.
    span = quota.rate_window_s(per_s)
    assert 1.0 <= span <= provisioning.LIMITS_MAX_AGE_S
    assert span <= 1 / tenancy.MIN_RATE
    assert quota.allowance(per_s) >= 1


def test_a_keys_file_rate_slower_than_the_fleets_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    entry = auth.entry_yaml("team", auth.new_key(), ("*",))
    path.write_text("keys:\n" + entry + "    requests_per_s: 0.001\n")
    with pytest.raises(config.ConfigError, match=r"requests_per_s must be at least 1/60"):
        auth.load_keys(path, now=0.0)
    path.write_text("keys:\n" + entry + f"    requests_per_s: {tenancy.MIN_RATE}\n")
    assert auth.load_keys(path, now=0.0) is not None


@settings(max_examples=100, deadline=None)
@given(st.floats(min_value=0.0, exclude_min=True, max_value=1e308) | st.sampled_from([5e-324]))
def test_any_positive_rate_is_admitted_or_refused_never_an_error(per_s: float) -> None:
    # A keys file's `requests_per_s: 1e-320` passed its `> 0` check, and then every request
    # of that key ended in an OverflowError: 1 / 1e-320 is inf, a window no integer counts.
    async def run() -> None:
        for down in (False, True):
            store = Store()
            store.down = down
            q = Quotas(store)  # type: ignore[arg-type]
            p = key(requests_per_s=per_s)
            for wall in (100.5, 100.6, 1.8e9):
                await admitted(q, p, wall)

    asyncio.run(run())


def test_a_router_stopping_adds_what_it_owes_and_its_last_usage_to_the_counters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a router counted since its last flush (usage: up to `USAGE_FLUSH_S`) and what a
    key owes reach the counters when it stops (`close`, which cancels the flusher), while
    its connection still takes them: both were lost, `ctl usage` and the budget short."""
    store = Store()

    async def connect(*args: object, **kwargs: object) -> object:
        return object()

    async def close(nc: object) -> None:
        pass

    monkeypatch.setattr(quotas_module.ports_, "connect", connect)
    monkeypatch.setattr(quotas_module.bus, "close", close)
    connected = asyncio.Event()

    def counters(nc: object) -> Store:
        connected.set()
        return store

    monkeypatch.setattr(quotas_module, "AnsweredCounters", counters)

    class NoTls:
        def tls_context(self) -> None:
            return None

    async def run() -> None:
        q = Quotas()
        q.start(NoTls())  # type: ignore[arg-type]
        await connected.wait()
        q.usage.used(key(), "m", 10, 5)
        q.usage.request_done(key(), "m")
        q.owe("k", "d20010909", 7, 1000)
        await q.close()

    asyncio.run(run())
    assert store.totals["llmgw.usage.k.b.d20010909"] == 7
    usage = sorted(n for subject, n in store.totals.items() if ".b." not in subject)
    assert usage == [1, 5, 10]


class FlakyConnection:
    """A NATS connection whose counters answer as the server does, or time out while `down`."""

    def __init__(self) -> None:
        self.totals: dict[str, int] = {}
        self.down = False

    async def request(self, subject: str, payload: bytes, **kw: Any) -> Any:
        if self.down:
            raise nats.errors.TimeoutError
        total = self.totals[subject] = self.totals.get(subject, 0) + int(kw["headers"]["Nats-Incr"])
        return types.SimpleNamespace(data=json.dumps({"val": str(total)}).encode())


def test_each_outage_of_the_counters_is_said_when_it_begins_and_when_it_ends() -> None:
    """A connection that comes back by itself (nats-py reconnects) ends the outage in the
    log, so that the next one is said again: it was said once for the router's life."""

    async def run() -> list[str]:
        nc = FlakyConnection()
        q = Quotas(counters=AnsweredCounters(nc))  # type: ignore[arg-type]
        said: list[str] = []

        async def until(event: str, times: int) -> None:
            for _ in range(2000):
                if said.count(event) >= times:
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(f"{event} said fewer than {times} times: {said}")

        with capture_logs() as logged:
            flusher = asyncio.create_task(q.flush_until_stopped())
            said_so = asyncio.create_task(copy_events(logged, said))
            for _ in range(2):
                nc.down = True
                q.owe("k", "d20261205", 5, 1000)
                await until("fleet_limits_unavailable", said.count("fleet_limits_available") + 1)
                nc.down = False
                await until("fleet_limits_available", said.count("fleet_limits_unavailable"))
            q._stop.set()
            await flusher
            said_so.cancel()
        assert nc.totals == {"llmgw.usage.k.b.d20261205": 10}
        return said

    said = asyncio.run(run())
    assert said == ["fleet_limits_unavailable", "fleet_limits_available"] * 2


async def copy_events(logged: list[dict[str, Any]], said: list[str]) -> None:
    """Keep `said` the outage lines of `logged`, in order, as they come."""
    while True:
        said[:] = [e["event"] for e in logged if e["event"].startswith("fleet_limits")]
        await asyncio.sleep(0.005)

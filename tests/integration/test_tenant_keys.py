"""Tenants' keys as operator events, on real processes: `llmgw ctl key` against a real
nats-server with mutual TLS, real routers following the log, a real `llmgw sim`, and the
`openai` SDK as the client.

What an operator relies on: a key made with ctl works on every router at once, a revoked
one is refused on every router within a second, a rotated one's old secret works for its
overlap and not after, its name (never its secret) is in the metrics and the usage, and
its limits hold for the fleet whatever the number of routers.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import nats.errors
import openai
import pytest

from llmgw import bus
from llmgw.bus import counters
from llmgw.core import events, quota, subjects, tenancy
from llmgw.pki.identity import Identity
from llmgw.router import auth
from tests.harness import TestNatsServer, connect_as, signed_headers, wait_for
from tests.integration.ctl_kit import Ctl
from tests.integration.router_kit import Router, Sim

pytestmark = pytest.mark.slow


def feed(server: TestNatsServer, name: str) -> dict[str, Any]:
    identity = Identity("router", name)
    server.pki.client_tls("router", name)
    certs = server.pki.certs
    return {
        "servers": [server.url],
        "name": name,
        "ca_file": str(certs.ca_cert),
        "cert_file": str(certs.cert(identity)),
        "key_file": str(certs.key(identity)),
    }


@pytest.fixture
def sim() -> Iterator[Sim]:
    s = Sim.start("m", "--decode-base-ms", "1")
    yield s
    s.stop()


@pytest.fixture
async def fleet(
    nats_server: TestNatsServer, sim: Sim, tmp_path: Path
) -> AsyncIterator[tuple[Ctl, list[Router]]]:
    control = await connect_as(nats_server, "control", "c1")
    await bus.provision(control.jetstream())
    await control.close()
    ctl = Ctl(nats_server)
    names = ["r1", "r2", "r3"]
    for n in names:  # every certificate first: each one reloads the server
        feed(nats_server, n)
    routers = [
        Router.start(tmp_path, {"e1": sim}, feed=feed(nats_server, n), auth={}) for n in names
    ]
    try:
        yield ctl, routers
    finally:
        for r in routers:
            r.stop()


def client(router: Router, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0)


async def chat(router: Router, key: str, **kw: Any) -> Any:
    kw.setdefault("max_tokens", 4)
    return await client(router, key).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], **kw
    )


async def accepted(router: Router, key: str) -> bool:
    try:
        await chat(router, key)
    except openai.AuthenticationError:
        return False
    return True


async def test_a_key_made_with_ctl_works_on_every_router_and_revoked_is_refused_within_a_second(
    fleet: tuple[Ctl, list[Router]],
) -> None:
    ctl, routers = fleet
    r1, r2, _ = routers
    # No key at all: a router following the log refuses, it does not serve anonymously.
    with pytest.raises(openai.AuthenticationError):
        await chat(r1, "llmgw-nothing")
    made = (await ctl("key", "create", "--name", "team-a", "--team", "research", "--json")).json()
    secret = made["key"]
    for r in (r1, r2):
        await wait_for(lambda r=r: accepted(r, secret), 10, f"the new key on {r.url}")
    reply = await chat(r1, secret)
    assert reply.choices[0].message.content
    await chat(r2, secret)
    # The log holds its digest, never the secret; list and show say so.
    listed = (await ctl("key", "list", "--json")).json()
    assert [k["name"] for k in listed] == ["team-a"]
    assert secret not in str(listed)
    shown = await ctl("key", "show", "team-a")
    assert shown.code == 0
    assert "team research" in shown.stdout
    assert secret not in shown.stdout
    # Its name (not its secret) labels both routers' metrics.
    for r in (r1, r2):
        m = await asyncio.to_thread(r.metrics)
        mine = [k for k in m if k.startswith("llmgw_router_key_requests_total{") and
                'key="team-a"' in k and 'team="research"' in k and 'status="200"' in k]  # fmt: skip
        assert mine, sorted(k for k in m if "key_" in k)
        assert not any(secret in k for k in m)

    # Its usage, summed over the fleet's routers (they send it every few seconds).
    async def in_usage() -> bool:
        rows = (await ctl("usage", "--key", "team-a", "--json")).json()["usage"]
        return bool(rows) and rows[0]["requests"] >= 4 and rows[0]["tokens_out"] > 0

    await wait_for(in_usage, 30, "the key's usage in ctl usage", every_s=1.0)
    (row,) = (await ctl("usage", "--json")).json()["usage"]
    assert (row["key"], row["team"], row["model"]) == ("team-a", "research", "m")
    # Revoked: refused on both, measured from the moment ctl has it in the log.
    assert (await ctl("key", "revoke", "team-a", "--reason", "leaked")).code == 0
    began = time.monotonic()
    took = [
        await wait_for(lambda r=r: _refused(r, secret), 5, "revocation", every_s=0.02)
        for r in (r1, r2)
    ]
    assert time.monotonic() - began < 1.0, took
    assert (await ctl("key", "show", "team-a")).code == 2


async def _refused(router: Router, key: str) -> bool:
    return not await accepted(router, key)


async def test_a_rotated_keys_old_secret_works_for_its_overlap_only(
    fleet: tuple[Ctl, list[Router]],
) -> None:
    ctl, routers = fleet
    r1 = routers[0]
    old = (await ctl("key", "create", "--name", "svc", "--json")).json()["key"]
    await wait_for(lambda: accepted(r1, old), 10, "the key")
    new = (await ctl("key", "rotate", "svc", "--overlap", "3s", "--json")).json()["key"]
    assert new != old
    await wait_for(lambda: accepted(r1, new), 10, "the new secret")
    assert await accepted(r1, old), "the old secret stops before its overlap ends"
    await wait_for(lambda: _refused(r1, old), 10, "the old secret after its overlap")
    assert await accepted(r1, new)
    # A second rotation without overlap: the last secret stops at once.
    newest = (await ctl("key", "rotate", "svc", "--overlap", "0", "--json")).json()["key"]
    await wait_for(lambda: accepted(r1, newest), 10, "the newest secret")
    assert not await accepted(r1, new)


async def test_a_key_limited_to_20_per_s_gets_20_per_s_through_three_routers(
    fleet: tuple[Ctl, list[Router]], nats_server: TestNatsServer
) -> None:
    ctl, routers = fleet
    key = (await ctl("key", "create", "--name", "busy", "--rps", "20", "--json")).json()["key"]
    for r in routers:
        await wait_for(lambda r=r: accepted(r, key), 10, "the key on every router")
    await asyncio.sleep(1.1)  # the warm-up requests' window is over
    answered: dict[int, int] = {}  # by the second the answer came
    spans: list[tuple[float, float]] = []  # each admitted request: sent, answered
    refusals: list[aiohttp.ClientResponse] = []
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    seconds = 4
    start = int(time.time()) + 1
    end = start + seconds

    async def hammer(session: aiohttp.ClientSession, router: Router) -> None:
        while time.time() < end:
            sent = time.time()
            async with session.post(router.url + "/v1/chat/completions", json=body,
                                    headers=headers) as resp:  # fmt: skip
                await resp.read()
                done = time.time()
                if resp.status == 200:
                    spans.append((sent, done))
                    if start <= done < end:
                        answered[int(done)] = answered.get(int(done), 0) + 1
                elif resp.status == 429 and len(refusals) < 5:
                    refusals.append(resp)

    await asyncio.sleep(max(0.0, start - 0.5 - time.time()))
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(hammer(session, r) for r in routers for _ in range(4)))
    # A request was admitted somewhere between its sending and its answer, so only what
    # those bound is certain on a loaded machine: the requests sent and answered inside one
    # window were admitted in it, and never more than the limit.
    inside: dict[int, int] = {}
    for sent, done in spans:
        if start <= sent and done < end and int(sent) == int(done):
            inside[int(sent)] = inside.get(int(sent), 0) + 1
    assert all(n <= 20 for n in inside.values()), (inside, answered)
    within = sum(1 for sent, done in spans if start <= sent and done < end)
    assert within <= 20 * seconds, (within, answered)
    # Every window admitted its 20: the limit is not a refusal of more than it says.
    total = sum(answered.values())
    assert total >= 20 * seconds * 0.9, answered
    assert refusals, "the key was never refused: the limit did not hold"
    h = refusals[0].headers
    assert int(h["Retry-After"]) >= 1
    assert h["x-ratelimit-limit-requests"] == "20"
    assert h["x-ratelimit-remaining-requests"] == "0"
    assert h["x-ratelimit-reset-requests"].endswith(("ms", "s"))
    # The fleet's counter saw every router's requests, in the same windows.
    nc = await connect_as(nats_server, "operator", "alice")
    try:
        totals = await counters.totals(nc, subjects.LIMITS_STREAM, "llmgw.limits.busy.r.>")
    finally:
        await bus.close(nc)
    assert any(v >= 20 for v in totals.values()), totals


async def test_fifty_requests_at_once_are_admitted_only_up_to_the_fleets_tokens_per_min(
    fleet: tuple[Ctl, list[Router]],
) -> None:
    """A key of 1,000 tokens/min starts 50 requests of max_tokens 100 at once, half through
    each of two routers: what they may cost is held while they run, so no more than ten
    are admitted between the routers (not all 50, as when tokens counted after the fact),
    and the rest are told to retry."""
    ctl, routers = fleet
    r1, r2, _ = routers
    made = await ctl("key", "create", "--name", "tpm", "--tpm", "1000", "--json")
    key = made.json()["key"]
    for r in (r1, r2):  # a bad body holds none of its tokens
        await wait_for(lambda r=r: _bad_body_is(r, key, 400), 10, "the key on both routers")
    # A window of its own: the checks above used none of it, but one that turns mid-burst
    # would let two windows' worth in.
    await asyncio.sleep(quota.reset_in(time.time(), quota.TOKENS_WINDOW_S) + 0.05)

    async def one(router: Router) -> str:
        try:
            await chat(router, key, max_tokens=100)
        except openai.RateLimitError as exc:
            return str(exc.code)
        return "admitted"

    answers = await asyncio.gather(*(one((r1, r2)[i % 2]) for i in range(50)))
    assert set(answers) == {"admitted", "tokens_exceeded"}, answers
    assert answers.count("admitted") <= 1000 // 100, answers
    # A request that could never fit is told what to lower, not to wait.
    with pytest.raises(openai.BadRequestError) as too_big:
        await chat(r1, key, max_tokens=4000)
    assert too_big.value.code == "request_over_token_limit"
    assert "lower max_tokens" in too_big.value.message


async def _bad_body_is(router: Router, key: str, status: int) -> bool:
    """Whether a body that is not JSON, of `key`, is answered `status`."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(router.url + "/v1/chat/completions", data=b"not json",
                     headers={"Authorization": f"Bearer {key}"}) as resp,
    ):  # fmt: skip
        return resp.status == status


async def test_refused_bodies_count_against_a_keys_requests_per_s(
    fleet: tuple[Ctl, list[Router]],
) -> None:
    """A key of a request a minute sending bodies the router reads and refuses is still
    metered: it is told to slow down, not answered 400 without end."""
    ctl, routers = fleet
    made = await ctl("key", "create", "--name", "bad", "--rps", "0.0167", "--json")
    key = made.json()["key"]
    r1 = routers[0]
    await wait_for(lambda: _bad_body_is(r1, key, 400), 10, "the key")
    # Of three more, at most one is in a window of its own (a window is 60 s).
    over = [await _bad_body_is(r1, key, 429) for _ in range(3)]
    assert any(over), over


async def test_a_budget_spent_mid_stream_lets_the_stream_finish_then_refuses_on_every_router(
    fleet: tuple[Ctl, list[Router]],
) -> None:
    ctl, routers = fleet
    r1, r2, _ = routers
    made = await ctl("key", "create", "--name", "small", "--budget-tokens", "120/day", "--json")
    key = made.json()["key"]
    await wait_for(lambda: accepted(r2, key), 10, "the key")  # a few tokens of the budget
    # Its hold is its max_tokens and its prompt's estimate: what the sim's answer may use.
    stream = await client(r1, key).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "tell me a story"}], max_tokens=64,
        stream=True,
    )  # fmt: skip
    chunks = [c.choices[0] async for c in stream if c.choices]
    assert sum(1 for c in chunks if c.delta.content) == 64, "the stream over the budget was cut"
    assert chunks[-1].finish_reason == "length"
    with pytest.raises(openai.RateLimitError) as refused:
        await chat(r1, key, max_tokens=64)  # no longer fits what is left
    assert refused.value.code == "budget_exceeded"
    assert "of its budget of 120 tokens per day" in refused.value.message
    assert int(refused.value.response.headers["Retry-After"]) >= 1

    async def r2_refuses() -> bool:
        try:
            await chat(r2, key, max_tokens=64)
        except openai.RateLimitError as exc:
            return exc.code == "budget_exceeded"
        return False

    # The other router learns the fleet's total within its read interval.
    await wait_for(r2_refuses, 10, "the second router to refuse the spent key")
    budgets = (await ctl("usage", "--key", "small", "--json")).json()["budgets"]
    assert budgets[0]["used"] >= 64
    assert budgets[0]["left"] == 0


def next_month_start(wall: float) -> str:
    """00:00 UTC of the first of the month after `wall`'s, as a budget's 429 writes it."""
    now = datetime.datetime.fromtimestamp(wall, datetime.UTC)
    year, month = (now.year + 1, 1) if now.month == 12 else (now.year, now.month + 1)
    return f"{year}-{month:02d}-01 00:00 UTC"


async def test_a_spent_monthly_budget_names_its_renewal_and_the_field_on_every_api(
    fleet: tuple[Ctl, list[Router]],
) -> None:
    """A monthly budget's 429 said it renews "at 00:00 UTC" (tonight) and to lower
    max_tokens on every API: it names the first of next month, with a Retry-After that
    reaches it, and the field of the API's own maximum."""
    ctl, routers = fleet
    r1 = routers[0]
    made = await ctl("key", "create", "--name", "monthly", "--budget-tokens", "100/month",
                     "--json")  # fmt: skip
    key = made.json()["key"]
    await wait_for(lambda: accepted(r1, key), 10, "the key")  # some of the budget used
    asks = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
         "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
         "max_completion_tokens"),
        ("/v1/completions", {"prompt": "hi"}, "max_tokens"),
        ("/v1/responses", {"input": "hi"}, "max_output_tokens"),
        ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ]  # fmt: skip
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as http:
        for path, body, field in asks:
            before = time.time()
            async with http.post(r1.url + path, json={"model": "m", **body, field: 99}) as r:
                text, after = await r.text(), time.time()
                assert r.status == 429, text
                assert "budget_exceeded" in text
                assert f"lower {field}," in text, text
                renewal = {next_month_start(before), next_month_start(after)}
                assert any(f"(at {when})" in text for when in renewal), text
                ends = tenancy.period_end(before, "month")
                assert ends - after <= int(r.headers["Retry-After"]) <= ends - before + 1


async def test_only_an_operator_under_its_own_name_makes_a_key_that_routers_admit(
    fleet: tuple[Ctl, list[Router]], nats_server: TestNatsServer
) -> None:
    """Tried as an attacker would: a node, a router and another operator each try to make
    a key with a secret they know; no router admits it, and an honest key still works."""
    ctl, routers = fleet
    r1 = routers[0]
    secret = auth.new_key()
    forged = events.KeyCreated(id="forged-1", ts=1.0, operator="alice", sha256=auth.digest(secret),
                               key=tenancy.KeySettings(name="backdoor"))  # fmt: skip
    payload = events.encode(forged)
    # A node, on its own subject (the server lets it write there), signed by itself.
    node = await connect_as(nats_server, "node", "node-a")
    own = subjects.node_event("node-a", "registered")
    await node.jetstream().publish(own, payload, headers=signed_headers(node, own, payload, "f1"))
    # An operator, on its own subject, naming another operator as the author.
    bob = await connect_as(nats_server, "operator", "bob")
    bobs = subjects.operator_event("bob", "key_created")
    await bob.jetstream().publish(bobs, payload, headers=signed_headers(bob, bobs, payload, "f2"))
    # A router, on the operator subject: the server refuses it.
    router = await connect_as(nats_server, "router", "r1")
    alices = subjects.operator_event("alice", "key_created")
    with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
        await router.jetstream().publish(alices, payload, timeout=1.0)
    for nc in (node, bob, router):
        await bus.close(nc)
    honest = (await ctl("key", "create", "--name", "honest", "--json")).json()["key"]
    await wait_for(lambda: accepted(r1, honest), 10, "the honest key")  # the log was folded
    assert not await accepted(r1, secret)
    assert [k["name"] for k in (await ctl("key", "list", "--json")).json()] == ["honest"]

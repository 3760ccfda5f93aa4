"""A key's budget through an outage of the fleet's counters, on real processes: a real
nats-server stopped mid-test and started again, a real router following the log, a real
`llmgw sim`, and the `openai` SDK as the client.

What an operator relies on: while NATS is down a router spends of a budget only its share of
what it last read to be left, then refuses saying the budget cannot be checked; and once
NATS is back, the budget's counter holds what was spent during the outage, also when the
router that spent it was stopped or killed before then and another took its place.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest

from llmgw import bus
from llmgw.bus import counters
from llmgw.core import subjects, tenancy
from llmgw.router.spool import decode
from tests.harness import TestNatsServer, connect_as, wait_for
from tests.integration.ctl_kit import Ctl
from tests.integration.router_kit import Router, Sim
from tests.integration.test_tenant_keys import accepted, chat, feed
from tests.integration.test_tenant_keys import sim as sim  # the fixture

pytestmark = pytest.mark.slow

BUDGET = 1000
ROUTERS = 2
"""The router's `auth.fleet_routers`: its share of what it read to be left is a half."""
MAX_TOKENS = 100


@pytest.fixture
async def router(
    nats_server: TestNatsServer, sim: Sim, tmp_path: Path
) -> AsyncIterator[tuple[Ctl, Router]]:
    control = await connect_as(nats_server, "control", "c1")
    await bus.provision(control.jetstream())
    await control.close()
    # Every certificate before the router starts: each one reloads the server.
    ctl, log = Ctl(nats_server), feed(nats_server, "r1")
    r = Router.start(tmp_path, {"e1": sim}, feed=log, auth={"fleet_routers": ROUTERS})
    try:
        yield ctl, r
    finally:
        r.stop()


async def usage_totals(server: TestNatsServer, key: str, kind: str) -> dict[str, int]:
    """The key's counters of `kind` (`b`: budgets, `h`: hourly usage), as an operator reads
    them from the server."""
    nc = await connect_as(server, "operator", "alice")
    try:
        return await counters.totals(nc, subjects.USAGE_STREAM, f"llmgw.usage.{key}.{kind}.>")
    finally:
        await bus.close(nc)


async def budget_used(server: TestNatsServer, key: str) -> int:
    """The budget's counter for today, as the server holds it."""
    totals = await usage_totals(server, key, "b")
    return totals.get(subjects.budget_counter(key, tenancy.period_of(time.time(), "day")), 0)


async def spend_until_refused(r: Router, key: str) -> tuple[int, openai.APIStatusError]:
    """Requests of MAX_TOKENS until one is refused: the tokens the admitted ones used, and
    the refusal."""
    used = 0
    for _ in range(2 * BUDGET // MAX_TOKENS):
        try:
            reply = await chat(r, key, max_tokens=MAX_TOKENS)
        except openai.APIStatusError as exc:
            return used, exc
        assert reply.usage is not None
        used += reply.usage.total_tokens
    raise AssertionError(f"never refused while NATS was down; {used} tokens admitted")


async def test_a_budget_holds_through_an_outage_and_its_counter_gets_what_was_spent(
    router: tuple[Ctl, Router], nats_server: TestNatsServer
) -> None:
    ctl, r = router
    made = await ctl("key", "create", "--name", "thrifty", "--budget-tokens", f"{BUDGET}/day",
                     "--json")  # fmt: skip
    key = made.json()["key"]
    await wait_for(lambda: accepted(r, key), 10, "the key")  # the router reads the budget
    before = await budget_used(nats_server, "thrifty")
    assert 0 < before < BUDGET

    await asyncio.to_thread(nats_server.stop)  # by its pid, SIGTERM
    try:
        spent, refused = await spend_until_refused(r, key)
    finally:
        await asyncio.to_thread(nats_server.start)
    assert refused.status_code == 503
    assert refused.code == "budget_unavailable", refused.message
    assert "budget counters cannot be reached" in refused.message
    assert int(refused.response.headers["Retry-After"]) >= 1
    # Its share: half of what its reading left, and the rest of what it had leased (a lease
    # of 20 tokens here), give or take what prompts used beyond their estimates.
    assert 0 < spent <= (BUDGET - before) // ROUTERS + MAX_TOKENS + 20, (before, spent)

    async def counted() -> bool:
        return await budget_used(nats_server, "thrifty") >= before + spent

    await wait_for(counted, 60, "what the outage spent, in the budget's counter")
    # Nothing was lost, and the budget held: its share of the rest, at most, was spent.
    assert await budget_used(nats_server, "thrifty") <= BUDGET
    # nats-py reconnected by itself: the router says the outage began, and that it ended.
    assert r.log_path is not None
    log = r.log_path
    await wait_for(lambda: "fleet_limits_available" in log.read_text(), 30, "the outage's end")
    said = log.read_text()
    assert said.index("fleet_limits_unavailable") < said.index("fleet_limits_available")


def owed_in(spool: Path) -> int:
    """The budget tokens a router's spool says it owes; 0 while it has none."""
    try:
        data = spool.read_bytes()
    except FileNotFoundError:
        return 0
    return sum(b.tokens for b in decode(data).budgets)


async def tokens_counted(server: TestNatsServer, key: str) -> int:
    """The tokens the key's hourly usage counters hold (what `ctl usage` bills from)."""
    totals = await usage_totals(server, key, "h")
    return sum(n for subject, n in totals.items() if subject.endswith((".in", ".out")))


@pytest.mark.parametrize("ending", ["stopped", "killed"])
async def test_what_a_router_spent_in_an_outage_is_counted_after_it_stops_and_another_starts(
    nats_server: TestNatsServer, sim: Sim, tmp_path: Path, ending: str
) -> None:
    """The router that spent during the outage is gone before NATS is back (stopped, or
    killed once its spool holds what it spent): the process started in its place, on the
    same state_dir, adds what it owed to the budget's counter and the usage counters."""
    control = await connect_as(nats_server, "control", "c1")
    await bus.provision(control.jetstream())
    await control.close()
    ctl, log = Ctl(nats_server), feed(nats_server, "r1")
    state = tmp_path / "state"
    same = {"feed": log, "auth": {"fleet_routers": ROUTERS}, "state_dir": str(state)}
    r = Router.start(tmp_path, {"e1": sim}, **same)
    try:
        made = await ctl("key", "create", "--name", "thrifty", "--budget-tokens",
                         f"{BUDGET}/day", "--json")  # fmt: skip
        key = made.json()["key"]
        await wait_for(lambda: accepted(r, key), 10, "the key")
        before = await budget_used(nats_server, "thrifty")
        await asyncio.to_thread(nats_server.stop)
        spent, refused = await spend_until_refused(r, key)
        assert refused.code == "budget_unavailable", refused.message
        spool = state / "owed-0.json"
        if ending == "killed":
            await wait_for(lambda: owed_in(spool) >= spent, 30, "the spool, what was spent")
            r.kill()
        else:
            assert r.stop() == 0  # a clean stop, which writes what it owes
            assert owed_in(spool) >= spent
    finally:
        r.stop()
        if not nats_server.running:
            await asyncio.to_thread(nats_server.start)

    again = Router.start(tmp_path, {"e1": sim}, **same)
    try:

        async def counted() -> bool:
            return await budget_used(nats_server, "thrifty") >= before + spent

        await wait_for(counted, 60, "what the outage spent, in the budget's counter")
        assert await budget_used(nats_server, "thrifty") <= BUDGET
        await wait_for(lambda: not spool.exists(), 30, "the spool removed once paid")
        # The outage's tokens, in what `ctl usage` bills from.
        assert await tokens_counted(nats_server, "thrifty") >= spent
    finally:
        again.stop()


def test_each_worker_of_a_router_keeps_a_spool_of_its_own(
    nats_server: TestNatsServer, sim: Sim, tmp_path: Path
) -> None:
    """Two workers on one state_dir: each holds its own file's lock from its start, so what
    either spends through an outage outlives a stop; neither runs with its debts in memory
    only."""
    state = tmp_path / "state"
    r = Router.start(tmp_path, {"e1": sim}, workers=2, feed=feed(nats_server, "r1"),
                     state_dir=str(state))  # fmt: skip
    try:
        # Each worker opens its spool before it says it listens.
        assert sorted(p.name for p in state.glob("owed-*.lock")) == ["owed-0.lock", "owed-1.lock"]
    finally:
        assert r.stop() == 0
    assert r.log_path is not None
    said = r.log_path.read_text()
    assert "owed_spool_taken" not in said
    assert "owed_spool_unavailable" not in said

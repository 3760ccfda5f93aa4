"""Routers whose host clocks are off read the NATS server's time (llmgw.router.clock).

Read on a host clock, a router 30 s ahead counted a key's requests into windows 30 s
away from the other routers' (so the fleet admitted the key's limit twice over), and one
an hour behind honoured a key for an hour after it expired. These tests run a real
nats-server and routers in this process, each given the wall clock its host would have.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import msgspec
import pytest
from aiohttp import web

from llmgw import bus
from llmgw.bus import counters
from llmgw.core import subjects
from llmgw.router import auth
from llmgw.router.app import Router
from llmgw.router.config import RouterConfig
from llmgw.router.errors import Refusal
from llmgw.router.front import build_server
from tests.harness import TestNatsServer, connect_as, wait_for
from tests.integration.ctl_kit import Ctl
from tests.integration.test_tenant_keys import feed
from tests.unit.test_router_clock import Asking

pytestmark = pytest.mark.slow

LIMIT = 10
"""The key's requests/s."""


@asynccontextmanager
async def serving(server: TestNatsServer, name: str, skew_s: float) -> AsyncIterator[Router]:
    """A router on a host whose clock is `skew_s` off, serving HTTP (its `admin_url` set to
    its address), once it has measured the server's time."""
    state = str(server.root / f"router-{name}-state")  # what it owes budgets, if anything
    cfg = msgspec.convert(
        {"log": feed(server, name), "models": [{"name": "m"}], "probe_interval_s": 60,
         "state_dir": state},
        RouterConfig,
    )  # fmt: skip
    router = Router(cfg, clock=lambda: time.time() + skew_s)
    await router.start()
    runner = web.ServerRunner(build_server(router))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    router.admin_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        await wait_for(lambda: router.clock.measured, 30, f"{name} to measure the server's time")
        yield router
    finally:
        await runner.cleanup()
        await router.stop()


@pytest.fixture
async def ctl(nats_server: TestNatsServer) -> Ctl:
    control = await connect_as(nats_server, "control", "c1")
    await bus.provision(control.jetstream())
    await control.close()
    for name in ("good", "off"):  # every certificate first: each one reloads the server
        feed(nats_server, name)
    return Ctl(nats_server)


def knows(router: Router, secret: str) -> bool:
    return auth.digest(secret) in router.keys.by_digest


def refusal_of(router: Router, secret: str) -> str | None:
    """The code of the router's refusal of `secret`, None when it admits it."""
    got = router._caller(Asking(secret))  # type: ignore[arg-type]
    return got.code if isinstance(got, Refusal) else None


@pytest.mark.parametrize("skew_s", [30.0, -3600.0])
async def test_two_routers_one_off_count_a_keys_requests_in_the_same_windows(
    ctl: Ctl, nats_server: TestNatsServer, skew_s: float
) -> None:
    made = await ctl("key", "create", "--name", "busy", "--rps", str(LIMIT), "--json")
    secret = made.json()["key"]
    async with (
        serving(nats_server, "good", 0.0) as good,
        serving(nats_server, "off", skew_s) as off,
    ):
        for r in (good, off):
            await wait_for(lambda r=r: knows(r, secret), 30, "the key on every router")
        # Every request the key authenticates counts, its body refused (400) or not: no
        # engine is needed. 429: over the key's requests/s.
        spans: list[tuple[float, float]] = []  # each admitted request: sent, answered
        began = time.time()
        end = began + 3.0

        url = "/v1/chat/completions"
        headers = {"Authorization": f"Bearer {secret}"}

        async def hammer(session: aiohttp.ClientSession, router: Router) -> None:
            while time.time() < end:
                sent = time.time()
                async with session.post(
                    router.admin_url + url, data=b"{}", headers=headers
                ) as resp:
                    await resp.read()
                    assert resp.status in (400, 429), resp.status
                    if resp.status == 400:
                        spans.append((sent, time.time()))

        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(hammer(session, r) for r in (good, off) for _ in range(3)))
    # Requests sent and answered inside one second were admitted in its window.
    inside: dict[int, int] = {}
    for sent, done in spans:
        if int(sent) == int(done):
            inside[int(sent)] = inside.get(int(sent), 0) + 1
    assert all(n <= LIMIT for n in inside.values()), inside
    # The windows both routers counted in are the seconds the server lived through.
    nc = await connect_as(nats_server, "operator", "alice")
    try:
        totals = await counters.totals(nc, subjects.LIMITS_STREAM, "llmgw.limits.busy.r.>")
    finally:
        await bus.close(nc)
    windows = sorted(int(s.rsplit(".", 1)[1]) for s in totals)
    assert windows, totals
    assert all(int(began) - 1 <= w <= int(time.time()) + 1 for w in windows), (began, windows)


async def test_a_router_an_hour_behind_refuses_a_key_once_it_expired(
    ctl: Ctl, nats_server: TestNatsServer
) -> None:
    made = await ctl("key", "create", "--name", "brief", "--expires", "+3s", "--json")
    secret = made.json()["key"]
    async with serving(nats_server, "off", -3600.0) as off:
        await wait_for(lambda: knows(off, secret), 30, "the key on the router")
        expires_at = off.keys.by_digest[auth.digest(secret)].settings.expires_at
        assert expires_at is not None
        await asyncio.sleep(max(0.0, expires_at + 0.5 - time.time()))
        assert refusal_of(off, secret) == "expired_api_key"
        # What it measured, and what its /metrics says (LlmgwRouterClockOffset's input).
        assert off.clock.offset == pytest.approx(3600.0, abs=1.0)
        assert off.metrics.clock_offset.values[()] == pytest.approx(3600.0, abs=1.0)


async def test_a_router_an_hour_behind_ends_a_rotated_secrets_overlap_on_time(
    ctl: Ctl, nats_server: TestNatsServer
) -> None:
    old = (await ctl("key", "create", "--name", "svc", "--json")).json()["key"]
    async with serving(nats_server, "off", -3600.0) as off:
        await wait_for(lambda: knows(off, old), 30, "the key on the router")
        assert refusal_of(off, old) is None
        new = (await ctl("key", "rotate", "svc", "--overlap", "2s", "--json")).json()["key"]
        await wait_for(lambda: knows(off, new), 30, "the rotated key on the router")
        until = off.keys.until[auth.digest(old)]
        await asyncio.sleep(max(0.0, until + 0.5 - time.time()))
        assert refusal_of(off, new) is None
        assert refusal_of(off, old) == "invalid_api_key"

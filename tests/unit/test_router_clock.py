"""A router reads the NATS server's time (llmgw.router.clock): measured on its counters'
connection, exported, and read wherever it judges by UNIX time; a server that does not
answer keeps it on its host's clock without holding up its start."""

from __future__ import annotations

import datetime
import json
import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict

from llmgw.bus import servertime
from llmgw.core.tenancy import KeySettings
from llmgw.router import auth, clock
from llmgw.router.app import Router
from llmgw.router.config import RouterConfig
from llmgw.router.errors import Refusal


class _Answer:
    def __init__(self, data: bytes) -> None:
        self.data = data


class _Server:
    """What `servertime.ask` uses of a NATS connection: a server whose clock is this
    machine's, answering STREAM.INFO of the log with its time."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def request(self, subject: str, payload: bytes, **options: float) -> _Answer:
        self.asked.append(subject)
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        return _Answer(json.dumps({"config": {}, "ts": now}).encode())


class Asking:
    """What `Router._caller` reads of a request: its headers, as aiohttp holds them."""

    def __init__(self, secret: str) -> None:
        self.headers = CIMultiDict({"Authorization": f"Bearer {secret}"})


def _keeper(wall: Any, server: Any) -> tuple[clock.ClockKeeper, list[float]]:
    reported: list[float] = []
    keeper = clock.ClockKeeper(servertime.of(wall), lambda: server, reported.append)
    return keeper, reported


async def test_a_router_whose_server_does_not_answer_starts_on_its_hosts_clock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(clock, "START_WAIT_S", 0.05)
    keeper, reported = _keeper(time.time, None)
    await keeper.start()  # returns after START_WAIT_S: no connection, no answer
    try:
        assert not keeper.measured.is_set()
        assert not keeper.clock.measured
        assert reported == []
        assert keeper.clock() == pytest.approx(time.time(), abs=1.0)
    finally:
        await keeper.close()


@given(skew_s=st.floats(min_value=-86_400.0, max_value=86_400.0, allow_nan=False))
async def test_a_measurement_moves_a_routers_clock_to_the_servers(skew_s: float) -> None:
    server = _Server()
    keeper, reported = _keeper(lambda: time.time() + skew_s, server)
    await keeper.measure()
    assert server.asked == ["$JS.API.STREAM.INFO.llmgw-events"]
    assert keeper.measured.is_set()
    assert keeper.clock() == pytest.approx(time.time(), abs=1.0)
    (offset,) = reported
    assert offset == pytest.approx(-skew_s, abs=1.0)


async def test_a_router_refuses_a_key_expired_by_the_servers_time_whatever_its_hosts() -> None:
    behind = 3600.0
    router = Router(RouterConfig(), clock=lambda: time.time() - behind)
    secret = auth.new_key()
    expired = KeySettings(name="brief", expires_at=time.time() - 10)
    router.keys = auth.Keys([auth.Principal(expired, auth.digest(secret), time.monotonic())])

    try:
        # Unmeasured, the router reads its host's clock: an hour behind, the key is valid.
        assert not isinstance(router._caller(Asking(secret)), Refusal)  # type: ignore[arg-type]
        keeper = clock.ClockKeeper(router.clock, _Server, lambda _: None)
        await keeper.measure()
        refused = router._caller(Asking(secret))  # type: ignore[arg-type]
        assert isinstance(refused, Refusal)
        assert refused.code == "expired_api_key"
        # The same clock names its keys' windows and budget periods.
        assert router.dispatcher.clock is router.clock
        assert router.dispatcher.quotas.clock is router.clock
    finally:
        router.pool.close()
        router.deadlines.close()

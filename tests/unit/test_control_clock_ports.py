"""The control plane's clock measurement on in-memory ports: a server slow to tell its time.

The control plane asks the server its time at start and every few seconds after
(llmgw.bus.servertime). An answer that does not come (a busy server, a stream
electing its leader, a request lost with a connection) must hold up neither the start
nor the leader's renewals of its lease: a renewal that waits on it lets the lease run
out, and the fleet loses its leader for as long as the question hangs. What was read of
the clock before a correction moves with it.
"""

from __future__ import annotations

import asyncio
import time
import types
from typing import Any, cast

import pytest

from llmgw.bus import servertime
from llmgw.bus import signals as signals_
from llmgw.bus.memory import LeaseBucket, MemoryLease, MemorySnapshots
from llmgw.control.ports import ControlPorts
from llmgw.control.scaling import SCALE_EVERY_S
from llmgw.control.service import ControlService
from llmgw.core import autoscale
from tests.unit.test_control_ports import RecordingLog, config, running, until

HOUR_S = 3600.0


class UnansweredLease(MemoryLease):
    """A lease whose server answers the first `answered` requests for its time, then none;
    it counts its renewals."""

    def __init__(self, bucket: LeaseBucket, name: str, *, answered: int) -> None:
        super().__init__(bucket, name, ttl_s=1.0)  # renewed every third of a second
        self.answered = answered
        self.asked = self.renewals = 0

    async def server_time(self) -> float | None:
        self.asked += 1
        if self.answered <= 0:
            await asyncio.Event().wait()  # never answers
        self.answered -= 1
        return await super().server_time()

    async def renew(self) -> None:
        await super().renew()
        self.renewals += 1


def service(lease: UnansweredLease) -> ControlService:
    ports = ControlPorts(log=RecordingLog(), snapshots=MemorySnapshots(), lease=lease)
    return ControlService(config(), ports=ports)


async def test_a_time_never_told_holds_up_no_renewal_of_the_lease(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(servertime, "ASK_TIMEOUT_S", 0.05)
    lease = UnansweredLease(LeaseBucket(), "control-a", answered=1)  # the start's only
    async with running(service(lease)) as svc:
        await until(lambda: lease.renewals >= 6, "six renewals, two TTLs of the lease")
        assert svc.leading


async def test_no_lease_is_sought_until_the_server_has_told_its_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Judged by its host's clock, a leader whose host runs an hour ahead would find every
    # node lost at once: an instance leads only once it knows the server's time.
    monkeypatch.setattr(servertime, "ASK_TIMEOUT_S", 0.05)
    lease = UnansweredLease(LeaseBucket(), "control-a", answered=0)
    async with running(service(lease)) as svc:
        await until(lambda: svc.caught_up.is_set() and lease.asked >= 3, "three unanswered")
        assert not svc.leading
        assert await lease.holder() is None
        lease.answered = 1_000_000
        await until(lambda: svc.leading, "leadership, the server's time told")


def test_what_the_autoscaler_read_of_the_clock_moves_with_it() -> None:
    svc = service(UnansweredLease(LeaseBucket(), "control-a", answered=0))
    scaler, now = svc.scaler, svc.clock()
    scaler.decided_at = now
    history = scaler.history["m1"] = autoscale.Recommendations(now)
    history.add(now, 3, keep_s=600.0)
    svc._clock_moved(-HOUR_S)  # the server's clock stepped back an hour, say
    later = now - HOUR_S + 301.0
    # The leader decides again a second later, not an hour later; and a down window of
    # five minutes has been seen whole five minutes later (else it holds the count).
    assert later - scaler.decided_at >= SCALE_EVERY_S
    assert history.ceiling(later, 300.0, current=5) == 3


async def test_the_routers_reports_are_read_from_a_few_seconds_ago_by_the_servers_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = time.time
    ahead = types.SimpleNamespace(time=lambda: real() + HOUR_S)  # this host's clock
    monkeypatch.setattr(signals_, "time", ahead)
    starts: list[float] = []

    class Started(Exception):
        pass

    def reader(nc: Any, *, since: float | None = None, **_: Any) -> None:
        starts.append(ahead.time() - signals_.START_WINDOW_S if since is None else since)
        raise Started

    monkeypatch.setattr(signals_, "SignalsReader", reader)
    svc = ControlService(config(), clock=ahead.time)
    svc.clock.observe(servertime.Sample(ahead.time(), real(), ahead.time()))
    svc._nc = cast(Any, object())
    with pytest.raises(Started):
        await svc._follow_signals()
    assert starts[0] == pytest.approx(real() - signals_.START_WINDOW_S, abs=1.0)

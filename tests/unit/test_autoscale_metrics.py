"""The autoscaler's signals on the control plane's /metrics page
(`llmgw_control_autoscale_signal`): a model's series leave the page when the model leaves
the catalog, and when no router's report keeps its observation fresh. The same
`ControlService` as production on in-memory ports and an injected clock, scraped over
HTTP at its admin listener."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable

import aiohttp
import msgspec

from llmgw.bus.memory import LeaseBucket, MemoryLease, MemoryLog, MemorySnapshots
from llmgw.control.metrics import Metrics
from llmgw.control.ports import ControlPorts
from llmgw.control.scaler import REPORT_MAX_AGE_S
from llmgw.control.scaling import SCALE_EVERY_S
from llmgw.control.service import ControlService
from llmgw.core import events, loadreport, subjects
from llmgw.core.autoscale import Autoscale, Observation, Signals
from llmgw.core.profile import ModelProfile

from .test_control_ports import DEADLINE_S, config, running, until

Series = dict[tuple[str, str], float]
_LABELS = re.compile(r'^llmgw_control_autoscale_signal\{model="([^"]*)",signal="([^"]*)"\} (\S+)$')


class Clock:
    """The service's, the log's and the lease's time: it moves only when a test moves it."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def _service(clock: Clock) -> tuple[ControlService, MemoryLog]:
    log = MemoryLog(clock=clock)
    lease = MemoryLease(LeaseBucket(clock=clock), "control-a")
    cfg = msgspec.structs.replace(config(), models=(), sync_models=False, lease_ttl_s=600.0)
    ports = ControlPorts(log=log, snapshots=MemorySnapshots(), lease=lease)
    return ControlService(cfg, clock=clock, ports=ports), log


async def _declare(log: MemoryLog, clock: Clock, *names: str) -> None:
    for name in names:
        spec = Autoscale(min=0, max=2, waiting_per_replica=1.0, ttft_p90_s=1.0)
        profile = ModelProfile(name=name, engine="sim", replicas=0, autoscale=spec)
        await log.append(events.ModelDeclared(id=f"declare-{name}", ts=clock(), operator="alice",
                                              profile=profile))  # fmt: skip


def _report(svc: ControlService, clock: Clock, *models: str) -> None:
    """A router saw first tokens of `models` (no requests: nothing to scale), and the
    leader's next pass is due."""
    clock.now += SCALE_EVERY_S
    traffic = tuple(loadreport.ModelTraffic(model=m, ttft_p90_s=0.25, samples=4) for m in models)
    report = loadreport.LoadReport(ts=clock(), models=traffic)
    svc.scaler.note(subjects.router_signals("router-1", 0), report)


async def _scrape(svc: ControlService) -> Series:
    async with aiohttp.ClientSession() as http, http.get(f"{svc.admin_url}/metrics") as resp:
        assert resp.status == 200
        page = await resp.text()
    found = (_LABELS.match(line) for line in page.splitlines())
    return {(m[1], m[2]): float(m[3]) for m in found if m is not None}


async def _scraped_until(svc: ControlService, check: Callable[[Series], bool], what: str) -> Series:
    deadline = time.monotonic() + DEADLINE_S
    while not check(series := await _scrape(svc)):
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {series}"
        await asyncio.sleep(0.01)
    return series


def _models(series: Series) -> set[str]:
    return {model for model, _ in series}


async def test_a_removed_models_signals_leave_the_metrics_page() -> None:
    clock = Clock()
    svc, log = _service(clock)
    async with running(svc):
        await until(lambda: svc.leading and svc.state.leader == "control-a", "leadership")
        await _declare(log, clock, "m1", "m2")
        await until(lambda: {"m1", "m2"} <= set(svc.state.models), "the models folded")
        _report(svc, clock, "m1", "m2")
        seen = await _scraped_until(svc, lambda s: _models(s) == {"m1", "m2"}, "both exported")
        assert seen[("m1", "ttft_p90_s")] == 0.25
        await log.append(events.ModelRemoved(id="remove-m1", ts=clock(), operator="alice",
                                             name="m1"))  # fmt: skip
        await until(lambda: "m1" not in svc.state.models, "the removal folded")
        # At once, before any other pass of the autoscaler: the page follows the catalog.
        assert _models(await _scrape(svc)) == {"m2"}
        _report(svc, clock, "m1", "m2")  # a router still reporting the old model
        await _scraped_until(svc, lambda s: ("m2", "recommended") in s, "m2 exported")
        assert _models(await _scrape(svc)) == {"m2"}


async def test_signals_no_router_keeps_fresh_leave_the_page_and_come_back_with_a_report() -> (
    None
):  # fmt: skip
    clock = Clock()
    svc, log = _service(clock)
    async with running(svc):
        await until(lambda: svc.leading and svc.state.leader == "control-a", "leadership")
        await _declare(log, clock, "m1")
        await until(lambda: "m1" in svc.state.models, "the model folded")
        _report(svc, clock, "m1")
        await _scraped_until(svc, lambda s: _models(s) == {"m1"}, "m1 exported")
        # Every router gone (or cut off) for longer than a report counts: the leader holds
        # its counts and observes nothing, so the last observation is no longer exported.
        clock.now += REPORT_MAX_AGE_S + 1
        assert await _scrape(svc) == {}
        _report(svc, clock, "m1")
        back = await _scraped_until(svc, lambda s: _models(s) == {"m1"}, "m1 exported again")
        assert back[("m1", "ttft_p90_s")] == 0.25


def test_each_signal_is_exported_under_its_own_name_models_in_order() -> None:
    """Every signal a distinct value, so that none can stand in for another."""
    offsets = {"waiting": 1.0, "running": 2.0, "kv_usage": 0.3, "ttft_p90_s": 0.4,
               "itl_p90_s": 0.05, "requests": 6.0, "recommended": 7.0}  # fmt: skip

    def observed(base: int) -> Observation:
        o = {name: base + offset for name, offset in offsets.items()}
        signals = Signals(waiting=o["waiting"], running=o["running"], kv_usage=o["kv_usage"],
                          ttft_p90_s=o["ttft_p90_s"], itl_p90_s=o["itl_p90_s"],
                          requests=int(o["requests"]))  # fmt: skip
        return Observation(signals=signals, recommended=int(o["recommended"]), up_floor=0,
                           down_ceiling=9)  # fmt: skip

    metrics = Metrics()
    metrics.export_autoscale(lambda: {"m2": observed(20), "m1": observed(10)})
    page = metrics.render().decode()
    found = [m for m in map(_LABELS.match, page.splitlines()) if m is not None]
    expected = [(model, signal, base + offset) for model, base in (("m1", 10), ("m2", 20))
                for signal, offset in offsets.items()]  # fmt: skip
    assert [(m[1], m[2], float(m[3])) for m in found] == expected

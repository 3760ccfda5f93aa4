"""What one node or router controls (the content and size of what it publishes on its
own subjects) costs the control plane bounded work and memory, and never a log that
grows by itself."""

from __future__ import annotations

from llmgw.control.scaler import Scaler
from llmgw.core import events, loadreport, subjects
from llmgw.router.config import RouterConfig, validate

from .scenarios import Sim


def test_a_heartbeat_listing_a_gpu_twice_is_recorded_once_not_forever() -> None:
    # Two different reports of GPU 0 in one heartbeat: the leader recorded the first as a
    # change, folded it, then saw the second differ and recorded it, and so on, a durable
    # GpuHealthChanged at every pass for as long as the agent sent that heartbeat.
    sim = Sim()
    sim.register("n1", count=2)
    sim.heartbeat("n1", [events.GpuHealth(index=0, ecc_uncorrected=1), events.GpuHealth(index=0)])
    recorded = [d for _ in range(6) for d in sim.leader() if isinstance(d, events.GpuHealthChanged)]
    assert len(recorded) == 1
    assert sim.state.seen["n1"].health == (events.GpuHealth(index=0, ecc_uncorrected=1),)


def test_a_router_naming_endless_workers_holds_a_bounded_number_of_reports() -> None:
    # A router's certificate lets it write `llmgw.signals.router.<its name>.*`: the leader
    # kept the latest report of every subject for a minute and aggregated all of them
    # every second, so a router writing under a new worker token per message grew both
    # with its message rate rather than with its workers.
    scaler = Scaler()
    report = loadreport.LoadReport(ts=10.0)
    for i in range(subjects.MAX_ROUTER_WORKERS + 500):
        scaler.note(f"llmgw.signals.router.r1.w{i}", report)
    for token in ("x", "w01", "w-1", "w" + "9" * 40):
        scaler.note(f"llmgw.signals.router.r1.{token}", report)
    assert len(scaler.reports) == subjects.MAX_ROUTER_WORKERS
    assert subjects.signals_owner(subjects.router_signals("r1", 0)) == ("router", "r1")
    assert subjects.signals_owner("llmgw.signals.router.r1.anything") is None


def test_a_router_cannot_be_configured_with_more_workers_than_are_read() -> None:
    too_many = RouterConfig(workers=subjects.MAX_ROUTER_WORKERS + 1)
    assert any("workers must be between 1" in p for p in validate(too_many, where="x"))
    most = RouterConfig(workers=subjects.MAX_ROUTER_WORKERS)
    assert not any("workers" in p for p in validate(most, where="x"))

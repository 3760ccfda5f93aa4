"""What one node or router controls (the content and size of what it publishes on its
own subjects) costs the control plane bounded work and memory, and never a log that
grows by itself."""

from __future__ import annotations

from llmgw.core import events

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

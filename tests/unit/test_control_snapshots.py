"""The control plane's snapshots on in-memory ports (llmgw.control.snapshotting): the
sequence it reports as its last snapshot (`snapshot_seq`, its gauge, `/v1/state`) only
moves forward, whatever order overlapping saves finish in, and a save that fails moves
nothing."""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec

from llmgw.bus.memory import LeaseBucket, MemoryLease, MemorySnapshots
from llmgw.control.config import SnapshotConfig
from llmgw.control.ports import ControlPorts
from llmgw.control.service import ControlService
from tests.unit.test_control_ports import DEADLINE_S, RecordingLog, config, register, running, until


class HeldSnapshots(MemorySnapshots):
    """Snapshots on a slow store: the first save waits until `release`, then stores or
    fails; the second stores at once; any later one waits until `later`."""

    def __init__(self, *, fail: bool = False) -> None:
        super().__init__()
        self.fail = fail
        self.holding = asyncio.Event()
        self.release = asyncio.Event()
        self.later = asyncio.Event()
        self.saves: list[int] = []

    async def save(self, data: bytes, seq: int) -> None:
        self.saves.append(seq)
        if len(self.saves) == 1:
            self.holding.set()
            await asyncio.wait_for(self.release.wait(), DEADLINE_S)
            if self.fail:
                raise OSError("the store is unreachable")
        elif len(self.saves) > 2:
            await asyncio.wait_for(self.later.wait(), DEADLINE_S)
        await super().save(data, seq)


def _gauge(svc: ControlService) -> float:
    value = svc.metrics.registry.get_sample_value("llmgw_control_snapshot_seq")
    assert value is not None
    return value


async def _snapshot_seq_read(svc: ControlService) -> int:
    async with aiohttp.ClientSession() as http, http.get(f"{svc.admin_url}/v1/state") as resp:
        assert resp.status == 200
        return int((await resp.json())["snapshot_seq"])


async def _overlapping_saves(snaps: HeldSnapshots) -> tuple[ControlService, int, int]:
    """A leader whose background snapshot (every 2 events) is held while more events fold
    and `snapshot_now` saves a later sequence; then the held one is let go. The service
    (stopped), the held save's sequence and snapshot_now's."""
    log, bucket = RecordingLog(), LeaseBucket()
    cfg = msgspec.structs.replace(config(), snapshot=SnapshotConfig(every_events=2, every_s=0))
    svc_ports = ControlPorts(log=log, snapshots=snaps, lease=MemoryLease(bucket, "control-a"))
    async with running(ControlService(cfg, ports=svc_ports)) as svc:
        await until(lambda: svc.leading, "leadership")
        await register(log, "node-a")
        await until(snaps.holding.is_set, "a background snapshot being saved")
        held = snaps.saves[0]
        await register(log, "node-b")
        await until(lambda: "node-b" in svc.state.nodes, "node-b folded")
        now = await svc.snapshot_now()
        assert now > held
        assert svc.snapshot_seq == now
        snaps.release.set()
        assert svc._snapshot_task is not None
        await asyncio.wait_for(asyncio.shield(svc._snapshot_task), DEADLINE_S)
        assert svc.snapshot_seq == now
        assert _gauge(svc) == now
        assert await _snapshot_seq_read(svc) == now
        snaps.later.set()
    return svc, held, now


async def test_a_snapshot_saved_late_never_moves_the_reported_sequence_back() -> None:
    snaps = HeldSnapshots()
    svc, held, now = await _overlapping_saves(snaps)
    assert sorted(snaps.saved)[:2] == [held, now]  # both stored
    assert svc.snapshot_seq == max(snaps.saved) == _gauge(svc)
    count = svc.metrics.registry.get_sample_value("llmgw_control_snapshots_total")
    assert count == len(snaps.saved)


async def test_a_failed_snapshot_leaves_the_reported_sequence_and_count_alone() -> None:
    snaps = HeldSnapshots(fail=True)
    svc, held, _ = await _overlapping_saves(snaps)
    assert held not in snaps.saved
    assert svc.snapshot_seq == max(snaps.saved) == _gauge(svc)
    count = svc.metrics.registry.get_sample_value("llmgw_control_snapshots_total")
    assert count == len(snaps.saved)

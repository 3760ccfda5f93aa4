"""A control plane restarted from a snapshot (llmgw.control.snapshotting) on in-memory
ports: as a standby (another instance holds the lease, so nothing is written), it reports
what one that folded the log from 0 does (digest, folded and control sequences), plus the
snapshot's sequence in `snapshot_seq` and both gauges, also when the snapshot ends at a
control event and nothing follows it; a snapshot that does not decode, or a store that
cannot be read, costs only a fold from 0."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec
from structlog.testing import capture_logs

from llmgw.bus.memory import LeaseBucket, MemoryLease, MemorySnapshots, Snapshot
from llmgw.control.ports import ControlPorts
from llmgw.control.service import ControlService
from llmgw.core import events, state
from tests.unit.test_control_ports import RecordingLog, config, register, running, until


def _quiet(name: str) -> object:
    """No models to place or sync: a leader writes its election and nothing more."""
    return msgspec.structs.replace(config(name), models=(), sync_models=False)


def _gauge(svc: ControlService, name: str) -> float | None:
    return svc.metrics.registry.get_sample_value(name)


async def _history(log: RecordingLog, bucket: LeaseBucket, snaps: MemorySnapshots) -> int:
    """node-a registered, then control-a elected and a snapshot saved at its election (a
    control event, the last of the log); control-a stopped and `control-x` holding the
    lease from then on. The snapshot's sequence."""
    await register(log, "node-a")
    lease = MemoryLease(bucket, "control-a")
    ports = ControlPorts(log=log, snapshots=snaps, lease=lease)
    async with running(ControlService(_quiet("control-a"), ports=ports)) as svc:  # type: ignore[arg-type]
        await until(lambda: svc.leading and svc.state.leader == "control-a", "leadership")
        await until(lambda: svc.state.last_seq == log.records()[-1].seq, "the election folded")
        snap = await svc.snapshot_now()
    assert isinstance(log.records()[-1].event, events.LeaderElected)
    assert log.records()[-1].seq == snap
    assert await MemoryLease(bucket, "control-x", ttl_s=600).acquire()
    return snap


async def _standby(
    log: RecordingLog, bucket: LeaseBucket, snaps: object, name: str
) -> ControlService:
    """A standby started on `snaps`, stopped once caught up with the whole log."""
    ports = ControlPorts(log=log, snapshots=snaps, lease=MemoryLease(bucket, name))  # type: ignore[arg-type]
    async with running(ControlService(_quiet(name), ports=ports)) as svc:  # type: ignore[arg-type]
        await until(svc.caught_up.is_set, f"{name} caught up")
        assert svc.state.last_seq == log.records()[-1].seq
        assert not svc.leading
    return svc


async def test_a_standby_from_a_snapshot_reports_what_a_fold_from_0_does() -> None:
    log, bucket, snaps = RecordingLog(), LeaseBucket(), MemorySnapshots()
    snap = await _history(log, bucket, snaps)
    loaded = await _standby(log, bucket, snaps, "control-b")
    scratch = await _standby(log, bucket, MemorySnapshots(), "control-c")
    assert state.digest(loaded.state) == state.digest(scratch.state)
    assert loaded.state.last_seq == scratch.state.last_seq == snap
    assert loaded.control_seq == scratch.control_seq == snap  # the election, at the snapshot
    assert "node-a" in loaded.state.nodes
    assert (loaded.snapshot_seq, scratch.snapshot_seq) == (snap, 0)
    assert _gauge(loaded, "llmgw_control_snapshot_seq") == snap
    assert _gauge(loaded, "llmgw_control_folded_seq") == snap  # nothing after it to fold


class Unusable(MemorySnapshots):
    """A store whose `load` raises `error`, or answers `data` at the snapshot's sequence."""

    def __init__(self, load: Callable[[], Awaitable[Snapshot | None]]) -> None:
        super().__init__()
        self._load = load

    async def load(self, *, at_or_before: int | None = None) -> Snapshot | None:
        return await self._load()


async def _unreadable() -> Snapshot | None:
    raise OSError("the object store is unreachable")


async def _undecodable() -> Snapshot | None:
    return Snapshot(seq=2, data=b"\xff not a snapshot")


async def test_a_snapshot_that_cannot_be_read_or_decoded_costs_only_a_fold_from_0() -> None:
    log, bucket, snaps = RecordingLog(), LeaseBucket(), MemorySnapshots()
    await _history(log, bucket, snaps)
    scratch = await _standby(log, bucket, MemorySnapshots(), "control-c")
    for load, said in ((_unreadable, "snapshot_unreadable"), (_undecodable, "snapshot_invalid")):
        with capture_logs() as logged:
            svc = await _standby(log, bucket, Unusable(load), "control-b")
        assert said in [e["event"] for e in logged]
        assert state.digest(svc.state) == state.digest(scratch.state)
        assert svc.snapshot_seq == 0
        assert _gauge(svc, "llmgw_control_snapshot_seq") == 0

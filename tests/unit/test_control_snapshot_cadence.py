"""When a leader saves snapshots on its own (llmgw.control.snapshotting, `snapshot.every_events`
and `snapshot.every_s`), on in-memory ports: after every N events folded, not one event
sooner; at most once every T seconds while events keep coming; never again for a state
already saved; never a second save while one is still being written; and with neither
set, never."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable

import msgspec

from llmgw.bus.memory import LeaseBucket, MemoryLease, MemorySnapshots
from llmgw.control.config import SnapshotConfig
from llmgw.control.ports import ControlPorts
from llmgw.control.service import ControlService
from llmgw.core import events
from tests.unit.test_control_ports import DEADLINE_S, RecordingLog, config, register, running, until


class Recorded(MemorySnapshots):
    """Every save with its monotonic time; with `hold`, the first waits for `release`."""

    def __init__(self, *, hold: bool = False) -> None:
        super().__init__(keep=1000)
        self.hold = hold
        self.release = asyncio.Event()
        self.saves: list[tuple[int, float]] = []

    async def save(self, data: bytes, seq: int) -> None:
        self.saves.append((seq, time.monotonic()))
        if self.hold and len(self.saves) == 1:
            await asyncio.wait_for(self.release.wait(), DEADLINE_S)
        await super().save(data, seq)

    def seqs(self) -> list[int]:
        return [seq for seq, _ in self.saves]


class Leader:
    """A leader with no models (it writes its election only) and this snapshot cadence;
    node-a registered. `checks()` counts its snapshot checks (after each batch folded and
    at each reconcile tick), for waiting on a number of chances to save."""

    def __init__(self, svc: ControlService, log: RecordingLog) -> None:
        self.svc, self.log, self.beats = svc, log, 0
        self._checks = 0
        check = svc._maybe_snapshot

        def counted(*, force: bool = False) -> None:
            self._checks += 1
            check(force=force)

        svc._maybe_snapshot = counted  # type: ignore[method-assign]

    def checks(self) -> int:
        return self._checks

    async def beat(self) -> int:
        """One heartbeat of node-a, folded; its sequence."""
        self.beats += 1
        hb = events.Heartbeat(id=f"hb-{self.beats}", ts=time.time(), node="node-a", seq=self.beats)
        seq = (await self.log.append(hb, ttl_s=60)).seq
        await until(lambda: self.svc.state.last_seq >= seq, f"heartbeat {seq} folded")
        return seq

    async def idle(self, checks: int = 10) -> None:
        """Wait for `checks` more chances to save."""
        target = self._checks + checks
        await until(lambda: self._checks >= target, f"{checks} snapshot checks")


@contextlib.asynccontextmanager
async def leading(cadence: SnapshotConfig, snaps: Recorded) -> AsyncIterator[Leader]:
    log, bucket = RecordingLog(), LeaseBucket()
    cfg = msgspec.structs.replace(config(), models=(), sync_models=False, snapshot=cadence)
    ports = ControlPorts(log=log, snapshots=snaps, lease=MemoryLease(bucket, "control-a"))
    svc = ControlService(cfg, ports=ports)
    leader = Leader(svc, log)
    async with running(svc):
        await until(lambda: svc.leading, "leadership")
        await register(log, "node-a")
        await until(lambda: "node-a" in svc.state.nodes, "node-a folded")
        yield leader


def saved_up_to(snaps: Recorded, seq: int) -> Callable[[], bool]:
    return lambda: bool(snaps.saves) and snaps.seqs()[-1] == seq


async def test_every_n_events_saves_at_the_nth_and_never_the_same_state_twice() -> None:
    snaps = Recorded()
    async with leading(SnapshotConfig(every_events=2, every_s=0), snaps) as leader:
        for _ in range(3):  # line up with a save: whatever the election and registration left
            seq = await leader.beat()
            if saved_up_to(snaps, seq)():
                break
        assert saved_up_to(snaps, seq)(), snaps.saves
        for _ in range(3):
            await leader.beat()
            await leader.idle()
            assert snaps.seqs()[-1] == seq, "saved after one event of two"
            seq = await leader.beat()
            await until(saved_up_to(snaps, seq), f"a snapshot at {seq}")
        await leader.idle()
    assert len(snaps.seqs()) == len(set(snaps.seqs())), snaps.saves


async def test_every_t_seconds_saves_at_most_that_often_and_only_what_is_new() -> None:
    every_s = 0.2
    snaps = Recorded()
    async with leading(SnapshotConfig(every_events=0, every_s=every_s), snaps) as leader:
        started = time.monotonic()
        while time.monotonic() - started < 4 * every_s:  # events faster than the cadence
            seq = await leader.beat()
            await leader.idle(1)
        await until(saved_up_to(snaps, seq), f"a snapshot at {seq}")
        saved = len(snaps.saves)
        await leader.idle(int(2 * every_s / 0.05) + 10)  # idle ticks, past another every_s
        assert len(snaps.saves) == saved, snaps.saves
    times = [t for _, t in snaps.saves]
    assert len(times) >= 2
    assert all(b - a >= every_s * 0.5 for a, b in itertools.pairwise(times)), times
    assert len(snaps.seqs()) == len(set(snaps.seqs()))


async def test_with_no_cadence_a_leader_never_saves_on_its_own() -> None:
    snaps = Recorded()
    async with leading(SnapshotConfig(every_events=0, every_s=0), snaps) as leader:
        for _ in range(3):
            await leader.beat()
        await leader.idle(20)
        assert snaps.saves == []
        assert await leader.svc.snapshot_now() == leader.svc.state.last_seq
    assert snaps.seqs() == [leader.svc.state.last_seq]


async def test_no_second_save_starts_while_one_is_being_written() -> None:
    snaps = Recorded(hold=True)
    async with leading(SnapshotConfig(every_events=1, every_s=0), snaps) as leader:
        await until(lambda: bool(snaps.saves), "a save begun")
        for _ in range(3):
            await leader.beat()
        await leader.idle()
        assert len(snaps.saves) == 1, snaps.saves
        snaps.release.set()
        # The events folded meanwhile are saved once the first save is done.
        await until(saved_up_to(snaps, leader.svc.state.last_seq), "the later state saved")
    assert len(snaps.seqs()) == len(set(snaps.seqs()))

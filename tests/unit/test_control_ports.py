"""The control plane's logic on in-memory ports (llmgw.bus.memory): no nats-server.

The same `ControlService` as production, constructed with a `MemoryLog`, a
`MemoryLease` and `MemorySnapshots` (llmgw.control.ports): it elects itself through
the lease port, folds a node's registration, and appends its placement with fences on
the control subjects; a write fenced on a sequence that a rival has moved past is
refused and the instance steps down. Each test runs in well under a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import nats.errors

from llmgw import bus
from llmgw.bus.memory import LeaseBucket, MemoryLease, MemoryLog, MemoryReader, MemorySnapshots
from llmgw.control.config import AdminListener, ControlConfig, SnapshotConfig
from llmgw.control.ports import ControlPorts
from llmgw.control.service import ControlService
from llmgw.core import events, subjects
from llmgw.core.inventory import Gpu
from llmgw.core.profile import ModelProfile

DEADLINE_S = 10.0
"""Generous: a loaded machine may be slow; each test normally takes milliseconds."""


class RecordingLog(MemoryLog):
    """A MemoryLog that remembers the fence of every append, and can let a rival write
    first (as a second leader that still believes it leads would)."""

    def __init__(self) -> None:
        super().__init__()
        self.fences: list[tuple[str, bus.Fence | None]] = []
        self.before: Callable[[events.Event], Any] | None = None

    async def append(
        self,
        event: events.Event,
        *,
        subject: str | None = None,
        fence: bus.Fence | None = None,
        ttl_s: float | None = None,
    ) -> bus.Published:
        if self.before is not None:
            await self.before(event)
        self.fences.append((event.id, fence))
        return await super().append(event, subject=subject, fence=fence, ttl_s=ttl_s)


def gpus(count: int) -> tuple[Gpu, ...]:
    return tuple(
        Gpu(
            index=i,
            uuid=f"GPU-{i:04d}",
            name="NVIDIA H100 80GB HBM3",
            gpu_class="h100-80g",
            memory_mib=81559,
            compute_capability="9.0",
            nvlink_domain=0,
        )
        for i in range(count)
    )


def config(name: str = "control-a") -> ControlConfig:
    return ControlConfig(
        name=name,
        lease_ttl_s=10.0,
        reconcile_interval_s=0.05,
        snapshot=SnapshotConfig(every_events=0, every_s=0),
        models=(ModelProfile(name="m1", engine="sim", replicas=1),),
        admin=AdminListener(host="127.0.0.1", port=0),
    )


@contextlib.asynccontextmanager
async def running(svc: ControlService) -> AsyncIterator[ControlService]:
    stop = asyncio.Event()
    task = asyncio.create_task(svc.run(stop))
    try:
        yield svc
    finally:
        stop.set()
        await asyncio.wait_for(task, DEADLINE_S)


async def until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def register(log: MemoryLog, node: str) -> None:
    now = time.time()
    await log.append(
        events.NodeRegistered(
            id=f"{node}-reg", ts=now, node=node, address="127.0.0.1", gpus=gpus(2)
        )
    )
    await log.append(events.Heartbeat(id=f"{node}-hb-1", ts=now, node=node, seq=1), ttl_s=60)


def of_type(log: MemoryLog, kind: type[events.Event]) -> list[bus.Record]:
    return [r for r in log.records() if isinstance(r.event, kind)]


def ports(log: MemoryLog, bucket: LeaseBucket, name: str = "control-a") -> ControlPorts:
    return ControlPorts(log=log, snapshots=MemorySnapshots(), lease=MemoryLease(bucket, name))


async def test_it_leads_through_the_lease_port_and_places_with_fences() -> None:
    log, bucket = RecordingLog(), LeaseBucket()
    started = time.monotonic()
    async with running(ControlService(config(), ports=ports(log, bucket))) as svc:
        await until(lambda: svc.leading and svc.state.leader == "control-a", "leadership")
        holder = await MemoryLease(bucket, "control-b").holder()
        assert holder is not None
        assert (holder.holder, holder.epoch) == ("control-a", svc.epoch)
        await register(log, "node-a")
        await until(lambda: bool(of_type(log, events.StartShard)), "a StartShard")
        assert "node-a" in svc.state.nodes
        placed = of_type(log, events.ReplicaPlaced)
        assert len(placed) == 1
        assert placed[0].event.epoch == svc.epoch  # type: ignore[union-attr]
    # Every decision (control event or command) was fenced on the control subjects, at
    # the last control sequence written before it.
    fences = dict(log.fences)
    control_before = 0
    for record in log.records():
        if isinstance(record.event, events.ControlEvent | events.Command) and not (
            record.subject.startswith(f"{subjects.EVENTS_ROOT}.operator")
        ):
            assert fences[record.event.id] == bus.Fence(
                subjects.CONTROL_EVENTS_ALL, control_before
            ), record
        if record.subject.startswith(f"{subjects.EVENTS_ROOT}.control."):
            control_before = record.seq
    assert bucket.entry() is None  # released at shutdown
    assert time.monotonic() - started < DEADLINE_S


async def test_a_write_fenced_behind_a_rival_is_refused_and_the_instance_steps_down() -> None:
    log, bucket = RecordingLog(), LeaseBucket()
    rival_wrote: list[int] = []

    async def rival_first(event: events.Event) -> None:
        # The rival writes on the control subjects just before our first placement.
        if isinstance(event, events.ReplicaPlaced) and not rival_wrote:
            log.before = None
            rogue = events.LeaderElected(
                id="rival-leader", ts=time.time(), leader="control-b", epoch=1, basis_seq=0
            )
            rival_wrote.append((await log.append(rogue)).seq)

    log.before = rival_first
    async with running(ControlService(config(), ports=ports(log, bucket))) as svc:
        await until(lambda: svc.leading and svc.state.leader == "control-a", "leadership")
        first_epoch = svc.epoch
        await register(log, "node-a")
        await until(lambda: svc.metrics.fence_refused._value.get() == 1, "the fence refusal")
        # The refused placement of the first epoch was never stored.
        assert not [r for r in of_type(log, events.ReplicaPlaced) if r.event.epoch == first_epoch]  # type: ignore[union-attr]
        # It gave the lease up and contends again: a later epoch places the replica.
        await until(
            lambda: any(
                r.event.epoch > first_epoch  # type: ignore[union-attr]
                for r in of_type(log, events.ReplicaPlaced)
            ),
            "a placement in a later epoch",
        )
    assert rival_wrote


async def test_it_folds_from_a_snapshot_and_the_tail_on_memory_ports() -> None:
    log, bucket = RecordingLog(), LeaseBucket()
    first = ports(log, bucket)
    async with running(ControlService(config(), ports=first)) as svc:
        await register(log, "node-a")
        await until(lambda: bool(of_type(log, events.StartShard)), "a StartShard")
        snap_seq = await svc.snapshot_now()
    await register(log, "node-b")
    again = ControlPorts(log=log, snapshots=first.snapshots, lease=MemoryLease(bucket, "c-b"))
    async with running(ControlService(config("c-b"), ports=again)) as svc:
        await until(lambda: "node-b" in svc.state.nodes, "the tail folded")
        assert svc.snapshot_seq == snap_seq
        assert "node-a" in svc.state.nodes


async def test_simulated_agents_on_the_memory_log_get_their_replicas_serving() -> None:
    from tests.integration.control_kit import SimAgent

    log, bucket = RecordingLog(), LeaseBucket()
    cfg = msgspec.structs.replace(
        config(), models=(ModelProfile(name="m1", engine="sim", replicas=2),)
    )
    agents = [
        SimAgent(None, node, log=log, heartbeat_s=0.05, serve_after_s=0.01)
        for node in ("node-a", "node-b")
    ]
    try:
        async with running(ControlService(cfg, ports=ports(log, bucket))) as svc:
            for agent in agents:
                await agent.start()

            def serving() -> int:
                st = svc.state
                return sum(1 for r in st.active_replicas("m1") if r.id in st.endpoints)

            await until(lambda: serving() == 2, "two replicas of m1 serving")
            assert sum(len(a.running) for a in agents) == 2
    finally:
        for agent in agents:
            await agent.close()


class ModelHistoryUnreadableOnce(RecordingLog):
    """The model sync's history read gets no answer the first time, as in a NATS cluster
    while the stream elects a new leader (the consumer create times out)."""

    def __init__(self) -> None:
        super().__init__()
        self.refused = 0

    def reader(self, **kwargs: Any) -> Any:
        if str(kwargs.get("name", "")).endswith("-m") and not self.refused:
            self.refused += 1
            return _NoAnswer()
        return super().reader(**kwargs)


class _NoAnswer:
    async def __aenter__(self) -> None:
        raise bus.ReaderError("no answer creating a consumer on llmgw-events: TimeoutError()")

    async def __aexit__(self, *exc: object) -> None:
        return None


async def test_a_read_that_gets_no_answer_is_retried_and_the_control_plane_keeps_leading() -> None:
    log, bucket = ModelHistoryUnreadableOnce(), LeaseBucket()
    async with running(ControlService(config(), ports=ports(log, bucket))) as svc:
        await until(lambda: bool(of_type(log, events.ModelDeclared)), "the models synced")
        assert log.refused == 1
        assert svc.leading
        await register(log, "node-a")
        await until(lambda: bool(of_type(log, events.StartShard)), "a StartShard")


async def test_a_leader_whose_lease_was_taken_steps_down_at_its_next_renewal() -> None:
    """Its lease expired while it paused and another instance took it: the renewal says
    so, and it stops deciding at once (two leaders would fight over the fleet)."""
    log, bucket = RecordingLog(), LeaseBucket()
    lease = MemoryLease(bucket, "control-a", ttl_s=1.5)
    svc_ports = ControlPorts(log=log, snapshots=MemorySnapshots(), lease=lease)
    async with running(ControlService(config(), ports=svc_ports)) as svc:
        await until(lambda: svc.leading and svc.state.leader == "control-a", "leadership")
        bucket.delete()
        bucket.write("control-b", 0, 60.0)  # the rival holds it now, for a long while
        await until(lambda: not svc.leading, "the step-down")
        assert svc.epoch == 0


async def test_a_leader_that_folds_a_newer_epoch_steps_down_and_frees_the_lease() -> None:
    """Another instance announced a newer epoch: deciding on in the older one would only
    be refused, and holding the lease meanwhile would leave the fleet without a leader."""
    log, bucket = RecordingLog(), LeaseBucket()
    async with running(ControlService(config(), ports=ports(log, bucket))) as svc:
        await until(lambda: svc.leading and svc.state.leader == "control-a", "leadership")
        newer = events.LeaderElected(
            id="newer", ts=time.time(), leader="control-b", epoch=svc.epoch + 5, basis_seq=0
        )
        await log.append(newer)
        await until(lambda: not svc.leading, "the step-down")
        await until(lambda: bucket.entry() is None or svc.leading, "the lease freed")


class SlowToFoldLog(RecordingLog):
    """Its followers' reader hands each batch over only after `lag_s`, as a busy server or
    a long network path does: the leader's own writes reach its fold late."""

    lag_s = 0.3

    def reader(self, **kwargs: Any) -> Any:
        inner = super().reader(**kwargs)
        if not kwargs.get("follow", True):
            return inner
        lag = self.lag_s

        async def lagging() -> AsyncIterator[list[bus.Record]]:
            async for batch in MemoryReader.batches(inner):
                await asyncio.sleep(lag)
                yield batch

        inner.batches = lagging  # type: ignore[method-assign]
        return inner


async def test_a_leader_decides_again_only_once_it_has_folded_its_own_writes() -> None:
    """Ticks come every 50 ms; its placement reaches its fold 300 ms later. Deciding on the
    state before would place the replica again (refused by the fence, a leader lost)."""
    log, bucket = SlowToFoldLog(), LeaseBucket()

    async def heartbeats() -> None:  # each folded batch is a newer state to decide on
        for n in itertools.count(2):
            await log.append(
                events.Heartbeat(id=f"hb-{n}", ts=time.time(), node="node-a", seq=n), ttl_s=60
            )
            await asyncio.sleep(0.02)

    async with running(ControlService(config(), ports=ports(log, bucket))) as svc:
        await until(lambda: svc.leading and svc.state.leader == "control-a", "leadership")
        await register(log, "node-a")
        beating = asyncio.create_task(heartbeats())
        try:
            await until(lambda: bool(of_type(log, events.StartShard)), "a StartShard")
            await asyncio.sleep(1.0)
        finally:
            beating.cancel()
        assert len(of_type(log, events.ReplicaPlaced)) == 1
        assert svc.metrics.fence_refused._value.get() == 0


async def test_a_placement_after_a_command_is_fenced_on_the_last_control_write() -> None:
    """Two replicas in one pass: placement, start, placement, start. A command is not on the
    control subjects, so the second placement's fence is the first placement's sequence."""
    log, bucket = RecordingLog(), LeaseBucket()
    cfg = msgspec.structs.replace(
        config(), models=(ModelProfile(name="m1", engine="sim", replicas=2),)
    )
    async with running(ControlService(cfg, ports=ports(log, bucket))) as svc:
        await until(lambda: svc.leading and svc.state.leader == "control-a", "leadership")
        await register(log, "node-a")
        await until(lambda: len(of_type(log, events.StartShard)) == 2, "two StartShards")
        assert svc.metrics.fence_refused._value.get() == 0
        first, second = of_type(log, events.ReplicaPlaced)
        assert second.event.epoch == first.event.epoch  # type: ignore[union-attr]
        assert dict(log.fences)[second.event.id] == bus.Fence(
            subjects.CONTROL_EVENTS_ALL, first.seq
        )


class RenewalsUnanswered(MemoryLease):
    """A lease whose renewals get no answer (the server unreachable for this instance)."""

    async def renew(self) -> None:
        raise nats.errors.TimeoutError


async def test_a_leader_whose_renewals_go_unanswered_steps_down_when_its_lease_runs_out() -> None:
    log, bucket = RecordingLog(), LeaseBucket()
    lease = RenewalsUnanswered(bucket, "control-a", ttl_s=1.5)
    svc_ports = ControlPorts(log=log, snapshots=MemorySnapshots(), lease=lease)
    async with running(ControlService(config(), ports=svc_ports)) as svc:
        await until(lambda: svc.leading, "leadership")
        await until(lambda: not svc.leading, "the step-down once the lease ran out")


async def test_the_leader_saves_snapshots_every_n_events_and_a_follower_none() -> None:
    log, bucket = RecordingLog(), LeaseBucket()
    cfg = msgspec.structs.replace(config(), snapshot=SnapshotConfig(every_events=3, every_s=0))
    leader_snaps, follower_snaps = MemorySnapshots(), MemorySnapshots()
    leader = ControlPorts(log=log, snapshots=leader_snaps, lease=MemoryLease(bucket, "control-a"))
    follower = ControlPorts(
        log=log, snapshots=follower_snaps, lease=MemoryLease(bucket, "control-b")
    )
    async with running(ControlService(cfg, ports=leader)) as svc:
        await until(lambda: svc.leading and svc.state.leader == "control-a", "leadership")
        standby_cfg = msgspec.structs.replace(cfg, name="control-b")
        async with running(ControlService(standby_cfg, ports=follower)) as standby:
            await register(log, "node-a")
            await register(log, "node-b")
            await until(lambda: svc.snapshot_seq > 0, "a snapshot saved by the leader")
            await until(lambda: standby.state.last_seq >= svc.snapshot_seq, "the standby")
            assert not standby.leading
            assert await follower_snaps.load() is None
        snap = await leader_snaps.load()
        assert snap is not None
        assert snap.seq == svc.snapshot_seq


async def test_a_leader_cut_off_from_nats_decides_nothing_until_it_is_back() -> None:
    """Its view is stale and its writes would land after the reconnect, judged on the
    silence it caused: nothing is decided while the log is unreachable."""
    log, bucket = RecordingLog(), LeaseBucket()
    async with running(ControlService(config(), ports=ports(log, bucket))) as svc:
        await until(lambda: svc.leading and svc.state.leader == "control-a", "leadership")
        log.connected = False
        await register(log, "node-a")
        await until(lambda: "node-a" in svc.state.nodes, "the registration folded")
        await asyncio.sleep(0.3)  # six ticks
        assert of_type(log, events.ReplicaPlaced) == []
        log.connected = True
        await until(lambda: bool(of_type(log, events.StartShard)), "a StartShard")


async def test_a_leader_that_steps_down_within_a_batch_writes_none_of_the_rest() -> None:
    log, bucket = RecordingLog(), LeaseBucket()
    lease = MemoryLease(bucket, "control-a")
    svc = ControlService(
        config(), ports=ControlPorts(log=log, snapshots=MemorySnapshots(), lease=lease)
    )

    async def deposed_after_placing(event: events.Event) -> None:
        if isinstance(event, events.ReplicaPlaced):
            log.before = None
            # The lease loop found the lease gone while the placement was being written.
            bucket.delete()
            bucket.write("control-b", 0, 60.0)
            svc._step_down("lease lost")
            lease._revision = 0

    log.before = deposed_after_placing
    async with running(svc):
        await until(lambda: svc.leading and svc.state.leader == "control-a", "leadership")
        await register(log, "node-a")
        await until(lambda: bool(of_type(log, events.ReplicaPlaced)), "the placement")
        await asyncio.sleep(0.3)
        assert not svc.leading
        assert of_type(log, events.StartShard) == []


async def test_a_leader_whose_own_decision_was_refused_waits_an_interval_before_the_next() -> None:
    """Deciding again at once would likely repeat what the fold refused, in a loop that
    fills the log: the leader waits `reconcile_interval_s` first (here 1 s)."""
    log, bucket = RecordingLog(), LeaseBucket()
    cfg = msgspec.structs.replace(config(), reconcile_interval_s=1.0)
    async with running(ControlService(cfg, ports=ports(log, bucket))) as svc:
        await until(lambda: svc.leading and svc.state.leader == "control-a", "leadership")
        await until(lambda: svc.state.last_seq >= log.records()[-1].seq, "caught up")
        bad = events.ReplicaRetired(id="bad", ts=time.time(), replica_id="nope", epoch=svc.epoch)
        await log.append(bad)
        await until(lambda: svc.folded.own_rejected == 1, "its own decision refused")
        refused_at = time.monotonic()
        await register(log, "node-a")
        await until(lambda: bool(of_type(log, events.ReplicaPlaced)), "the placement")
        assert time.monotonic() - refused_at >= 0.5


async def test_a_leader_attests_only_on_a_pass_that_wrote_nothing() -> None:
    """An attestation is fenced on the control sequence folded so far; right after the
    leader's own unfolded writes that fence is stale, and the server would refuse it (and
    the leader step down). It waits for a pass with nothing to write."""
    log, bucket = RecordingLog(), LeaseBucket()
    async with running(ControlService(config(), ports=ports(log, bucket))) as svc:
        await until(lambda: svc.leading and svc.state.leader == "control-a", "leadership")
        await until(lambda: svc.state.last_seq >= log.records()[-1].seq, "caught up")
        log.connected = False  # hold its decisions until both are ready
        await register(log, "node-a")
        await until(lambda: "node-a" in svc.state.nodes, "the registration folded")
        svc.attester.every = 1
        svc.attester.accepted(1, bytes(32))  # due from now on: one message checked
        log.connected = True  # the next pass places (writes) and may not attest
        await until(lambda: bool(of_type(log, events.LogAttested)), "an attestation")
        assert svc.metrics.fence_refused._value.get() == 0
        assert of_type(log, events.StartShard)
        assert of_type(log, events.StartShard)[-1].seq < of_type(log, events.LogAttested)[0].seq


class BehindReader(MemoryReader):
    """A reader that says, while `lag_s` is set, that it is that far behind the log (what
    it read was stored `lag_s` ago, and more since): a leader that cannot read a flood as
    fast as it comes."""

    lag_s: float | None = None
    _last_time = 0.0

    @property  # type: ignore[override]
    def more_pending(self) -> bool:
        return self.lag_s is not None

    @more_pending.setter
    def more_pending(self, value: bool) -> None:
        pass

    @property  # type: ignore[override]
    def last_time(self) -> float:
        return self._last_time if self.lag_s is None else time.time() - self.lag_s

    @last_time.setter
    def last_time(self, value: float) -> None:
        self._last_time = value


class BehindLog(RecordingLog):
    def __init__(self) -> None:
        super().__init__()
        self.readers: list[BehindReader] = []

    def reader(self, **kwargs: Any) -> Any:
        for unused in ("name", "attestations", "attester"):
            kwargs.pop(unused, None)
        kwargs.setdefault("after_seq", 0)
        kwargs.setdefault("subjects_filter", subjects.STREAM_SUBJECTS)
        kwargs.setdefault("follow", True)
        found = BehindReader(self, **kwargs)
        self.readers.append(found)
        return found


async def test_a_leader_behind_the_log_judges_no_nodes_silence_until_it_caught_up() -> None:
    """Heartbeats stored while the fold is behind are not read yet: judged then, every
    node of the fleet looked silent, and one node's flood the leader could not read as
    fast as it came had them all declared unreachable."""
    from llmgw.core import reconcile

    log, bucket = BehindLog(), LeaseBucket()
    quick = reconcile.ReconcileConfig(unreachable_after_s=0.5, lost_after_s=60.0)
    cfg = msgspec.structs.replace(config(), reconcile=quick)
    async with running(ControlService(cfg, ports=ports(log, bucket))) as svc:
        await until(lambda: svc.leading and svc.state.leader == "control-a", "leadership")
        await register(log, "node-a")  # one heartbeat, then none
        await until(lambda: "node-a" in svc.state.nodes, "the registration folded")
        (reader,) = [r for r in log.readers if r.follow]
        reader.lag_s = 5.0
        await asyncio.sleep(1.5)  # three times unreachable_after_s, thirty decision rounds
        assert of_type(log, events.NodeUnreachable) == []
        reader.lag_s = None  # caught up: its silence counts from here
        await until(lambda: bool(of_type(log, events.NodeUnreachable)), "node-a unreachable")

"""The control-plane service: consume the log, fold it, and, as leader, reconcile and publish.

One `ControlService` per `llmgw control` process. At start it provisions the log
(the control identity may), loads the newest snapshot, replays the tail and then
follows the log live, folding every record into a `ClusterState`
(llmgw.core.state). Every instance keeps that state hot; the one that holds the
leader lease (llmgw.bus.Lease) also decides:

- it announces itself with LeaderElected(epoch) and waits to fold it back;
- it publishes the models of its config file that the log lacks (llmgw.control.models);
- it reconciles (llmgw.core.reconcile) after every interesting batch of events and
  on a timer (heartbeat ages), and publishes the decisions in the reconciler's
  order, each fenced with an expected last sequence on `llmgw.events.control.>`
  (commands too: the header names the subject filter, whatever the publish
  subject), so the server refuses every write of a leader that another has
  deposed. On FenceRefused it steps down and stays a follower until the lease
  is free again.

The leader changes state only by folding what it reads back (docs/design.md,
invariant 1): after publishing a batch it decides again only once the fold has
passed the batch's last sequence, so it never places the same replica twice.
Rejected events are counted and logged with their sequence; nothing in the log
stops the loop. The leader saves snapshots every N events or T seconds.

Every instance measures each node's log traffic (llmgw.control.quota); the leader
quarantines a node over its budget and releases it once calm (fenced decisions like
any other), deletes the messages its fold ignored for quarantined nodes, and once per
epoch sweeps what they wrote before it led (docs/security.md, "A node's share of the log").

The admin API (llmgw.control.admin) reads `state` and `metrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import msgspec
import nats.errors
import nats.js.errors

from llmgw import bus, logs
from llmgw import tasks as tasks_
from llmgw.bus.ports import EventLog, LeasePort, LogReader, SnapshotPort
from llmgw.control import attesting
from llmgw.control import ids as ids_
from llmgw.control import models as model_sync
from llmgw.control import ports as ports_
from llmgw.control import quota as quota_
from llmgw.control.config import ControlConfig
from llmgw.control.folding import CONTROL_PREFIX, Folded
from llmgw.control.metrics import Metrics
from llmgw.control.ports import ControlPorts
from llmgw.core import events, reconcile, state, subjects
from llmgw.pki.identity import Identity

log = logs.get("llmgw.control")

_MODEL_KINDS = ("model_declared", "model_changed", "model_removed")
_MODEL_EVENTS = tuple(f for kind in _MODEL_KINDS for f in subjects.operator_event_kind(kind))


class ControlService:
    """One control-plane instance. `run(stop)` until `stop` is set; see the module docstring."""

    def __init__(
        self,
        cfg: ControlConfig,
        *,
        tls: ssl.SSLContext | None = None,
        clock: Callable[[], float] = time.time,
        ports: ControlPorts | None = None,
    ) -> None:
        """`ports` (llmgw.control.ports) are the log, snapshots and lease to run on; without
        them `run` connects to NATS with `tls` (or the config's) and uses JetStream."""
        self.cfg = cfg
        self.name = cfg.name
        self.identity = Identity("control", cfg.name)
        self._tls = tls
        self.clock = clock
        self.metrics = Metrics()
        self.meter = quota_.Meter(cfg.node_quota) if cfg.node_quota.enabled else None
        """Each node's log traffic in the window; the leader quarantines on it."""
        self.folded = Folded(self.metrics, clock, self.meter)
        self.attester = attesting.Attester(clock=clock)
        """What this instance's reader checked, for the leader to attest
        (llmgw.control.attesting): later readers then verify each event once."""
        self.leading = False
        self.epoch = 0
        """Epoch of the lease this instance holds (0 when it holds none)."""
        self.caught_up = asyncio.Event()
        self.ready = asyncio.Event()
        """Set once the admin listener accepts connections."""
        self.admin_url = ""
        self.snapshot_seq = 0
        self.observing_since = clock()
        self.unplaceable: dict[str, str] = {}
        self._wake = asyncio.Event()
        self._delete_wake = asyncio.Event()
        self._delete_strikes = 0
        self._sweep_task: asyncio.Task[None] | None = None
        self._sweep_epoch = 0
        """The epoch in which this instance last swept quarantined nodes' messages."""
        self._stopping = False
        self._awaiting = 0
        self._announced = 0
        self._models_synced_epoch = 0
        self._decision_ids = ids_.DecisionIds()
        self._leader_ids: dict[int, str] = {}
        """Epoch -> the id of our LeaderElected: the same on a retried announcement."""
        self._last_snapshot = time.monotonic()
        self._snapshot_task: asyncio.Task[None] | None = None
        self._own_rejected_seen = 0
        self._reader_resets = 0
        self._ports = ports
        self._reader: LogReader | None = None
        self._nc: bus.BusClient | None = None
        """The NATS connection, when this instance made one (no ports given)."""
        self._log: EventLog | None = None
        self._lease: LeasePort | None = None
        self._snapshots: SnapshotPort | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def state(self) -> state.ClusterState:
        return self.folded.state

    @property
    def control_seq(self) -> int:
        """Last sequence on llmgw.events.control.> folded: the fence's expected value."""
        return self.folded.control_seq

    @property
    def rejected(self) -> int:
        return self.folded.rejected

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is not None:
            return self._tls
        return self.cfg.nats.tls_context()

    async def run(self, stop: asyncio.Event) -> None:
        """Start, serve until `stop` is set, then shut down cleanly (the lease is released)."""
        from llmgw.control import admin

        ports = self._ports
        if ports is None:
            self._nc = await ports_.connect(self.cfg, self._tls_context())
        tasks: list[asyncio.Task[Any]] = []
        runner = None
        try:
            if ports is None:
                assert self._nc is not None
                ports = await ports_.open_jetstream(self.cfg, self._nc)
            log_ = self._log = ports.log
            self._snapshots = ports.snapshots
            self._lease = ports.lease
            runner = await admin.start(self)
            await self._load_snapshot()
            self.folded.control_seq = await self._last_control_seq(upto=self.state.last_seq)
            self._reader = log_.reader(
                after_seq=self.state.last_seq,
                name=f"control-{self.name}",
                attestations=await log_.attestations(after_seq=self.state.last_seq),
                attester=self.attester,
            )
            await self._reader.start()
            if self._reader.caught_up.is_set():
                self._mark_caught_up()
            self.ready.set()
            tasks = [
                self._spawn(self._consume(), "consume"),
                self._spawn(self._lease_loop(), "lease"),
                self._spawn(self._decide_loop(), "decide"),
                self._spawn(self._tick(), "tick"),
                self._spawn(self._delete_loop(), "delete"),
            ]
            stopped = asyncio.create_task(stop.wait())
            done, _ = await asyncio.wait([stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stopped and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            stopped.cancel()
        finally:
            # Loops end by this flag and a closed reader, not only by cancellation: on
            # Python 3.11 asyncio.wait_for (nats-py's requests use it) can swallow a
            # cancel that arrives as its inner future completes, and a loop that lost its
            # cancel would keep the process from stopping.
            self._stopping = True
            self._wake.set()
            self._delete_wake.set()
            if self._reader is not None:
                await self._reader.close()
            if self._sweep_task is not None:
                tasks.append(self._sweep_task)
            await tasks_.stop(tasks, who=f"control {self.name}")
            if self._snapshot_task is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(self._snapshot_task), 5)
            await self._shutdown()
            if runner is not None:
                await runner.cleanup()

    async def _shutdown(self) -> None:
        was = self.leading
        self._set_leading(False)
        if was and self._lease is not None:
            # A standby takes over at once instead of waiting out the TTL.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._lease.release(), 3)
        if self._reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._reader.close(), 3)
        if self._nc is not None and not self._nc.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._nc.close(), 5)
        log.info("control.stopped", name=self.name, folded_seq=self.state.last_seq)

    def _spawn(self, coro: Coroutine[Any, Any, None], what: str) -> asyncio.Task[None]:
        return asyncio.create_task(coro, name=f"control-{self.name}-{what}")

    # ------------------------------------------------------------------ start-up

    async def _load_snapshot(self) -> None:
        assert self._snapshots is not None
        try:
            snap = await self._snapshots.load()
        except (nats.errors.Error, OSError) as exc:
            log.warning("control.snapshot_unreadable", error=str(exc), action="folding from seq 0")
            return
        if snap is None:
            log.info("control.no_snapshot", action="folding the log from the start")
            return
        try:
            loaded = state.decode_snapshot(snap.data)
        except ValueError as exc:
            log.warning("control.snapshot_invalid", seq=snap.seq, error=str(exc))
            return
        loaded.last_seq = snap.seq
        self.folded.state = loaded
        self.snapshot_seq = snap.seq
        self.metrics.snapshot_seq.set(snap.seq)
        self.metrics.folded_seq.set(snap.seq)
        log.info("control.snapshot_loaded", seq=snap.seq, bytes=len(snap.data))

    async def _last_control_seq(self, *, upto: int) -> int:
        """The last control-subject sequence at or before `upto` (the snapshot's).

        If the last one is later, the tail replay folds it and sets `control_seq`.
        """
        if upto == 0:
            return 0
        assert self._log is not None
        seq = await self._log.last_seq(subjects.CONTROL_EVENTS_ALL)
        return seq if seq <= upto else 0

    # ------------------------------------------------------------------ folding

    def _mark_caught_up(self) -> None:
        if not self.caught_up.is_set():
            self.caught_up.set()
            log.info("control.caught_up", name=self.name, folded_seq=self.state.last_seq)

    async def _consume(self) -> None:
        assert self._reader is not None
        reader = self._reader
        folded = self.folded
        async for batch in reader.batches():
            for rec in batch:
                if type(rec.event) is events.LogAttested:
                    self.attester.quiet(rec.seq)
                    self.attester.attested(rec.event)
            interesting = folded.fold(batch, epoch=self.epoch)
            if reader.ttl_refused:
                self._delete_expiring(reader)
            folded.note_skipped(reader.undecodable, reader.skipped)
            if reader.caught_up.is_set():
                self._mark_caught_up()
            if interesting or self._awaiting:
                self._wake.set()
            if folded.ignored:
                self._delete_wake.set()
            self._maybe_snapshot()

    # ------------------------------------------------------------------ snapshots

    def _maybe_snapshot(self, *, force: bool = False) -> None:
        s = self.cfg.snapshot
        if not self.leading or self.folded.since_snapshot == 0 or self._snapshots is None:
            return
        if self._snapshot_task is not None and not self._snapshot_task.done():
            return
        due = force or bool(s.every_events and self.folded.since_snapshot >= s.every_events)
        due = due or bool(s.every_s and time.monotonic() - self._last_snapshot >= s.every_s)
        if not due:
            return
        # Encoded now, synchronously: the bytes are exactly the state at last_seq.
        data = state.encode_snapshot(self.state)
        seq = self.state.last_seq
        self.folded.since_snapshot = 0
        self._last_snapshot = time.monotonic()
        self._snapshot_task = self._spawn(self._save_snapshot(data, seq), "snapshot")

    async def _save_snapshot(self, data: bytes, seq: int) -> None:
        assert self._snapshots is not None
        try:
            await self._snapshots.save(data, seq)
        except Exception as exc:  # a failed snapshot costs only a longer cold start
            log.warning("control.snapshot_failed", seq=seq, error=str(exc) or repr(exc))
            return
        self.snapshot_seq = seq
        self.metrics.snapshots.inc()
        self.metrics.snapshot_seq.set(seq)

    async def snapshot_now(self) -> int:
        """Save a snapshot of the state as folded now, whoever leads; returns its sequence."""
        assert self._snapshots is not None
        seq = self.state.last_seq
        await self._save_snapshot(state.encode_snapshot(self.state), seq)
        return seq

    # ------------------------------------------------------------------ leadership

    def _set_leading(self, leading: bool, epoch: int = 0) -> None:
        self.leading = leading
        self.epoch = epoch if leading else 0
        # Only the leader deletes what quarantined nodes wrote; a follower keeps no list.
        self.folded.collect_ignored = leading and self.cfg.node_quota.delete
        if not leading:
            self.folded.ignored.clear()
        self.metrics.leader.set(1 if leading else 0)

    def _step_down(self, why: str) -> None:
        if self.leading:
            log.warning("control.step_down", name=self.name, epoch=self.epoch, why=why)
        self._set_leading(False)
        self._awaiting = 0

    async def _abdicate(self, why: str) -> None:
        """Step down and give the lease up: contend again only once it is free."""
        self._step_down(why)
        if self._lease is not None:
            with contextlib.suppress(Exception):
                await self._lease.release()

    async def _lease_loop(self) -> None:
        lease = self._lease
        assert lease is not None
        while not self._stopping:
            if not self.leading:
                wait = min(lease.renew_every_s, 0.25)
                if self.caught_up.is_set():
                    try:
                        if await lease.acquire():
                            # A lease lapses when the log cannot be written: silence
                            # from before it is no evidence against the nodes.
                            self._log_was_unavailable("lease acquired")
                            self._set_leading(True, lease.epoch)
                            self._announced = 0
                            self._sweep_epoch = 0
                            log.info("control.leading", name=self.name, epoch=lease.epoch)
                            self._wake.set()
                    except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
                        log.warning("control.lease_error", error=str(exc) or repr(exc))
            else:
                wait = lease.renew_every_s
                try:
                    await lease.renew()
                except bus.LeaseLost as exc:
                    self._step_down(str(exc))
                    wait = 0.25
                except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
                    log.warning("control.lease_renew_error", error=str(exc) or repr(exc))
                    if not lease.held:
                        self._step_down("the lease ran out while renewals failed")
                    wait = 0.2
            await asyncio.sleep(wait)

    async def _tick(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.cfg.reconcile_interval_s)
            self._wake.set()
            self._maybe_snapshot()

    async def _decide_loop(self) -> None:
        while not self._stopping:
            await self._wake.wait()
            self._wake.clear()
            if self._stopping:
                return
            if not self.leading or not self.caught_up.is_set():
                continue
            if self._log is not None and not self._log.connected:
                # Cut off: heartbeats cannot reach us and our writes would fail (or, worse,
                # land after the reconnect, judged on silence we caused). Decide nothing.
                self._log_was_unavailable("disconnected from NATS", quiet=True)
                continue
            if self.state.last_seq < self._awaiting:
                continue  # our own last writes are not folded yet: the state is not current
            self._awaiting = 0
            if self.folded.own_rejected != self._own_rejected_seen:
                # The fold refused our own decisions: deciding again at once would very
                # likely repeat them, in a tight loop that fills the log. Pace it instead.
                log.error(
                    "control.own_decisions_rejected",
                    count=self.folded.own_rejected - self._own_rejected_seen,
                    action=f"deciding again in {self.cfg.reconcile_interval_s} s",
                )
                self._own_rejected_seen = self.folded.own_rejected
                await asyncio.sleep(self.cfg.reconcile_interval_s)
                if not self.leading:
                    continue
            try:
                await self._decide()
            except bus.FenceRefused as exc:
                self.metrics.fence_refused.inc()
                log.warning(
                    "control.fence_refused", name=self.name, epoch=self.epoch, detail=str(exc)
                )
                await self._abdicate("a fenced write was refused: another leader wrote first")
            except (bus.PublishError, nats.errors.Error, TimeoutError) as exc:
                log.warning("control.publish_failed", error=str(exc) or repr(exc))
                self._log_was_unavailable("a write to the log failed")
                await asyncio.sleep(0.5)
                self._wake.set()

    async def _decide(self) -> None:
        st = self.state
        if st.epoch > self.epoch:
            await self._abdicate(
                f"epoch {st.epoch} ({st.leader}) is newer than ours ({self.epoch})"
            )
            return
        if st.epoch != self.epoch or st.leader != self.name:
            if self._announced != self.epoch:
                await self._announce()
            return
        if self.cfg.sync_models and self._models_synced_epoch != self.epoch:
            await self._sync_models()
            return
        if self._sweep_epoch != self.epoch and self.cfg.node_quota.delete:
            self._sweep_epoch = self.epoch
            self._sweep_task = self._spawn(self._sweep_quarantined(), "sweep")
        if await self._police_quota():
            return  # decide on once the fold has the quarantines
        # Attest only when nothing was just written: a write's fence is the control
        # sequence folded so far, which our own unfolded decisions would have moved.
        if await self.reconcile_once() == 0:
            await self._attest()

    async def _police_quota(self) -> bool:
        """Quarantine the nodes over their budget, release those that calmed down (see
        llmgw.control.quota); True when it published any such decision."""
        meter = self.meter
        if meter is None:
            return False
        st = self.state
        window = meter.quota.window_s
        decided: list[events.ControlEvent] = []
        for usage in meter.excessive():
            if usage.node in st.quarantined:
                continue
            decided.append(
                events.NodeQuarantined(
                    id=ids_.unique(f"quarantine-{self.epoch}-{st.last_seq}-{len(decided)}"),
                    ts=self.clock(),
                    epoch=self.epoch,
                    basis_seq=st.last_seq,
                    node=usage.node,
                    reason=meter.reason(usage),
                    since_seq=usage.since_seq,
                    messages=usage.messages,
                    bytes=usage.bytes,
                    window_s=window,
                )
            )
        for node in sorted(st.quarantined):
            if meter.calm(node, st.quarantined[node]):
                usage = meter.usage(node)
                decided.append(
                    events.NodeReleased(
                        id=ids_.unique(f"release-{self.epoch}-{st.last_seq}-{len(decided)}"),
                        ts=self.clock(),
                        epoch=self.epoch,
                        basis_seq=st.last_seq,
                        node=node,
                        reason=f"wrote {usage.messages} messages, {usage.bytes} bytes in the "
                        f"last {window:g} s: under the budget",
                    )
                )
        if not decided:
            return False
        await self._publish_fenced(decided)
        return True

    async def _sweep_quarantined(self) -> None:
        """Once per leadership: queue for deletion what quarantined nodes wrote before this
        instance led (or before it restarted), which no list of this instance holds.

        A node quarantined since sequence Q and still quarantined at the folded sequence S
        had every registered and shard message in (Q, S] ignored by every fold: those are
        deleted. Best effort: a failure leaves them in the log, as before.
        """
        assert self._log is not None
        upto = self.state.last_seq
        targets = sorted((node, q.seq) for node, q in self.state.quarantined.items())
        found: list[int] = []
        for node, since in targets:
            reader = self._log.reader(
                after_seq=since,
                subjects_filter=[
                    subjects.node_event(node, "registered"),
                    subjects.node_event(node, "shard"),
                ],
                follow=False,
                name=f"control-{self.name}-sweep",
            )
            try:
                async with reader:
                    async for batch in reader.batches():
                        found += [r.seq for r in batch if r.seq <= upto]
                        if batch and batch[-1].seq >= upto:
                            break
            except Exception as exc:  # best effort; the loop must not die of it
                log.warning("control.quarantine_sweep_failed", node=node, error=repr(exc))
                continue
            # Undecodable messages there are refused by every reader as well.
            found += [x.seq for x in reader.skipped if since < x.seq <= upto]
        if found and self.leading:
            log.info("control.quarantine_sweep", messages=len(found), upto_seq=upto)
            self.folded.ignored.extend(found)
            self._delete_wake.set()

    def _delete_expiring(self, reader: LogReader) -> None:
        """The leader deletes messages refused for their TTL (llmgw.core.retention): a
        heartbeat that would never expire, or an event that would vanish from replays."""
        seqs = list(reader.ttl_refused)
        reader.ttl_refused.clear()
        if not self.leading or self._log is None:
            return
        self._spawn(self._delete_ttl(seqs), "ttl-delete")

    async def _delete_ttl(self, seqs: list[int]) -> None:
        assert self._log is not None
        result = await self._log.delete(seqs)
        self.metrics.ttl_deleted.inc(result.deleted)
        log.info("control.ttl_refused_deleted", **_deletion(result, seqs))

    async def _attest(self) -> None:
        """Publish what this instance's reader checked, when enough has gathered."""
        if not self.attester.due():
            return
        st = self.state
        event = self.attester.take(
            event_id=ids_.unique(f"attest-{self.epoch}-{st.last_seq}"),
            epoch=self.epoch,
            basis_seq=st.last_seq,
        )
        if event is not None:
            await self._publish_fenced([event])

    async def _delete_loop(self) -> None:
        """Delete the messages the fold ignored for quarantined nodes: a flood then costs
        the log bounded storage. No fold changes: every fold ignores them (they come after
        the node's quarantine in the log)."""
        batch = 1000
        while not self._stopping:
            await self._delete_wake.wait()
            self._delete_wake.clear()
            ignored = self.folded.ignored
            while ignored and self.leading and not self._stopping and self._log is not None:
                seqs = ignored[:batch]
                del ignored[:batch]
                result = await self._log.delete(seqs)
                self.metrics.quarantine_deleted.inc(result.deleted)
                log.info("control.quarantine_deleted", **_deletion(result, seqs))
                if not result.failed:
                    self._delete_strikes = 0
                    continue
                self.metrics.quarantine_delete_failed.inc(len(result.failed))
                self._delete_strikes = 0 if result.deleted else self._delete_strikes + 1
                seq, why = result.failed[0]
                if self._delete_strikes >= 5:
                    log.error(
                        "control.quarantine_delete_failed",
                        count=len(result.failed) + len(ignored),
                        seq=seq,
                        error=why,
                        action="giving up on these; check the control identity may call "
                        "STREAM.MSG.DELETE",
                    )
                    ignored.clear()
                    self._delete_strikes = 0
                    break
                log.warning(
                    "control.quarantine_delete_retry", count=len(result.failed), seq=seq, error=why
                )
                ignored.extend(s for s, _ in result.failed)
                await asyncio.sleep(1.0)

    async def _announce(self) -> None:
        event_id = self._leader_ids.get(self.epoch)
        if event_id is None:
            self._leader_ids = {self.epoch: ids_.unique(f"leader-{self.name}-{self.epoch}")}
            event_id = self._leader_ids[self.epoch]
        event = events.LeaderElected(
            id=event_id,
            ts=self.clock(),
            leader=self.name,
            epoch=self.epoch,
            basis_seq=self.state.last_seq,
            # The timings decide too: recorded, so that a check of this epoch's decisions
            # needs no config file and cannot be run against the wrong one.
            reconcile=msgspec.structs.asdict(self.cfg.reconcile),
        )
        await self._publish_fenced([event])
        self._announced = self.epoch

    async def _sync_models(self) -> None:
        assert self._log is not None
        reader = self._log.reader(
            subjects_filter=_MODEL_EVENTS, follow=False, name=f"control-{self.name}-m"
        )
        history: list[events.Event] = []
        async with reader:
            async for batch in reader.batches():
                history.extend(r.event for r in batch if r.seq <= self.state.last_seq)
        todo = model_sync.diff(
            self.cfg.models,
            self.state,
            model_sync.managed(history),
            operator=self.name,
            now=self.clock(),
            basis_seq=self.state.last_seq,
            ids=ids_.unique,
        )
        for event in todo:
            kind = events.tag_of(type(event)).partition(".")[2]
            published = await self._log.append(
                event, subject=subjects.control_operator_event(self.name, kind)
            )
            self._wrote(published.seq)
            log.info(
                "control.model_synced",
                type=events.tag_of(type(event)),
                model=getattr(event, "name", "")
                or getattr(getattr(event, "profile", None), "name", ""),
                seq=published.seq,
            )
        self._models_synced_epoch = self.epoch
        self._wake.set()

    def _log_was_unavailable(self, why: str, *, quiet: bool = False) -> None:
        """Judge heartbeat silence only from now on.

        While the log cannot be written (NATS down, this connection moving to another
        server, a replicated stream electing a new leader) or read (this reader's
        consumer lost), agents' heartbeats cannot reach this instance either. Counting
        that time against the nodes had every node of the fleet declared unreachable
        and lost, and every replica replaced, after a log outage longer than
        lost_after_s (seen with a 3-server cluster losing the stream's leader).
        """
        now = self.clock()
        if now > self.observing_since:
            self.observing_since = now
            if not quiet:
                log.info("control.observing_from_now", why=why)

    async def reconcile_once(self) -> int:
        """Reconcile the state as folded now and publish the decisions; their count."""
        st = self.state
        if self._reader is not None and self._reader.resets != self._reader_resets:
            self._reader_resets = self._reader.resets
            self._log_was_unavailable("the log reader was reset")
        started = time.perf_counter()
        outcome = reconcile.reconcile_detail(
            st,
            self.clock(),
            epoch=self.epoch,
            basis_seq=st.last_seq,
            config=self.cfg.reconcile,
            observing_since=self.observing_since,
            ids=self._decision_ids,
        )
        self.metrics.reconcile_seconds.set(time.perf_counter() - started)
        self._note_unplaceable(outcome.unplaceable, outcome.unplaceable_codes)
        if not outcome.decisions:
            return 0
        await self._publish_fenced(outcome.decisions)
        return len(outcome.decisions)

    def _note_unplaceable(self, now_unplaceable: dict[str, str], codes: Mapping[str, str]) -> None:
        for model, reason in now_unplaceable.items():
            self.metrics.placement_failures.labels(model, codes.get(model, "other")).inc()
            if self.unplaceable.get(model) != reason:
                log.warning("control.unplaceable", model=model, reason=reason)
        self.unplaceable = dict(now_unplaceable)
        self.metrics.unplaceable.set(len(now_unplaceable))

    def _wrote(self, seq: int) -> None:
        """Decide again only once the fold has passed `seq`. Set after every single write,
        so that a batch that fails halfway is not decided (and placed) a second time."""
        self._awaiting = max(self._awaiting, seq)

    async def _publish_fenced(self, decisions: list[Any]) -> int:
        """Publish in order, each fenced on the control subjects; the last sequence written.

        The reconciler's order matters (a restart's StopShard precedes the new
        generation's ReplicaPlaced), so commands are not moved behind the control
        events; they are fenced like them instead.
        """
        assert self._log is not None
        fence_seq = self.control_seq
        last = 0
        for event in decisions:
            if not self.leading:
                break
            fence = bus.Fence(subjects.CONTROL_EVENTS_ALL, fence_seq)
            published = await self._log.append(event, fence=fence)
            self._wrote(published.seq)
            if events.subject_of(event).startswith(CONTROL_PREFIX):
                fence_seq = published.seq
            last = published.seq
            self.metrics.decisions.labels(events.tag_of(type(event))).inc()
            log.info(
                "control.decision",
                seq=published.seq,
                type=events.tag_of(type(event)),
                id=event.id,
                **_describe(event),
            )
        return last


def _deletion(result: bus.Deleted, seqs: list[int]) -> dict[str, Any]:
    """A deletion's log fields: how many went, were gone already, failed; which range."""
    return {
        "deleted": result.deleted,
        "gone": result.gone,
        "failed": len(result.failed),
        "first_seq": seqs[0],
        "last_seq": seqs[-1],
    }


def _describe(event: events.Event) -> dict[str, Any]:
    """A few fields worth a log line: which node, replica, model."""
    out: dict[str, Any] = {}
    for field in ("node", "replica_id", "model", "reason"):
        value = getattr(event, field, None)
        if value:
            out[field] = value
    return out

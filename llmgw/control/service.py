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

This module starts and stops the instance and feeds the fold; the rest is in one
module per responsibility, each a part of `ControlService`: the shared state and the
fenced write (llmgw.control.instance), snapshots (llmgw.control.snapshotting), the
lease (llmgw.control.leadership), quarantines and deletions (llmgw.control.policing)
and the leader's decisions (llmgw.control.deciding).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from llmgw import tasks as tasks_
from llmgw.bus.connection import close as close_connection
from llmgw.bus.ports import EventLog
from llmgw.bus.reader import Skipped
from llmgw.control import ports as ports_
from llmgw.control.deciding import Deciding
from llmgw.control.instance import log
from llmgw.control.ports import ControlPorts
from llmgw.control.snapshotting import Snapshotting
from llmgw.core import events

_TTL_REFUSED_CHUNK = 1000
"""Messages refused for their TTL deleted at once, however many follow with no event."""


class ControlService(Deciding, Snapshotting):
    """One control-plane instance. `run(stop)` until `stop` is set; see the module docstring."""

    async def run(self, stop: asyncio.Event) -> None:
        """Start, serve until `stop` is set, then shut down cleanly (the lease is released)."""
        from llmgw.control import admin

        ports = self._ports
        if ports is None:
            self._nc = await ports_.connect(self.cfg, self._tls_context())
        tasks: list[asyncio.Task[Any]] = []
        runner = None
        try:
            log_ = await self._attach(ports)
            await self._measure_clock()  # before anything is judged by it
            runner = await admin.start(self)
            await self._start_reading(log_)
            self.ready.set()
            tasks = [
                self._spawn(self._consume(), "consume"),
                self._spawn(self._lease_loop(), "lease"),
                self._spawn(self._clock_loop(), "clock"),
                self._spawn(self._decide_loop(), "decide"),
                self._spawn(self._tick(), "tick"),
                self._spawn(self._delete_loop(), "delete"),
                self._spawn(self._signals_loop(), "signals"),
            ]
            stopped = asyncio.create_task(stop.wait())
            done, _ = await asyncio.wait([stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stopped and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            stopped.cancel()
        finally:
            await self._wind_down(tasks)
            if runner is not None:
                await runner.cleanup()

    async def _attach(self, ports: ControlPorts | None) -> EventLog:
        """Take the log, snapshots and lease from `ports`, or from JetStream on `_nc`."""
        if ports is None:
            assert self._nc is not None
            ports = await ports_.open_jetstream(self.cfg, self._nc, self.clock)
        self._log = ports.log
        self._snapshots = ports.snapshots
        self._lease = ports.lease
        return ports.log

    async def _start_reading(self, log_: EventLog) -> None:
        """Load the newest snapshot and start the reader on the tail after it."""
        await self._load_snapshot()
        self.folded.control_seq = await self._last_control_seq(upto=self.state.last_seq)
        self.folded.on_collect = self.attester.drop  # what the leader deletes, it does not attest
        self._reader = log_.reader(
            after_seq=self.state.last_seq,
            name=f"control-{self.name}",
            attestations=await log_.attestations(after_seq=self.state.last_seq),
            attester=self.attester,
            on_skip=self._skipped,
        )
        await self._reader.start()
        if self._reader.caught_up.is_set():
            self._mark_caught_up()

    async def _wind_down(self, tasks: list[asyncio.Task[Any]]) -> None:
        """Stop the loops, let a snapshot being saved finish, release the lease, disconnect."""
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
        if self._nc is not None:
            await close_connection(self._nc)
        log.info("stopped", name=self.name, folded_seq=self.state.last_seq)

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
            if reader.caught_up.is_set():
                self._mark_caught_up()
            if interesting or self._awaiting:
                self._wake.set()
            if folded.ignored:
                self._delete_wake.set()
            self._maybe_snapshot()

    def _skipped(self, item: Skipped) -> None:
        """The reader passed over a message (told inline, as it reads): a run of them with
        no event between them wakes the deletions (a quarantined node's, those refused for
        their TTL), and the leader at its next tick."""
        self.folded.note_skipped(item)
        reader = self._reader
        if self.folded.ignored or (reader is not None and reader.ttl_refused):
            self._delete_wake.set()
        if reader is not None and len(reader.ttl_refused) >= _TTL_REFUSED_CHUNK:
            # A run of them with no event in between has no batch to end at: delete them
            # as they come, before the reader's list of them drops the oldest.
            self._delete_expiring(reader)

    async def _tick(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.cfg.reconcile_interval_s)
            self._wake.set()
            self._maybe_snapshot()

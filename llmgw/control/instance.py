"""What every part of a control-plane instance shares: config, folded state, ports, flags.

`ControlService` (llmgw.control.service) is assembled from parts, one per
responsibility, each a subclass of `Instance`: snapshots (llmgw.control.snapshotting),
the leader lease (llmgw.control.leadership), quarantines and deletions
(llmgw.control.policing) and the leader's decisions (llmgw.control.deciding). They
share the state set up here, and the one way the leader writes decisions: in order,
each fenced on the control subjects (`_publish_fenced`).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable, Coroutine
from typing import Any

from llmgw import bus, logs
from llmgw.bus import servertime
from llmgw.bus.ports import EventLog, LeasePort, LogReader, SnapshotPort
from llmgw.control import attesting
from llmgw.control import ids as ids_
from llmgw.control import quota as quota_
from llmgw.control.config import ControlConfig
from llmgw.control.folding import CONTROL_PREFIX, Folded
from llmgw.control.metrics import Metrics
from llmgw.control.ports import ControlPorts
from llmgw.control.scaler import Scaler
from llmgw.core import events, state, subjects, views
from llmgw.core.state import ClusterState
from llmgw.pki.identity import Identity

log = logs.get("llmgw.control")


class Instance:
    """The state of one control-plane instance, shared by its parts (see the module docstring)."""

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
        self.clock = servertime.of(clock)  # the server's time, whatever this host's
        self.metrics = Metrics()
        self.meter = quota_.Meter(cfg.node_quota) if cfg.node_quota.enabled else None
        """Each node's log traffic in the window; the leader quarantines on it."""
        self.folded = Folded(self.metrics, self.clock, self.meter)
        self.attester = attesting.Attester(clock=self.clock)
        """What this instance's reader checked, for the leader to attest
        (llmgw.control.attesting): later readers then verify each event once."""
        self._spawned: set[asyncio.Task[None]] = set()
        self.leading = False
        self.epoch = 0
        """Epoch of the lease this instance holds (0 when it holds none)."""
        self.caught_up = asyncio.Event()
        self.ready = asyncio.Event()
        """Set once the admin listener accepts connections."""
        self.admin_url = ""
        self.snapshot_seq = 0
        self.observing_since = self.clock()
        self.unplaceable: dict[str, str] = {}
        self.unplaceable_codes: dict[str, str] = {}
        """The leader's last verdicts: model -> why (and its code) missing replicas of it
        could not be placed."""
        self._wake = asyncio.Event()
        self._delete_wake = asyncio.Event()
        self._delete_strikes = 0
        self._sweep_task: asyncio.Task[None] | None = None
        self._sweep_epoch = 0
        """The epoch in which this instance last swept quarantined nodes' messages."""
        self._stopping = False
        self._awaiting = self._announced = self._models_synced_epoch = self._reader_resets = 0
        self._decision_ids = ids_.DecisionIds()
        self.scaler = Scaler()
        self.metrics.export_fleet(self._fleet_now)
        self.metrics.export_autoscale(lambda: self.scaler.observations(self.state, self.clock()))
        self._leader_ids: dict[int, str] = {}
        """Epoch -> the id of our LeaderElected: the same on a retried announcement."""
        self._last_snapshot = time.monotonic()
        self._snapshot_task: asyncio.Task[None] | None = None
        self._own_rejected_seen = 0
        self._ports = ports
        self._reader: LogReader | None = None
        self._nc: bus.BusClient | None = None
        """The NATS connection, when this instance made one (no ports given)."""
        self._log: EventLog | None = None
        self._lease: LeasePort | None = None
        self._snapshots: SnapshotPort | None = None

    @property
    def state(self) -> state.ClusterState:
        return self.folded.state

    def _fleet_now(self) -> tuple[ClusterState, dict[str, str]]:
        """What the fleet metrics export: the folded state, and the leader's last placement
        verdicts (a follower, which decides nothing, plans once to get the same)."""
        if self.leading:
            return self.state, self.unplaceable_codes
        return self.state, views.unplaceable_codes(self.state, self.clock())

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

    def _spawn(self, coro: Coroutine[Any, Any, None], what: str) -> asyncio.Task[None]:
        # The loop holds only a weak reference to a task: one nobody else holds may be
        # collected before it ends (a deletion, a snapshot's save, the sweep).
        task = asyncio.create_task(coro, name=f"control-{self.name}-{what}")
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)
        return task

    def _mark_caught_up(self) -> None:
        if not self.caught_up.is_set():
            self.caught_up.set()
            self.folded.live = True
            log.info("caught_up", name=self.name, folded_seq=self.state.last_seq)

    def _clock_moved(self, step_s: float) -> None:
        """The clock's offset changed by `step_s`: move what was read of it before."""
        self.observing_since += step_s
        self.attester.clock_moved(step_s)
        self.scaler.clock_moved(step_s)

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
                log.info("observing_from_now", why=why)

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
                "decision",
                seq=published.seq,
                type=events.tag_of(type(event)),
                id=event.id,
                **_describe(event),
            )
        return last


def _describe(event: events.Event) -> dict[str, Any]:
    """A few fields worth a log line: which node, replica, model."""
    out: dict[str, Any] = {}
    for field in ("node", "replica_id", "model", "reason"):
        value = getattr(event, field, None)
        if value:
            out[field] = value
    return out

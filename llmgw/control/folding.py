"""The control plane's folded view of the log: the state, where the fence stands, what was refused.

`Folded` wraps the pure fold (llmgw.core.state.apply) for the control service: it
folds each batch the Reader yields, counts and logs every event the fold refuses
(with its sequence; nothing stops the loop), and tracks `control_seq`, the last
sequence on `llmgw.events.control.>` - the value the leader's fenced writes
expect, since the server counts every message there. It also says whether a
batch could change a decision, so the leader is not woken by routine heartbeats.
It feeds every message a node wrote (read or passed over by the Reader), and the GPU
health changes the leader recorded from its heartbeats, to the quota meter
(llmgw.control.quota) and, for the leader, keeps the sequences of quarantined nodes'
messages that no fold needs any more (their ignored events, their heartbeats once
folded, what no reader accepts), which the service deletes; those are counted, not
logged one by one.
Used by llmgw.control.service; no I/O beyond logging.
"""

from __future__ import annotations

from collections.abc import Callable

from llmgw import bus, logs
from llmgw.control.metrics import Metrics
from llmgw.control.quota import Meter
from llmgw.core import events, state, subjects

log = logs.get("llmgw.control")

CONTROL_PREFIX = subjects.CONTROL_EVENTS_ALL[:-1]  # "llmgw.events.control."
METERED = (*state.QUARANTINABLE, events.Heartbeat, events.GpuHealthChanged)
"""What counts against a node's share of the log: everything it wrote (its registrations,
shard reports and heartbeats, and, through `note_skipped`, messages on its subjects that no
reader accepts), and the GPU health changes the leader records from its heartbeats.
Heartbeats expire, but within their TTL (up to an hour) a node sending them without pause
fills the log as well as with anything else; and each one reporting a change (an ECC
count going 1, 2, 3, ... or a flag that flips) made the leader write a durable event:
unmetered, a node wrote the log through the leader as fast as it sent them."""


class Folded:
    """The state folded so far and the bookkeeping the leader needs around it."""

    def __init__(
        self, metrics: Metrics, clock: Callable[[], float], meter: Meter | None = None
    ) -> None:
        self.state = state.ClusterState()
        self.meter = meter
        """Counts each node's `METERED` messages (llmgw.control.quota)."""
        self.collect_ignored = False
        """Keep in `ignored` the sequences of quarantined nodes' messages that no fold
        needs: the events the fold ignored, their heartbeats once folded, and what no
        reader accepts (the leader deletes them)."""
        self.ignored: list[int] = []
        self.on_collect: Callable[[int], None] | None = None
        """Told of each sequence kept in `ignored` (the leader's attester: llmgw.control.
        attesting, which does not attest what is deleted)."""
        self.ignored_total = 0
        self.metrics = metrics
        self.clock = clock
        self.control_seq = 0
        """Last sequence folded (or skipped, see `note_skipped`) on llmgw.events.control.>."""
        self.rejected = 0
        self.own_rejected = 0
        """Refused events that carry the epoch passed to `fold` (the leader's own)."""
        self.since_snapshot = 0
        self._undecodable_seen = 0
        self._skipped_control: list[int] = []
        self.live = False
        """Caught up with the log: a replica that begins serving now is a placement that
        just completed, timed into `placement_seconds` (a replay's are history, not
        observed again at every restart)."""

    def fold(self, batch: list[bus.Record], *, epoch: int = 0) -> bool:
        """Fold records into the state; True when one could change a decision.

        Heartbeats of ready nodes that report no health change cannot: they only
        refresh ages, which the leader's timer looks at. Anything else can.
        """
        st = self.state
        applied = rejected = 0
        interesting = False
        control = self.control_seq
        meter = self.meter
        ignored = 0
        for rec in batch:
            event = rec.event
            if meter is not None and isinstance(event, METERED):
                meter.observe(event.node, rec.seq, rec.time, rec.size)
            if type(event) is events.Heartbeat:
                if not interesting:
                    node = st.nodes.get(event.node)
                    interesting = (
                        node is None or node.liveness != "ready" or _health_changed(node, event)
                    )
            else:
                interesting = True
            waiting = self.live and type(event) is events.ShardStatus and _not_serving(st, event)
            reason = state.apply(st, event, rec.seq, rec.time)
            if waiting and reason is None:
                self._placed(event)  # type: ignore[arg-type]  # a ShardStatus, checked above
            if rec.subject.startswith(CONTROL_PREFIX):
                control = rec.seq
            if st.quarantined and type(event) is events.Heartbeat and event.node in st.quarantined:
                # Folded, or refused (its node never registered): not worth a line each.
                self._heartbeat_spent(rec.seq)
                applied, rejected = applied + (reason is None), rejected + (reason is not None)
                continue
            if reason is None:
                applied += 1
                continue
            rejected += 1
            if st.quarantined and state.ignored_by_quarantine(st, event):
                # Not worth a line each: a flood is what quarantined it. Counted, and
                # kept for the leader to delete.
                ignored += 1
                if self.collect_ignored:
                    self._collect(rec.seq)
                continue
            if epoch and isinstance(event, events.ControlEvent) and event.epoch == epoch:
                self.own_rejected += 1
            log.warning(
                "rejected",
                seq=rec.seq,
                subject=rec.subject,
                type=events.tag_of(type(event)),
                reason=reason,
            )
        self.control_seq = control
        self._account(batch, applied=applied, rejected=rejected, ignored=ignored)
        self._settle_skipped()
        return interesting

    def _account(
        self, batch: list[bus.Record], *, applied: int, rejected: int, ignored: int
    ) -> None:
        """Once per folded batch: move the quota window, count, and set the metrics."""
        st = self.state
        if self.meter is not None and batch:
            self.meter.advance(batch[-1].time)  # heartbeats move the window's end too
        self.rejected += rejected
        self.since_snapshot += len(batch)
        m = self.metrics
        if applied:
            m.applied.inc(applied)
        if rejected:
            m.rejected.inc(rejected)
        if ignored:
            self.ignored_total += ignored
            m.quarantine_ignored.inc(ignored)
        m.quarantined_nodes.set(len(st.quarantined))
        if batch:
            m.folded_seq.set(st.last_seq)
            m.fold_lag.set(max(0.0, self.clock() - batch[-1].time))
            m.epoch.set(st.epoch)

    def _placed(self, event: events.ShardStatus) -> None:
        """A replica was not serving before `event`: time its placement if it is now."""
        r = self.state.replicas.get(event.replica_id)
        if r is not None and all(s.phase == "serving" for s in r.shards):
            self.metrics.placement_seconds.observe(max(0.0, float(event.ts) - r.placed_ts))

    def _heartbeat_spent(self, seq: int) -> None:
        """A quarantined node's heartbeat, folded (its liveness is taken) or refused (its
        node never registered): what it cost the log need not stay (heartbeats are
        volatile, in no digest; a node flooding them would otherwise keep each for its
        TTL)."""
        if self.collect_ignored:
            self._collect(seq)

    def _collect(self, seq: int) -> None:
        self.ignored.append(seq)
        if self.on_collect is not None:
            self.on_collect(seq)

    @property
    def undecodable(self) -> int:
        """Messages the Reader could not decode (or refused by subject) so far."""
        return self._undecodable_seen

    def note_skipped(self, item: bus.Skipped) -> None:
        """A message the Reader passed over (undecodable or refused), as it passes it over:
        the Reader's sink (`bus.SkipSink`), so that a run of them however long is heard
        of whole, even when no event comes between them.

        One on a control subject still moves the fence: a fence that ignored it would
        refuse every write forever. It counts once a later event is folded, since only
        then is everything before it folded. One on a node's subject counts against that
        node's share of the log (only the node may write there: the server enforces it),
        and the leader deletes it while the node is quarantined, since no reader accepts it.
        """
        self._undecodable_seen += 1
        self.metrics.undecodable.inc()
        if item.subject.startswith(CONTROL_PREFIX):
            self._skipped_control.append(item.seq)
            self._settle_skipped()
            return
        node = subjects.writing_node(item.subject)
        if node is None:
            return
        if self.meter is not None:
            self.meter.observe(node, item.seq, item.time, item.size)
        if self.collect_ignored and node in self.state.quarantined:
            self._collect(item.seq)

    def _settle_skipped(self) -> None:
        if not self._skipped_control:
            return
        done = [seq for seq in self._skipped_control if seq < self.state.last_seq]
        if done:
            self.control_seq = max(self.control_seq, *done)
            self._skipped_control = [s for s in self._skipped_control if s not in done]


def _health_changed(node: state.NodeState, hb: events.Heartbeat) -> bool:
    for h in hb.gpus:
        gpu = node.gpus.get(h.index)
        if gpu is None:
            return True
        if h.differs_from(gpu):
            return True
    return False


def _not_serving(st: state.ClusterState, event: events.ShardStatus) -> bool:
    """`event` reports a shard serving while its replica is not yet wholly serving."""
    if event.phase != "serving":
        return False
    r = st.replicas.get(event.replica_id)
    return r is not None and not all(s.phase == "serving" for s in r.shards)

"""The control plane's snapshots: load the newest at start, save every N events or T seconds.

Part of `ControlService` (llmgw.control.service; shared state in llmgw.control.instance).
Only the leader saves on its own; `snapshot_now` saves the state folded now, whoever leads.
"""

from __future__ import annotations

import time

import nats.errors

from llmgw.control.instance import Instance, log
from llmgw.core import state, subjects


class Snapshotting(Instance):
    """Loading and saving snapshots of the folded state."""

    async def _load_snapshot(self) -> None:
        assert self._snapshots is not None
        try:
            snap = await self._snapshots.load()
        except (nats.errors.Error, OSError) as exc:
            log.warning("snapshot_unreadable", error=str(exc), action="folding from seq 0")
            return
        if snap is None:
            log.info("no_snapshot", action="folding the log from the start")
            return
        try:
            loaded = state.decode_snapshot(snap.data)
        except ValueError as exc:
            log.warning("snapshot_invalid", seq=snap.seq, error=str(exc))
            return
        loaded.last_seq = snap.seq
        self.folded.state = loaded
        self.snapshot_seq = snap.seq
        self.metrics.snapshot_seq.set(snap.seq)
        self.metrics.folded_seq.set(snap.seq)
        log.info("snapshot_loaded", seq=snap.seq, bytes=len(snap.data))

    async def _last_control_seq(self, *, upto: int) -> int:
        """The last control-subject sequence at or before `upto` (the snapshot's).

        If the last one is later, the tail replay folds it and sets `control_seq`.
        """
        if upto == 0:
            return 0
        assert self._log is not None
        seq = await self._log.last_seq(subjects.CONTROL_EVENTS_ALL)
        return seq if seq <= upto else 0

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
            log.warning("snapshot_failed", seq=seq, error=str(exc) or repr(exc))
            return
        self.metrics.snapshots.inc()
        # A background save and `snapshot_now` may overlap and finish in either order:
        # the sequence reported is the newest saved, never an older one saved later.
        if seq > self.snapshot_seq:
            self.snapshot_seq = seq
            self.metrics.snapshot_seq.set(seq)

    async def snapshot_now(self) -> int:
        """Save a snapshot of the state as folded now, whoever leads; returns its sequence."""
        assert self._snapshots is not None
        seq = self.state.last_seq
        await self._save_snapshot(state.encode_snapshot(self.state), seq)
        return seq

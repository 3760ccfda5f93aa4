"""The leader's decisions: announce, sync models, police quotas, reconcile, attest.

Part of `ControlService` (llmgw.control.service; shared state in llmgw.control.instance).
The leader decides only on a current fold: after publishing a batch it decides again
once the fold has passed the batch's last sequence (docs/design.md, invariant 1).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

import nats.errors

from llmgw import bus
from llmgw.control import ids as ids_
from llmgw.control import models as model_sync
from llmgw.control.instance import log
from llmgw.control.leadership import Leadership
from llmgw.control.policing import Policing
from llmgw.control.scaling import Scaling
from llmgw.core import events, reconcile, subjects

BEHIND_HOLD_S = 2.0
"""A fold this far behind the log (what it has read was stored this long ago, and more was
stored since) judges no node's heartbeat silence: see `reconcile_once`."""
_MODEL_KINDS = ("model_declared", "model_changed", "model_removed")
_MODEL_EVENTS = tuple(f for kind in _MODEL_KINDS for f in subjects.operator_event_kind(kind))


class Deciding(Leadership, Policing, Scaling):
    """The leader's decide loop and what it decides."""

    _held_behind = False
    """The last decision round found the fold behind the log (said once per stretch)."""

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
                    "own_decisions_rejected",
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
                log.warning("fence_refused", name=self.name, epoch=self.epoch, detail=str(exc))
                await self._abdicate("a fenced write was refused: another leader wrote first")
            except (bus.PublishError, nats.errors.Error, TimeoutError) as exc:
                log.warning("publish_failed", error=str(exc) or repr(exc))
                self._log_was_unavailable("a write to the log failed")
                await asyncio.sleep(0.5)
                self._wake.set()
            except bus.ReaderError as exc:
                # A read the decision needs (the model sync's history) got no answer: in a
                # NATS cluster, while the stream elects a new leader. Decide again shortly;
                # a control plane that exits here leaves the fleet without a leader.
                log.warning("read_failed", error=str(exc), action="deciding again in 0.5 s")
                self._log_was_unavailable("a read of the log failed")
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
        if await self._autoscale():
            return  # plan on once the fold has the new counts
        # Attest only when nothing was just written: a write's fence is the control
        # sequence folded so far, which our own unfolded decisions would have moved.
        if await self.reconcile_once() == 0:
            await self._attest()

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
                "model_synced",
                type=events.tag_of(type(event)),
                model=getattr(event, "name", "")
                or getattr(getattr(event, "profile", None), "name", ""),
                seq=published.seq,
            )
        self._models_synced_epoch = self.epoch
        self._wake.set()

    async def reconcile_once(self) -> int:
        """Reconcile the state as folded now and publish the decisions; their count."""
        st = self.state
        reader = self._reader
        if reader is not None and reader.resets != self._reader_resets:
            self._reader_resets = reader.resets
            self._log_was_unavailable("the log reader was reset")
        behind = 0.0
        if reader is not None and reader.more_pending:
            behind = self.clock() - reader.last_time
        if behind > BEHIND_HOLD_S:
            # Heartbeats stored since are not read yet: silence measured now would be this
            # instance's lag, and a flood it cannot read as fast as it comes (one node's
            # certificate suffices) had the whole fleet declared unreachable.
            why = f"the fold is {behind:.1f} s behind the log"
            self._log_was_unavailable(why, quiet=self._held_behind)
        self._held_behind = behind > BEHIND_HOLD_S
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
        took = time.perf_counter() - started
        self.metrics.reconcile_seconds.set(took)
        self.metrics.reconcile_duration.observe(took)
        self._note_unplaceable(outcome.unplaceable, outcome.unplaceable_codes)
        if not outcome.decisions:
            return 0
        await self._publish_fenced(outcome.decisions)
        return len(outcome.decisions)

    def _note_unplaceable(self, now_unplaceable: dict[str, str], codes: Mapping[str, str]) -> None:
        for model, reason in now_unplaceable.items():
            self.metrics.placement_failures.labels(model, codes.get(model, "other")).inc()
            if self.unplaceable.get(model) != reason:
                log.warning("unplaceable", model=model, reason=reason)
        self.unplaceable = dict(now_unplaceable)
        self.unplaceable_codes = {m: codes.get(m, "other") for m in now_unplaceable}
        self.metrics.unplaceable.set(len(now_unplaceable))

"""The leader lease: contend for it once caught up, renew it, step down, announce the epoch.

Part of `ControlService` (llmgw.control.service; shared state in llmgw.control.instance).
"""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import nats.errors
import nats.js.errors

from llmgw import bus
from llmgw.bus import servertime
from llmgw.control import ids as ids_
from llmgw.control.instance import Instance, log
from llmgw.core import events


class Leadership(Instance):
    """Holding, renewing and giving up the leader lease."""

    _said_time_unknown = False
    """Whether it was logged that this instance does not lead yet, the time unknown."""

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
            log.warning("step_down", name=self.name, epoch=self.epoch, why=why)
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
                if self.caught_up.is_set() and self._knows_the_time():
                    try:
                        if await lease.acquire():
                            # A lease lapses when the log cannot be written: silence
                            # from before it is no evidence against the nodes.
                            self._log_was_unavailable("lease acquired")
                            self._set_leading(True, lease.epoch)
                            self._announced = 0
                            self._sweep_epoch = 0
                            log.info("leading", name=self.name, epoch=lease.epoch)
                            self._wake.set()
                    except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
                        log.warning("lease_error", error=str(exc) or repr(exc))
            else:
                wait = lease.renew_every_s
                try:
                    await lease.renew()
                except bus.LeaseLost as exc:
                    self._step_down(str(exc))
                    wait = 0.25
                except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
                    log.warning("lease_renew_error", error=str(exc) or repr(exc))
                    if not lease.held:
                        self._step_down("the lease ran out while renewals failed")
                    wait = 0.2
            await asyncio.sleep(wait)

    def _knows_the_time(self) -> bool:
        """Whether this instance may lead: only once the server told it its time. Judged
        by its host's clock, a leader whose host runs an hour ahead finds every node lost."""
        if self.clock.measured:
            return True
        if not self._said_time_unknown:
            self._said_time_unknown = True
            log.warning(
                "clock_unmeasured",
                detail="not contending for the leader lease until the NATS server tells its "
                "time: check that it answers JetStream API requests (STREAM.INFO of the log)",
            )
        return False

    async def _clock_loop(self) -> None:
        """Measure the clock at every renewal's interval, beside the lease loop rather than
        in it: a renewal held up by an answer slow to come would let the lease run out."""
        assert self._lease is not None
        while not self._stopping:
            await asyncio.sleep(self._lease.renew_every_s)
            await self._measure_clock()

    async def _measure_clock(self) -> None:
        """Measure this host's clock against the server's (llmgw.bus.servertime): the
        control plane's "now" is the server's, whatever its host's clock says. An answer
        that does not come within `ASK_TIMEOUT_S` measures nothing."""
        assert self._lease is not None
        sample = await servertime.measure(self.clock, self._lease.server_time)
        if sample is not None:
            self._observe_clock(sample)

    def _observe_clock(self, sample: servertime.Sample) -> None:
        # What was read of the clock before is moved with it (the same instant, told by
        # the server's clock): only the first measurement moves it far.
        self._clock_moved(servertime.observed(self.clock, sample, log, "heartbeats are judged"))
        self.metrics.clock_offset.set(self.clock.offset)

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

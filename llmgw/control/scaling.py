"""The leader's autoscaling: read the routers' load reports, decide, publish fenced.

Part of `ControlService` (llmgw.control.service). Every instance follows the stream
`llmgw-signals` (a standby too, so that a new leader has the routers' latest reports at
once); the leader runs `Scaler.decide` at most once per `SCALE_EVERY_S`, before the
reconciler, and publishes the ScaleDecided events it returns like any decision, then
waits to fold them (docs/design.md, "An elastic fleet").
"""

from __future__ import annotations

import asyncio

from llmgw import tasks as tasks_
from llmgw.bus import signals as signals_
from llmgw.control.instance import Instance, log

SCALE_EVERY_S = 1.0


class Scaling(Instance):
    """The autoscaler's loop and its decisions."""

    async def _signals_loop(self) -> None:
        """Follow the routers' and agents' load reports until stopped; reconnect after
        failures."""
        if self._nc is None:
            # An in-memory log (tests): reports come through `scaler.note`. Waits rather
            # than returns: the service ends when any of its loops does.
            await asyncio.Event().wait()
        await tasks_.retrying(self._follow_signals, stopped=lambda: self._stopping, wake=None,
                              what="signals_read", logger=log)  # fmt: skip

    async def _follow_signals(self) -> None:
        assert self._nc is not None
        # From a few seconds ago by the server's time, which stamps the reports: by a host's
        # clock an hour ahead, the reports kept in the stream were not read.
        since = self.clock() - signals_.START_WINDOW_S
        reader = signals_.SignalsReader(self._nc, since=since, name=f"control-{self.name}-signals")
        async with reader:
            async for batch in reader.batches():
                for record in batch:
                    self.scaler.note(record.subject, signals_.report_of(record), state=self.state)

    async def _autoscale(self) -> bool:
        """Decide and publish scaling; True when something was published."""
        now = self.clock()
        scaler = self.scaler
        if now - scaler.decided_at < SCALE_EVERY_S:
            return False
        scaler.decided_at = now
        if scaler.epoch != self.epoch:
            scaler.restart(self.epoch)
        st = self.state
        decided = scaler.decide(
            st, now, epoch=self.epoch, basis_seq=st.last_seq,
            unplaceable=self.unplaceable_codes, ids=self._decision_ids,
        )  # fmt: skip
        if not decided:
            return False
        await self._publish_fenced(list(decided))
        for d in decided:
            log.info("scaled", model=d.model, replicas=f"{d.from_replicas}->{d.to_replicas}",
                     reason=d.reason)  # fmt: skip
        return True

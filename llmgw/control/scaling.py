"""The leader's autoscaling: read the routers' load reports, decide, publish fenced.

Part of `ControlService` (llmgw.control.service). Every instance follows the stream
`llmgw-signals` (a standby too, so that a new leader has the routers' latest reports at
once); the leader runs `Scaler.decide` at most once per `SCALE_EVERY_S`, before the
reconciler, and publishes the ScaleDecided events it returns like any decision, then
waits to fold them (docs/design.md, "An elastic fleet").
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from llmgw.bus import signals as signals_
from llmgw.control.instance import Instance, log
from llmgw.control.scaler import Scaler

SCALE_EVERY_S = 1.0


class Scaling(Instance):
    """The autoscaler's loop and its decisions."""

    scaler: Scaler
    _scaler_epoch: int = 0
    _scaled_at: float = 0.0

    def _scaler_for_epoch(self) -> Scaler:
        if not hasattr(self, "scaler"):
            self.scaler = Scaler(self.clock())
        if self._scaler_epoch != self.epoch:
            self._scaler_epoch = self.epoch
            self.scaler.restart(self.clock())
        return self.scaler

    async def _signals_loop(self) -> None:
        """Follow the routers' load reports until stopped; reconnect after failures."""
        wait = 1.0
        while not self._stopping:
            nc = self._nc
            if nc is None:
                # An in-memory log (tests): reports come through `scaler.note`. Waits
                # rather than returns: the service ends when any of its loops does.
                await asyncio.Event().wait()
                continue
            began = time.monotonic()
            try:
                reader = signals_.SignalsReader(nc, name=f"control-{self.name}-signals")
                async with reader:
                    async for batch in reader.batches():
                        scaler = self._scaler_for_epoch()
                        for record in batch:
                            scaler.note(record.subject, signals_.report_of(record))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # no stream yet, a lost connection: try again
                log.warning("signals_read_failed", error=str(exc) or type(exc).__name__,
                            retry_in_s=wait)  # fmt: skip
            wait = 1.0 if time.monotonic() - began > 60.0 else min(wait * 2, 30.0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.sleep(wait), wait + 1)

    async def _autoscale(self) -> bool:
        """Decide and publish scaling; True when something was published."""
        now = self.clock()
        if now - self._scaled_at < SCALE_EVERY_S:
            return False
        self._scaled_at = now
        st = self.state
        scaler = self._scaler_for_epoch()
        decided = scaler.decide(
            st, now, epoch=self.epoch, basis_seq=st.last_seq,
            unplaceable=self.unplaceable_codes, ids=self._decision_ids,
        )  # fmt: skip
        for model, (obs, _reason) in scaler.last.items():
            s = obs.signals
            for signal, value in (("waiting", s.waiting), ("running", s.running),
                                  ("kv_usage", s.kv_usage), ("ttft_p90_s", s.ttft_p90_s),
                                  ("itl_p90_s", s.itl_p90_s), ("requests", s.requests),
                                  ("recommended", obs.recommended)):  # fmt: skip
                self.metrics.autoscale_signal.labels(model, signal).set(value)
        if not decided:
            return False
        await self._publish_fenced(list(decided))
        for d in decided:
            log.info("scaled", model=d.model, replicas=f"{d.from_replicas}->{d.to_replicas}",
                     reason=d.reason)  # fmt: skip
        return True

"""The leader's policing of nodes' log traffic: quarantine, release, delete what was ignored.

Part of `ControlService` (llmgw.control.service; shared state in llmgw.control.instance).
Every instance measures each node's traffic (llmgw.control.quota); the leader
quarantines a node over its budget and releases it once calm, deletes the messages
its fold ignored for quarantined nodes, once per epoch sweeps what they wrote before
it led (docs/security.md, "A node's share of the log"), and deletes messages refused
for their TTL (llmgw.core.retention).
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from llmgw import bus
from llmgw.bus.ports import LogReader
from llmgw.control import ids as ids_
from llmgw.control.instance import Instance, log
from llmgw.core import events, subjects


class Policing(Instance):
    """Quarantines, releases and the deletions that follow from them."""

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
        had every registered and shard message in (Q, S] ignored by every fold, its
        heartbeats there folded already (they are volatile), and what no reader accepts
        refused by all: every message it wrote in (Q, S] is deleted. Best effort: a
        failure leaves them in the log, as before.
        """
        assert self._log is not None
        upto = self.state.last_seq
        targets = sorted((node, q.seq) for node, q in self.state.quarantined.items())
        found: list[int] = []
        for node, since in targets:
            refused: list[int] = []  # what no reader accepts, however many
            reader = self._log.reader(
                after_seq=since,
                subjects_filter=[subjects.node_events(node)],
                follow=False,
                name=f"control-{self.name}-sweep",
                on_skip=functools.partial(_keep_seq, refused),
            )
            try:
                async with reader:
                    async for batch in reader.batches():
                        found += [r.seq for r in batch if r.seq <= upto]
                        if batch and batch[-1].seq >= upto:
                            break
            except Exception as exc:  # best effort; the loop must not die of it
                log.warning("quarantine_sweep_failed", node=node, error=repr(exc))
                continue
            found += [seq for seq in refused if since < seq <= upto]
        if found and self.leading:
            log.info("quarantine_sweep", messages=len(found), upto_seq=upto)
            self.folded.ignored.extend(found)
            for seq in found:
                self.attester.drop(seq)
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
        log.info("ttl_refused_deleted", **_deletion(result, seqs))

    async def _delete_loop(self) -> None:
        """Delete the messages the fold ignored for quarantined nodes: a flood then costs
        the log bounded storage. No fold changes: every fold ignores them (they come after
        the node's quarantine in the log)."""
        batch = 1000
        while not self._stopping:
            await self._delete_wake.wait()
            self._delete_wake.clear()
            if self._reader is not None and self._reader.ttl_refused:
                self._delete_expiring(self._reader)  # a run of them, no batch to end at
            ignored = self.folded.ignored
            while ignored and self.leading and not self._stopping and self._log is not None:
                seqs = ignored[:batch]
                del ignored[:batch]
                result = await self._log.delete(seqs)
                self.metrics.quarantine_deleted.inc(result.deleted)
                log.info("quarantine_deleted", **_deletion(result, seqs))
                if not result.failed:
                    self._delete_strikes = 0
                    continue
                self.metrics.quarantine_delete_failed.inc(len(result.failed))
                self._delete_strikes = 0 if result.deleted else self._delete_strikes + 1
                seq, why = result.failed[0]
                if self._delete_strikes >= 5:
                    log.error(
                        "quarantine_delete_failed",
                        count=len(result.failed) + len(ignored),
                        seq=seq,
                        error=why,
                        action="giving up on these; check the control identity may call "
                        "STREAM.MSG.DELETE",
                    )
                    ignored.clear()
                    self._delete_strikes = 0
                    break
                log.warning("quarantine_delete_retry", count=len(result.failed), seq=seq, error=why)
                ignored.extend(s for s, _ in result.failed)
                await asyncio.sleep(1.0)


def _keep_seq(into: list[int], item: bus.Skipped) -> None:
    into.append(item.seq)


def _deletion(result: bus.Deleted, seqs: list[int]) -> dict[str, Any]:
    """A deletion's log fields: how many went, were gone already, failed; which range."""
    return {
        "deleted": result.deleted,
        "gone": result.gone,
        "failed": len(result.failed),
        "first_seq": seqs[0],
        "last_seq": seqs[-1],
    }

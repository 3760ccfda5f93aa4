"""The leader lease's bound on the epochs an agent obeys.

A command whose epoch no leader lease has shown could not have come from a leader:
the live holder's epoch is the highest there is. A new leader's first commands carry
an epoch above the one cached here, so the lease is re-read before refusing one. What
is refused is not applied and does not raise the ledger's epoch, so it cannot make the
agent ignore the real leader. Used by `llmgw.agent.service`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from llmgw import bus, logs
from llmgw.agent import ledger
from llmgw.agent.ports import LeaseView
from llmgw.core import events

log = logs.get("llmgw.agent.service")

LEASE_READS = 3
"""Reads of the leader lease before a command's epoch counts as beyond it."""
LEASE_REREAD_S = 0.25


class LeaseBound:
    """The highest epoch a live, signed leader lease has shown this node's agent."""

    def __init__(self, node: str, state_dir: Path) -> None:
        self.node = node
        self.state_dir = state_dir
        self.epoch = 0
        """The highest epoch a live leader lease has shown this agent."""
        self.refused = 0
        """Commands refused for an epoch beyond the leader lease's (never applied or kept)."""

    async def admits(self, lease: LeaseView, book: ledger.Ledger, record: bus.Record) -> bool:
        """False (logged, counted) for a command whose epoch no leader lease has shown."""
        cmd = record.event
        if not isinstance(cmd, events.Command) or cmd.node != self.node:
            return True
        for attempt in range(LEASE_READS):
            if cmd.epoch <= self.epoch:
                return True
            if attempt:
                # A replica answering the read may lag the new leader's acquisition.
                await asyncio.sleep(LEASE_REREAD_S * attempt)
            await self.reread(lease, book)
        why = ledger.beyond_lease(cmd, self.epoch)
        if not why:
            return True
        self.refused += 1
        log.warning(
            "command_refused",
            seq=record.seq,
            id=cmd.id,
            type=events.tag_of(type(cmd)),
            replica_id=cmd.replica_id,
            reason=why,
            refused=self.refused,
        )
        return False

    async def reread(self, lease: LeaseView, book: ledger.Ledger) -> None:
        """Read the lease until it answers: a command is neither obeyed nor lost unread."""
        wait = 0.2
        while True:
            try:
                await self.read(lease, book)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("lease_unreadable", error=repr(exc), retry_in_s=wait)
                await asyncio.sleep(wait)
                wait = min(wait * 2, 5.0)

    async def read(self, lease: LeaseView, book: ledger.Ledger) -> None:
        """Raise `epoch` to the live lease's; an epoch on disk above it is garbage."""
        holder = await lease.holder()
        if holder is None:
            return  # no leader now (expired, released or untrusted): the highest seen stays
        epoch = holder.epoch
        self.epoch = max(self.epoch, epoch)
        if book.epoch > epoch:
            # The live holder's epoch is the highest any leader had: more was never real.
            log.warning("ledger_epoch_beyond_lease", epoch=book.epoch, lease_epoch=epoch)
            book.epoch = epoch
            ledger.save(self.state_dir, book)

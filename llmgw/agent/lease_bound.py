"""The leader lease's bound on the epochs an agent obeys.

A command whose epoch no leader lease has shown could not have come from a leader:
the live holder's epoch is the highest there is. A new leader's first commands carry
an epoch above the one cached here, so the lease is re-read before refusing one. What
is refused is not applied and does not raise the ledger's epoch, so it cannot make the
agent ignore the real leader. Used by `llmgw.agent.service`.
"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import nats.js.errors

from llmgw import bus, logs
from llmgw.agent import ledger
from llmgw.bus import keys as bus_keys
from llmgw.bus import lease as bus_lease
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

    async def admits(self, nc: bus.BusClient, book: ledger.Ledger, record: bus.Record) -> bool:
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
            await self.reread(nc, book)
        why = ledger.beyond_lease(cmd, self.epoch)
        if not why:
            return True
        self.refused += 1
        log.warning(
            "agent_command_refused",
            seq=record.seq,
            id=cmd.id,
            type=events.tag_of(type(cmd)),
            replica_id=cmd.replica_id,
            reason=why,
            refused=self.refused,
        )
        return False

    async def reread(self, nc: bus.BusClient, book: ledger.Ledger) -> None:
        """Read the lease until it answers: a command is neither obeyed nor lost unread."""
        wait = 0.2
        while True:
            try:
                await self.read(nc, book)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("agent_lease_unreadable", error=repr(exc), retry_in_s=wait)
                await asyncio.sleep(wait)
                wait = min(wait * 2, 5.0)

    async def read(self, nc: bus.BusClient, book: ledger.Ledger) -> None:
        """Raise `epoch` to the live lease's; an epoch on disk above it is garbage."""
        stream = f"KV_{bus.LEASE_BUCKET}"
        try:
            msg = await nc.jetstream().get_last_msg(stream, f"$KV.{bus.LEASE_BUCKET}.leader")
        except nats.js.errors.NotFoundError:
            return  # no leader now (expired or released): the highest seen stays
        epoch = ledger.lease_epoch(msg.seq or 0, msg.data, msg.headers)
        if epoch is None:
            return
        # Only a value its control plane signed shows an epoch (a forged one raises none).
        verifier = bus_keys.verifier_of(nc)
        checked = (
            "no verifier"
            if verifier is None
            else bus_lease.verified_value(verifier, msg.data or b"", time.time(), math.inf)
        )
        if isinstance(checked, str):
            log.warning("agent_lease_refused", seq=msg.seq, why=checked)
            return
        self.epoch = max(self.epoch, epoch)
        if book.epoch > epoch:
            # The live holder's epoch is the highest any leader had: more was never real.
            log.warning("agent_ledger_epoch_beyond_lease", epoch=book.epoch, lease_epoch=epoch)
            book.epoch = epoch
            ledger.save(self.state_dir, book)

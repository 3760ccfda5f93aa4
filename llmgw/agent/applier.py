"""Applying one command to this node's shards: what `ledger.decide` chose, recorded.

The service reads and orders commands; this carries each one out against the
supervisor and notes its effect in the ledger, so a command re-read after a restart
is not applied twice. A StartShard the node must refuse yields ShardStatus failed with
the reasons. Used by `llmgw.agent.service`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from llmgw import logs
from llmgw.agent import engines, ledger
from llmgw.agent.shards import LIVE, ShardView
from llmgw.agent.supervisor import Supervisor
from llmgw.core import events

log = logs.get("llmgw.agent.service")

Plan = Callable[[events.StartShard, frozenset[int]], engines.Launch]
"""This node's launch for a start, given the GPUs in use; raises LaunchRefused."""


class Applier:
    """Carries out commands on one node's supervisor and keeps the ledger up to date."""

    def __init__(
        self,
        *,
        node: str,
        supervisor: Supervisor,
        book: ledger.Ledger,
        state_dir: Path,
        clock: Callable[[], float],
        status: Callable[[ShardView], None],
        plan: Plan,
    ) -> None:
        self.node = node
        self.supervisor = supervisor
        self.book = book
        self.state_dir = state_dir
        self.clock = clock
        self._status = status
        self._plan = plan
        self.applied = 0

    async def apply(self, seq: int, cmd: events.Command, skip: bool) -> None:
        """Apply `cmd` as the ledger decides; `skip` when a later command supersedes it."""
        decision = ledger.decide(cmd, self.book, self.supervisor.view(cmd.replica_id, cmd.shard))
        fields = {
            "seq": seq,
            "type": events.tag_of(type(cmd)),
            "replica_id": cmd.replica_id,
            "generation": cmd.generation,
            "shard": cmd.shard,
        }
        if decision.action == "start" and skip:
            self._note_started(cmd)
            log.info("command_superseded", **fields)
            return
        log.info("command", action=decision.action, reason=decision.reason, **fields)
        self.applied += 1
        match decision.action:
            case "start":
                assert isinstance(cmd, events.StartShard)
                await self._start(cmd)
            case "stop":
                assert isinstance(cmd, events.StopShard)
                await self.supervisor.stop(
                    cmd.replica_id,
                    cmd.shard,
                    grace_s=cmd.grace_s,
                    reason=cmd.reason or "stopped by command",
                )
            case "drain":
                await self.supervisor.mark_draining(cmd.replica_id, cmd.shard)
            case "report_stopped":
                self._report_stopped(cmd)
            case "ignore":
                pass

    def _report_stopped(self, cmd: events.Command) -> None:
        reason = cmd.reason if isinstance(cmd, events.StopShard) else ""
        self._status(
            ShardView(
                replica_id=cmd.replica_id,
                generation=cmd.generation,
                shard=cmd.shard,
                phase="stopped",
                error=reason or "not running on this node",
            )
        )
        ledger.note_ended(self.book, cmd.replica_id, cmd.shard, cmd.generation, self.clock())
        ledger.save(self.state_dir, self.book)

    async def _start(self, cmd: events.StartShard) -> None:
        sup = self.supervisor
        busy = set(sup.busy_gpus())
        live = sup.view(cmd.replica_id, cmd.shard)
        if live is not None and live.phase in LIVE and live.generation < cmd.generation:
            busy -= set(live.gpus)  # the supervisor stops the older generation first
        try:
            launch = self._plan(cmd, frozenset(busy))
        except engines.LaunchRefused as exc:
            self.refused(cmd, f"node {self.node} refused the shard: {exc}")
            return
        await sup.start(cmd.replica_id, cmd.generation, cmd.shard, cmd.launch, launch)
        self._note_started(cmd)
        ledger.save(self.state_dir, self.book)
        log.info(
            "shard_started",
            replica_id=cmd.replica_id,
            generation=cmd.generation,
            since_command_ms=round((self.clock() - cmd.ts) * 1000, 2),
        )

    def refused(self, cmd: events.StartShard, error: str) -> None:
        """Report a start this node will not run as failed, with `error`, and record it."""
        log.warning("shard_refused", replica_id=cmd.replica_id, error=error)
        self._status(
            ShardView(
                replica_id=cmd.replica_id,
                generation=cmd.generation,
                shard=cmd.shard,
                phase="failed",
                error=error,
                gpus=cmd.launch.gpus,
            )
        )
        self._note_started(cmd)
        ledger.note_ended(self.book, cmd.replica_id, cmd.shard, cmd.generation, self.clock())
        ledger.save(self.state_dir, self.book)

    def _note_started(self, cmd: events.Command) -> None:
        ledger.note_started(self.book, cmd.replica_id, cmd.shard, cmd.generation, self.clock())

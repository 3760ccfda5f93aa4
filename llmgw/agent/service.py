"""The agent service: `llmgw agent --config FILE`, one per GPU node.

It ties the agent's parts to the log:

- at start it adopts the engines a previous run left serving (pid files), then
  discovers the node (its engines' GPU memory is not foreign) and queues a
  NodeRegistered with the whole inventory and the shards already running;
- it connects to NATS as this node (mutual TLS), reconnecting forever with the
  bus's jittered exponential backoff, so a restarted server does not face the
  whole fleet at once; every reconnect queues a fresh NodeRegistered;
- every event goes through the on-disk outbox (`llmgw.agent.outbox`) and is
  published in order from there, each with its id as `Nats-Msg-Id`: what happens
  while NATS is unreachable (or the agent is being killed) is published, once,
  when it can be. Heartbeats are published directly, with a per-message TTL,
  only while the outbox is empty (a heartbeat is stale once it waited);
- it reads `llmgw.cmd.<node>` through the consumer `cmd-<node>` from the last
  sequence whose effect it recorded (`llmgw.agent.ledger`), so a command sent
  while the agent was away runs when it returns, and applies each command
  idempotently by replica id and generation, ignoring deposed leaders' epochs and
  refusing epochs beyond the leader lease's (read from KV, re-read on a higher one);
  Commands on one shard run one after the other; on different shards they run
  concurrently (a 30 s stop grace does not hold up another shard's start);
- a StartShard that the node must refuse (GPU in use, fp8 on an old GPU, an env
  name or engine option its `launch` policy does not allow, ...) yields ShardStatus
  failed with the reasons; nothing a command says crashes it.

Engines are never stopped when the agent stops: serving survives the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import ssl
import time
import uuid
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import msgspec
import nats.js.errors

from llmgw import __version__, bus, logs
from llmgw import tasks as tasks_
from llmgw.agent import config as agent_config
from llmgw.agent import discovery, engines, ledger, reports
from llmgw.agent.config import AgentConfig
from llmgw.agent.discovery import infiniband
from llmgw.agent.engines import validation
from llmgw.agent.outbox import Outbox
from llmgw.agent.supervisor import LIVE, Settings, ShardView, Supervisor, status_event
from llmgw.bus import keys as bus_keys
from llmgw.bus import lease as bus_lease
from llmgw.core import events, subjects
from llmgw.core.inventory import Inventory
from llmgw.pki import authorization
from llmgw.pki.identity import Identity

log = logs.get("llmgw.agent.service")

Discover = Callable[..., discovery.Discovery]

LEASE_READS = 3
"""Reads of the leader lease before a command's epoch counts as beyond it."""
LEASE_REREAD_S = 0.25


def _new_id() -> str:
    return uuid.uuid4().hex


class AgentService:
    """One node's agent. `run(stop)` serves until `stop` is set."""

    def __init__(
        self,
        cfg: AgentConfig,
        *,
        tls: ssl.SSLContext | None = None,
        discover: Discover = discovery.discover,
        clock: Callable[[], float] = time.time,
        new_id: Callable[[], str] = _new_id,
        reconnect_backoff: tuple[float, float] | None = None,
        config_source: str = "",
    ) -> None:
        self.cfg = cfg
        self.config_source = config_source
        """The config file's path, named in refusals that say which setting to change."""
        self.node = cfg.node_id
        self.identity = Identity("node", cfg.node_id)
        self.state_dir = Path(cfg.state_dir)
        self._tls = tls
        self._discover = discover
        self.clock = clock
        self.new_id = new_id
        self._backoff = reconnect_backoff
        self.started = asyncio.Event()
        """Set once engines are adopted, the node discovered and its registration queued."""
        self.connected_once = asyncio.Event()
        self.nc: bus.BusClient | None = None
        self.publisher: bus.Publisher | None = None
        self.supervisor: Supervisor | None = None
        self.outbox: Outbox | None = None
        self.ledger = ledger.Ledger()
        self.inventory = Inventory()
        self.context = engines.LaunchContext()
        self.source = ""
        self._hcas_simulated = False
        self.registrations = 0
        self.heartbeats_sent = 0
        self.commands_applied = 0
        self.commands_refused = 0
        """Commands refused for an epoch beyond the leader lease's (never applied or kept)."""
        self.lease_epoch = 0
        """The highest epoch a live leader lease has shown this agent."""
        self._wake = asyncio.Event()
        self._reader: bus.Reader | None = None
        self._inflight: dict[int, asyncio.Task[None]] = {}
        self._by_shard: dict[str, asyncio.Task[None]] = {}
        self._dispatched_seq = 0
        self._heartbeat_seq = 0

    # ------------------------------------------------------------------ lifecycle

    async def run(self, stop: asyncio.Event) -> None:
        """Adopt, discover, connect, then deliver events, heartbeat and apply commands."""
        await self._prepare()
        tasks: list[asyncio.Task[Any]] = []
        stopped = asyncio.create_task(stop.wait())
        try:
            connecting = asyncio.create_task(self._connect())
            await asyncio.wait([stopped, connecting], return_when=asyncio.FIRST_COMPLETED)
            if not connecting.done():
                # Cancelled again if nats-py's wait_for swallowed the first (Python 3.11).
                await tasks_.stop([connecting], timeout_s=2.0, who="agent connect")
                return
            connecting.result()
            tasks = [
                self._spawn(self._deliver(), "deliver"),
                self._spawn(self._heartbeats(), "heartbeat"),
                self._spawn(self._commands(), "commands"),
            ]
            done, _ = await asyncio.wait([stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stopped and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            stopped.cancel()
            # The command reader first: its loop ends even if a cancel is swallowed
            # (see llmgw.tasks).
            if self._reader is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._reader.close(), 3)
            await tasks_.stop(tasks, who=f"agent {self.cfg.node_id}")
            await self._shutdown()

    async def _prepare(self) -> None:
        cfg = self.cfg
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.ledger = self._load_ledger()
        self.outbox = Outbox(
            self.state_dir / "outbox",
            max_events=cfg.outbox_max_events,
            max_bytes=cfg.outbox_max_bytes,
        )
        self.supervisor = Supervisor(
            Settings(
                state_dir=str(self.state_dir),
                address=cfg.address,
                stop_grace_s=cfg.stop_grace_s,
                tail_lines=cfg.log_tail_lines,
                poll_s=cfg.engine_poll_s,
            ),
            self._on_change,
        )
        for result in await self.supervisor.adopt():
            if not result.adopted:
                log.warning(
                    "engine_not_adopted",
                    replica_id=result.replica_id,
                    pid=result.pid,
                    reason=result.reason,
                )
        # After adoption: our engines' GPU memory must not count as foreign.
        found = await asyncio.to_thread(
            self._discover,
            sim_gpus=cfg.sim_gpus,
            infiniband_root=cfg.infiniband_root,
            declared_fabrics=[(f.name, f.hcas) for f in cfg.fabrics],
            own_pids=self.supervisor.own_pids(),
            own_gpus=self.supervisor.busy_gpus(),
        )
        for warning in found.warnings:
            log.warning("discovery_warning", detail=warning)
        for warning in agent_config.fabric_warnings(cfg.fabrics, found.inventory.hcas):
            log.warning("fabric_warning", detail=warning)
        self.inventory = found.inventory
        self.source = found.source
        self._hcas_simulated = found.hcas_simulated
        self.context = agent_config.launch_context(cfg, self.inventory)
        # Queued before any adopted shard's first status: the log shows the node first.
        self._register()
        self.started.set()
        log.info(
            "agent_started",
            node=self.node,
            gpus=len(self.inventory.gpus),
            source=self.source,
            adopted=[v.replica_id for v in self.supervisor.views()],
            outbox=len(self.outbox),
            commands_after_seq=self.ledger.last_seq,
        )

    def _load_ledger(self) -> ledger.Ledger:
        try:
            return ledger.load(self.state_dir)
        except ledger.LedgerUnreadable as exc:
            # Starting is better than refusing: re-reading every command of this node is
            # idempotent (generations, and the backlog's superseded starts are skipped).
            path = ledger.path_in(self.state_dir)
            aside = path.with_name(f"{path.name}.corrupt-{int(self.clock())}")
            with contextlib.suppress(OSError):
                os.replace(path, aside)
            log.error("ledger_unreadable", detail=str(exc), moved_to=str(aside))
            return ledger.Ledger()

    async def _connect(self) -> None:
        cfg = self.cfg
        ctx = self._tls or cfg.nats.tls_context()
        nc = await bus.connect(
            list(cfg.nats.servers),
            tls=ctx,
            identity=self.identity,
            name=f"agent-{self.node}",
            keys=cfg.nats.keys(),
        )
        if self._backoff is not None:
            nc.backoff_base, nc.backoff_cap = self._backoff
        self.nc = nc
        self.publisher = bus.Publisher(nc.jetstream(), timeout_s=2.0, attempts=2)
        self.connected_once.set()
        self._wake.set()

    async def _shutdown(self) -> None:
        await tasks_.stop(list(self._inflight.values()), who=f"agent {self.cfg.node_id} commands")
        if self._reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._reader.close(), 3)
        if self.supervisor is not None:
            # Engines keep running: serving survives the agent; the next run adopts them.
            await self.supervisor.close()
        if self.nc is not None and not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.close(), 5)
        if self.outbox is not None:
            self.outbox.close()
        log.info("agent_stopped", node=self.node)

    def _spawn(self, coro: Coroutine[Any, Any, None], what: str) -> asyncio.Task[None]:
        return asyncio.create_task(coro, name=f"agent-{self.node}-{what}")

    # ------------------------------------------------------------------ events out

    def _emit(self, event: events.AnyEvent) -> None:
        assert self.outbox is not None
        self.outbox.put(event)
        self._wake.set()

    def _register(self) -> None:
        assert self.supervisor is not None
        self.registrations += 1
        self._emit(
            reports.registered(
                node=self.node,
                address=self.cfg.address,
                inventory=self.inventory,
                shards=self.supervisor.views(),
                agent_version=__version__,
                event_id=self.new_id(),
                ts=self.clock(),
            )
        )

    def _status(self, view: ShardView) -> None:
        self._emit(status_event(view, node=self.node, event_id=self.new_id(), ts=self.clock()))

    async def _on_change(self, view: ShardView) -> None:
        """Every transition of every shard: into the outbox, and into the ledger if it ended."""
        self._status(view)
        if view.phase not in LIVE:
            ledger.note_ended(
                self.ledger, view.replica_id, view.shard, view.generation, self.clock()
            )
            ledger.save(self.state_dir, self.ledger)
            # Its status is on disk in the outbox: the supervisor need not keep it.
            asyncio.get_running_loop().call_soon(self._forget, view)

    def _forget(self, view: ShardView) -> None:
        assert self.supervisor is not None
        current = self.supervisor.view(view.replica_id, view.shard)
        if current is not None and current.generation == view.generation:
            self.supervisor.forget(view.replica_id, view.shard)

    async def _deliver(self) -> None:
        """Publish the outbox in order; queue a registration on every reconnect."""
        assert self.nc is not None
        assert self.outbox is not None
        assert self.publisher is not None
        nc, outbox, publisher = self.nc, self.outbox, self.publisher
        reconnects = nc.stats["reconnects"]
        failures = 0
        while True:
            if nc.stats["reconnects"] != reconnects:
                reconnects = nc.stats["reconnects"]
                log.info("agent_reconnected", node=self.node, pending=len(outbox))
                self._register()
            entry = outbox.peek()
            if entry is None or not nc.is_connected:
                self._wake.clear()
                # Polling also notices a reconnect (its registration) within 0.2 s.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 0.2)
                continue
            try:
                await publisher.publish(entry.event, ttl_s=entry.ttl_s)
            except bus.PublishError as exc:
                failures += 1
                log.warning(
                    "agent_publish_failed",
                    id=entry.event.id,
                    pending=len(outbox),
                    error=str(exc),
                    attempt=failures,
                )
                await asyncio.sleep(min(5.0, 0.2 * 2 ** min(failures, 5)))
                continue
            except Exception as exc:  # e.g. connection closed under us: try again later
                failures += 1
                log.warning("agent_publish_error", id=entry.event.id, error=repr(exc))
                await asyncio.sleep(min(5.0, 0.2 * 2 ** min(failures, 5)))
                continue
            failures = 0
            outbox.delivered(entry.n)

    async def _heartbeats(self) -> None:
        assert self.nc is not None
        assert self.outbox is not None
        while True:
            await asyncio.sleep(self.cfg.heartbeat_s)
            # Counts every tick, sent or not: a gap in the log says heartbeats were lost.
            self._heartbeat_seq += 1
            await self._refresh_health()
            if not self.nc.is_connected or len(self.outbox):
                continue
            hb = reports.heartbeat(
                node=self.node,
                seq=self._heartbeat_seq,
                gpus=self.inventory.gpus,
                event_id=self.new_id(),
                ts=self.clock(),
            )
            assert self.publisher is not None
            try:
                await self.publisher.publish(hb, ttl_s=self.cfg.heartbeat_ttl_s)
                self.heartbeats_sent += 1
            except Exception as exc:  # a heartbeat is replaced by the next one
                log.warning("agent_heartbeat_failed", error=str(exc))

    async def _refresh_health(self) -> None:
        """Re-read GPU health (ECC, row remapping, foreign memory) for heartbeats and
        launch validation, and the fabrics."""
        if self.supervisor is None:
            return
        await self._refresh_fabrics()
        if self.source == "simulated":
            return
        try:
            found = await asyncio.to_thread(
                discovery.discover_gpus,
                own_pids=self.supervisor.own_pids(),
                own_gpus=self.supervisor.busy_gpus(),
            )
        except discovery.DiscoveryError as exc:
            log.warning("gpu_health_refresh_failed", error=str(exc))
            return
        self.inventory = msgspec.structs.replace(self.inventory, gpus=found.gpus)

    async def _refresh_fabrics(self) -> None:
        """Re-read the RDMA adapters; re-register when the usable fabrics changed.

        A fabric whose ports went down (a cable, the subnet manager) must stop
        being advertised, or the scheduler keeps placing multi-node replicas that
        hang on their first all-reduce; one that came back is advertised again.
        """
        if self._hcas_simulated:
            return
        cfg = self.cfg
        hcas = await asyncio.to_thread(infiniband.read_hcas, cfg.infiniband_root)
        notes: list[str] = []
        usable = discovery.fabrics([(f.name, f.hcas) for f in cfg.fabrics], hcas, notes)
        if usable == self.inventory.fabrics:
            return
        for note in notes:
            log.warning("fabric_warning", detail=note)
        log.info(
            "fabrics_changed",
            before=[f.name for f in self.inventory.fabrics],
            after=[f.name for f in usable],
        )
        self.inventory = msgspec.structs.replace(self.inventory, hcas=hcas, fabrics=usable)
        self.context = agent_config.launch_context(cfg, self.inventory)
        self._register()

    # ------------------------------------------------------------------ commands in

    async def _commands(self) -> None:
        assert self.nc is not None
        self._dispatched_seq = self.ledger.last_seq
        wait = 0.2
        while True:
            reader = bus.Reader(
                self.nc,
                after_seq=self.ledger.last_seq,
                subjects_filter=[subjects.command(self.node)],
                consumer_name=authorization.command_consumer(self.node),
                name=f"agent-{self.node}",
            )
            try:
                await reader.start()
                break
            except Exception as exc:
                # The stream may not be provisioned yet, or the server just went away.
                log.warning("agent_commands_unavailable", error=str(exc), retry_in_s=wait)
                with contextlib.suppress(Exception):
                    await reader.close()
                await asyncio.sleep(wait)
                wait = min(wait * 2, 10.0)
        self._reader = reader
        with contextlib.suppress(Exception):
            # Best effort: heals an epoch on disk no leader had before the first command.
            await self._read_lease()
        log.info("agent_reading_commands", after_seq=self.ledger.last_seq)
        async for records in reader.batches():
            # Refused ones first: a command no leader could have sent must not supersede.
            batch = [r for r in records if await self._within_lease(r)]
            # Each shard's commands in this batch, in order: what may supersede a start.
            per_shard: dict[str, list[events.Command]] = {}
            for record in batch:
                if isinstance(record.event, events.Command):
                    ev = record.event
                    per_shard.setdefault(ledger.key(ev.replica_id, ev.shard), []).append(ev)
            position: dict[str, int] = {}
            for record in batch:
                later: list[events.Command] = []
                if isinstance(record.event, events.Command):
                    k = ledger.key(record.event.replica_id, record.event.shard)
                    p = position.get(k, 0)
                    position[k] = p + 1
                    later = per_shard[k][p + 1 :]
                self._dispatch(record, later)
            self._advance()

    async def _within_lease(self, record: bus.Record) -> bool:
        """False (logged, counted) for a command whose epoch no leader lease has shown.

        A new leader's first commands carry an epoch above the one cached here: the
        lease is re-read before refusing them. What is refused is not applied and does
        not raise the ledger's epoch, so it cannot make the agent ignore the leader.
        """
        cmd = record.event
        if not isinstance(cmd, events.Command) or cmd.node != self.node:
            return True
        for attempt in range(LEASE_READS):
            if cmd.epoch <= self.lease_epoch:
                return True
            if attempt:
                # A replica answering the read may lag the new leader's acquisition.
                await asyncio.sleep(LEASE_REREAD_S * attempt)
            await self._reread_lease()
        why = ledger.beyond_lease(cmd, self.lease_epoch)
        if not why:
            return True
        self.commands_refused += 1
        self._dispatched_seq = max(self._dispatched_seq, record.seq)
        log.warning(
            "agent_command_refused",
            seq=record.seq,
            id=cmd.id,
            type=events.tag_of(type(cmd)),
            replica_id=cmd.replica_id,
            reason=why,
            refused=self.commands_refused,
        )
        return False

    async def _reread_lease(self) -> None:
        """Read the lease until it answers: a command is neither obeyed nor lost unread."""
        wait = 0.2
        while True:
            try:
                await self._read_lease()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("agent_lease_unreadable", error=repr(exc), retry_in_s=wait)
                await asyncio.sleep(wait)
                wait = min(wait * 2, 5.0)

    async def _read_lease(self) -> None:
        """Raise `lease_epoch` to the live lease's; an epoch on disk above it is garbage."""
        assert self.nc is not None
        stream = f"KV_{bus.LEASE_BUCKET}"
        try:
            msg = await self.nc.jetstream().get_last_msg(stream, f"$KV.{bus.LEASE_BUCKET}.leader")
        except nats.js.errors.NotFoundError:
            return  # no leader now (expired or released): the highest seen stays
        epoch = ledger.lease_epoch(msg.seq or 0, msg.data, msg.headers)
        if epoch is None:
            return
        # Only a value its control plane signed shows an epoch (a forged one raises none).
        verifier = bus_keys.verifier_of(self.nc)
        checked = (
            "no verifier"
            if verifier is None
            else bus_lease.verified_value(verifier, msg.data or b"", time.time(), math.inf)
        )
        if isinstance(checked, str):
            log.warning("agent_lease_refused", seq=msg.seq, why=checked)
            return
        self.lease_epoch = max(self.lease_epoch, epoch)
        if self.ledger.epoch > epoch:
            # The live holder's epoch is the highest any leader had: more was never real.
            log.warning(
                "agent_ledger_epoch_beyond_lease", epoch=self.ledger.epoch, lease_epoch=epoch
            )
            self.ledger.epoch = epoch
            ledger.save(self.state_dir, self.ledger)

    def _dispatch(self, record: bus.Record, later: list[events.Command]) -> None:
        cmd = record.event
        self._dispatched_seq = max(self._dispatched_seq, record.seq)
        if not isinstance(cmd, events.Command) or cmd.node != self.node:
            log.warning("agent_command_unexpected", seq=record.seq, type=type(cmd).__name__)
            return
        why = ledger.stale_epoch(cmd, self.ledger.epoch)
        if why:
            log.warning("agent_command_ignored", seq=record.seq, id=cmd.id, reason=why)
            return
        self.ledger.epoch = cmd.epoch
        skip = ledger.superseded(cmd, later, self.ledger.epoch)
        k = ledger.key(cmd.replica_id, cmd.shard)
        before = self._by_shard.get(k)
        task = asyncio.create_task(
            self._apply_after(before, record.seq, cmd, skip), name=f"cmd-{record.seq}"
        )
        self._by_shard[k] = task
        self._inflight[record.seq] = task

        def done(t: asyncio.Task[None], seq: int = record.seq, k: str = k) -> None:
            self._inflight.pop(seq, None)
            if self._by_shard.get(k) is t:
                del self._by_shard[k]
            if not t.cancelled():
                self._advance()

        task.add_done_callback(done)

    def _advance(self) -> None:
        """Record the sequence up to which every command's effect is recorded."""
        floor = min(self._inflight) - 1 if self._inflight else self._dispatched_seq
        if floor > self.ledger.last_seq:
            self.ledger.last_seq = floor
            ledger.save(self.state_dir, self.ledger)

    async def _apply_after(
        self, before: asyncio.Task[None] | None, seq: int, cmd: events.Command, skip: bool
    ) -> None:
        if before is not None:
            # Commands on one shard apply in order: a restart's stop before its start.
            await asyncio.wait([before])
        try:
            await self._apply(seq, cmd, skip)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("agent_command_failed", seq=seq, id=cmd.id)
            if isinstance(cmd, events.StartShard):
                self._refused(cmd, f"the agent could not apply the command: {exc!r}")

    async def _apply(self, seq: int, cmd: events.Command, skip: bool) -> None:
        assert self.supervisor is not None
        sup = self.supervisor
        decision = ledger.decide(cmd, self.ledger, sup.view(cmd.replica_id, cmd.shard))
        fields = {
            "seq": seq,
            "type": events.tag_of(type(cmd)),
            "replica_id": cmd.replica_id,
            "generation": cmd.generation,
            "shard": cmd.shard,
        }
        if decision.action == "start" and skip:
            ledger.note_started(
                self.ledger, cmd.replica_id, cmd.shard, cmd.generation, self.clock()
            )
            log.info("agent_command_superseded", **fields)
            return
        log.info("agent_command", action=decision.action, reason=decision.reason, **fields)
        self.commands_applied += 1
        match decision.action:
            case "start":
                assert isinstance(cmd, events.StartShard)
                await self._start(cmd)
            case "stop":
                assert isinstance(cmd, events.StopShard)
                await sup.stop(
                    cmd.replica_id,
                    cmd.shard,
                    grace_s=cmd.grace_s,
                    reason=cmd.reason or "stopped by command",
                )
            case "drain":
                await sup.mark_draining(cmd.replica_id, cmd.shard)
            case "report_stopped":
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
                ledger.note_ended(
                    self.ledger, cmd.replica_id, cmd.shard, cmd.generation, self.clock()
                )
                ledger.save(self.state_dir, self.ledger)
            case "ignore":
                pass

    async def _start(self, cmd: events.StartShard) -> None:
        assert self.supervisor is not None
        sup = self.supervisor
        busy = set(sup.busy_gpus())
        live = sup.view(cmd.replica_id, cmd.shard)
        if live is not None and live.phase in LIVE and live.generation < cmd.generation:
            busy -= set(live.gpus)  # the supervisor stops the older generation first
        try:
            # The operator's env and engine arguments, bounded by this node's own policy.
            validation.check_policy(cmd.launch, self.cfg.launch, source=self.config_source)
            launch = engines.plan(
                cmd.launch, self.inventory, self.context, busy_gpus=frozenset(busy)
            )
        except engines.LaunchRefused as exc:
            self._refused(cmd, f"node {self.node} refused the shard: {exc}")
            return
        await sup.start(cmd.replica_id, cmd.generation, cmd.shard, cmd.launch, launch)
        ledger.note_started(self.ledger, cmd.replica_id, cmd.shard, cmd.generation, self.clock())
        ledger.save(self.state_dir, self.ledger)
        log.info(
            "agent_shard_started",
            replica_id=cmd.replica_id,
            generation=cmd.generation,
            since_command_ms=round((self.clock() - cmd.ts) * 1000, 2),
        )

    def _refused(self, cmd: events.StartShard, error: str) -> None:
        log.warning("agent_shard_refused", replica_id=cmd.replica_id, error=error)
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
        ledger.note_started(self.ledger, cmd.replica_id, cmd.shard, cmd.generation, self.clock())
        ledger.note_ended(self.ledger, cmd.replica_id, cmd.shard, cmd.generation, self.clock())
        ledger.save(self.state_dir, self.ledger)

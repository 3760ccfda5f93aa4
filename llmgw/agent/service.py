"""The agent service: `llmgw agent --config FILE`, one per GPU node.

It ties the agent's parts to the log:

- at start it adopts the engines a previous run left serving (pid files), then
  discovers the node (its engines' GPU memory is not foreign) and queues a
  NodeRegistered with the whole inventory and the shards already running;
- it connects to NATS as this node (mutual TLS), reconnecting forever with the
  bus's jittered exponential backoff, so a restarted server does not face the
  whole fleet at once; every reconnect queues a fresh NodeRegistered. It reaches
  the log only through its ports (`llmgw.agent.ports`: reports out, commands in,
  the lease), which tests build in memory;
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
import ssl
import time
import uuid
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from llmgw import __version__, bus, listeners, logs
from llmgw import tasks as tasks_
from llmgw.agent import config as agent_config
from llmgw.agent import discovery, engines, kvrelay, ledger, refresh, reports
from llmgw.agent import metrics as agent_metrics
from llmgw.agent.applier import Applier
from llmgw.agent.config import AgentConfig
from llmgw.agent.engines import policy
from llmgw.agent.lease_bound import LeaseBound
from llmgw.agent.loads import EngineFeeds
from llmgw.agent.metrics import AgentMetrics, Live
from llmgw.agent.outbox import Outbox
from llmgw.agent.ports import AgentPorts, CommandReader, connect_jetstream
from llmgw.agent.shards import LIVE, ShardView, status_event
from llmgw.agent.supervisor import Settings, Supervisor
from llmgw.core import events
from llmgw.core.inventory import Inventory
from llmgw.pki.identity import Identity

log = logs.get("llmgw.agent.service")

Discover = Callable[..., discovery.Discovery]


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
        ports: AgentPorts | None = None,
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
        self.ports = ports
        """Reports, commands and the lease; built on the NATS connection when not given."""
        self.nc: bus.BusClient | None = None
        self.supervisor: Supervisor | None = None
        self.outbox: Outbox | None = None
        self.ledger = ledger.Ledger()
        self.inventory = Inventory()
        self.context = engines.LaunchContext()
        self.source = ""
        self._hcas_simulated = False
        self.registrations = 0
        self.heartbeats_sent = 0
        self.lease = LeaseBound(self.node, self.state_dir)
        """The leader lease's epoch as seen here, and the commands refused beyond it."""
        self.applier: Applier | None = None
        """Carries out the commands; counts those applied."""
        self._wake = asyncio.Event()
        self._reader: CommandReader | None = None
        self._inflight: dict[int, asyncio.Task[None]] = {}
        self._by_shard: dict[str, asyncio.Task[None]] = {}
        self._dispatched_seq = 0
        self._heartbeat_seq = 0
        self.feeds = EngineFeeds()
        """Relays local engines' KV events and load (llmgw.agent.kvrelay, .loads)."""
        self.metrics = AgentMetrics(self._live)
        self.admin_url = ""  # where its metrics and health listen (cfg.admin), once started
        self._admin: web.AppRunner | None = None

    # ------------------------------------------------------------------ lifecycle

    async def run(self, stop: asyncio.Event) -> None:
        """Adopt, discover, connect, then deliver events, heartbeat and apply commands."""
        self._admin, self.admin_url = await agent_metrics.serve(self.metrics, self.cfg.admin)
        tasks: list[asyncio.Task[Any]] = []
        stopped = asyncio.create_task(stop.wait())
        try:
            await self._prepare()  # after the listener: the registration names it
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
        self.ledger = ledger.load_or_set_aside(self.state_dir, self.clock())
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
        self.applier = Applier(
            node=self.node,
            supervisor=self.supervisor,
            book=self.ledger,
            state_dir=self.state_dir,
            clock=self.clock,
            status=self._status,
            plan=self._plan,
        )
        for result in await self.supervisor.adopt():
            if not result.adopted:
                log.warning(
                    "engine_not_adopted",
                    replica_id=result.replica_id,
                    pid=result.pid,
                    reason=result.reason,
                )
        for view in self.supervisor.views():
            await self.feeds.observe(view)  # adopted engines go on publishing their KV events
        await self._discover_node()
        self.context = agent_config.launch_context(cfg, self.inventory)
        # Queued before any adopted shard's first status: the log shows the node first.
        self._register()
        self.started.set()
        log.info(
            "started",
            node=self.node,
            gpus=len(self.inventory.gpus),
            source=self.source,
            adopted=[v.replica_id for v in self.supervisor.views()],
            outbox=len(self.outbox),
            commands_after_seq=self.ledger.last_seq,
        )

    async def _discover_node(self) -> None:
        """Read the node's GPUs, adapters and fabrics into `inventory`, warning of surprises."""
        assert self.supervisor is not None
        cfg = self.cfg
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

    async def _connect(self) -> None:
        if self.ports is None:
            nats_cfg = self.cfg.nats
            tls = self._tls or nats_cfg.tls_context()
            self.nc, self.ports = await connect_jetstream(self.node, nats_cfg, tls, self._backoff)
        self.feeds.bind(self.nc, self.node)
        self.connected_once.set()
        self._wake.set()

    async def _shutdown(self) -> None:
        await tasks_.stop(list(self._inflight.values()), who=f"agent {self.cfg.node_id} commands")
        if self._reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._reader.close(), 3)
        await self.feeds.close()
        if self.supervisor is not None:
            # Engines keep running: serving survives the agent; the next run adopts them.
            await self.supervisor.close()
        if self.nc is not None:
            await bus.close(self.nc)
        if self.outbox is not None:
            self.outbox.close()
        if self._admin is not None:
            await self._admin.cleanup()
        log.info("stopped", node=self.node)

    def _live(self) -> Live:
        """What the agent's metrics read at a scrape."""
        hb = self.heartbeats_sent
        return agent_metrics.live(self.started, self.nc, self.outbox, self.supervisor, hb)

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
                metrics=listeners.scrape_target(self.admin_url, self.cfg.address),
            )
        )

    def _status(self, view: ShardView) -> None:
        self._emit(status_event(view, node=self.node, event_id=self.new_id(), ts=self.clock()))

    async def _on_change(self, view: ShardView) -> None:
        """Every transition of every shard: into the outbox, and into the ledger if it ended."""
        self._status(view)
        self.metrics.observe(view, self.clock())
        await self.feeds.observe(view)
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
        assert self.ports is not None
        assert self.outbox is not None
        sink, outbox = self.ports.reports, self.outbox
        reconnects = sink.reconnects
        failures = 0
        while True:
            if sink.reconnects != reconnects:
                reconnects = sink.reconnects
                log.info("reconnected", node=self.node, pending=len(outbox))
                self._register()
            entry = outbox.peek()
            if entry is None or not sink.connected:
                self._wake.clear()
                # Polling also notices a reconnect (its registration) within 0.2 s.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 0.2)
                continue
            try:
                await sink.append(entry.event, ttl_s=entry.ttl_s)
            except bus.PublishError as exc:
                failures += 1
                log.warning(
                    "publish_failed",
                    id=entry.event.id,
                    pending=len(outbox),
                    error=str(exc),
                    attempt=failures,
                )
                await asyncio.sleep(min(5.0, 0.2 * 2 ** min(failures, 5)))
                continue
            except Exception as exc:  # e.g. connection closed under us: try again later
                failures += 1
                log.warning("publish_error", id=entry.event.id, error=repr(exc))
                await asyncio.sleep(min(5.0, 0.2 * 2 ** min(failures, 5)))
                continue
            failures = 0
            outbox.delivered(entry.n)

    async def _heartbeats(self) -> None:
        assert self.ports is not None
        assert self.outbox is not None
        sink = self.ports.reports
        while True:
            await asyncio.sleep(self.cfg.heartbeat_s)
            # Counts every tick, sent or not: a gap in the log says heartbeats were lost.
            self._heartbeat_seq += 1
            await self._refresh_health()
            if not sink.connected or len(self.outbox):
                continue
            hb = reports.heartbeat(
                node=self.node,
                seq=self._heartbeat_seq,
                gpus=self.inventory.gpus,
                event_id=self.new_id(),
                ts=self.clock(),
            )
            try:
                await sink.append(hb, ttl_s=self.cfg.heartbeat_ttl_s)
                self.heartbeats_sent += 1
            except Exception as exc:  # a heartbeat is replaced by the next one
                log.warning("heartbeat_failed", error=str(exc))

    async def _refresh_health(self) -> None:
        """Re-read GPU health and the fabrics (`llmgw.agent.refresh`); re-register when
        the usable fabrics changed."""
        if self.supervisor is None:
            return
        if not self._hcas_simulated:
            cfg = self.cfg
            changed = await refresh.fabrics(self.inventory, cfg.fabrics, cfg.infiniband_root)
            if changed is not None:
                self.inventory = changed
                self.context = agent_config.launch_context(cfg, self.inventory)
                self._register()
        if self.source != "simulated":
            found = await refresh.gpus(self.supervisor)
            if found is not None:
                self.inventory = msgspec.structs.replace(self.inventory, gpus=found)

    # ------------------------------------------------------------------ commands in

    async def _commands(self) -> None:
        assert self.ports is not None
        ports = self.ports
        self._dispatched_seq = self.ledger.last_seq
        wait = 0.2
        while True:
            reader = ports.commands.reader(self.ledger.last_seq)
            try:
                await reader.start()
                break
            except Exception as exc:
                # The stream may not be provisioned yet, or the server just went away.
                log.warning("commands_unavailable", error=str(exc), retry_in_s=wait)
                with contextlib.suppress(Exception):
                    await reader.close()
                await asyncio.sleep(wait)
                wait = min(wait * 2, 10.0)
        self._reader = reader
        with contextlib.suppress(Exception):
            # Best effort: heals an epoch on disk no leader had before the first command.
            await self.lease.read(ports.lease, self.ledger)
        log.info("reading_commands", after_seq=self.ledger.last_seq)
        async for records in reader.batches():
            # Refused ones first: a command no leader could have sent must not supersede.
            batch = [r for r in records if await self._admitted(r)]
            for record, later in zip(
                batch, ledger.successors([r.event for r in batch]), strict=True
            ):
                self._dispatch(record, later)
            self._advance()

    async def _admitted(self, record: bus.Record) -> bool:
        assert self.ports is not None
        if await self.lease.admits(self.ports.lease, self.ledger, record):
            return True
        self._dispatched_seq = max(self._dispatched_seq, record.seq)
        return False

    def _dispatch(self, record: bus.Record, later: list[events.Command]) -> None:
        cmd = record.event
        self._dispatched_seq = max(self._dispatched_seq, record.seq)
        if not isinstance(cmd, events.Command) or cmd.node != self.node:
            log.warning("command_unexpected", seq=record.seq, type=type(cmd).__name__)
            return
        why = ledger.stale_epoch(cmd, self.ledger.epoch)
        if why:
            log.warning("command_ignored", seq=record.seq, id=cmd.id, reason=why)
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
        assert self.applier is not None
        if before is not None:
            # Commands on one shard apply in order: a restart's stop before its start.
            await asyncio.wait([before])
        try:
            await self.applier.apply(seq, cmd, skip)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("command_failed", seq=seq, id=cmd.id)
            if isinstance(cmd, events.StartShard):
                self.applier.refused(cmd, f"the agent could not apply the command: {exc!r}")

    def _plan(self, cmd: events.StartShard, busy: frozenset[int]) -> engines.Launch:
        # The operator's env and engine arguments, bounded by this node's own policy.
        policy.check_policy(cmd.launch, self.cfg.launch, source=self.config_source)
        launch = engines.plan(cmd.launch, self.inventory, self.context, busy_gpus=busy)
        if not self.cfg.kv_events:
            return launch
        return engines.kv_evented(cmd.launch, launch, str(kvrelay.socket_dir(self.state_dir)))

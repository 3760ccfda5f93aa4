"""Test kit for the control plane: configs, in-process services, simulated agents, log reads.

A `SimAgent` is test code that behaves like `llmgw agent` on the wire, as a node
identity through `llmgw.bus`: it registers with simulated GPUs, heartbeats, and
answers StartShard / DrainShard / StopShard from its command consumer by
publishing ShardStatus phases. Used by tests/integration/test_control*.py and
tests/bench/bench_control.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import yaml

from llmgw import bus
from llmgw.control.config import AdminListener, ControlConfig, NatsConfig, SnapshotConfig
from llmgw.control.service import ControlService
from llmgw.core import events, subjects
from llmgw.core.inventory import Gpu
from llmgw.core.profile import ModelProfile
from llmgw.pki.authorization import command_consumer
from llmgw.pki.identity import Identity
from tests.harness import TestNatsServer, connect_as
from tests.kit.timings import FAST


def model(name: str = "m1", replicas: int = 1, **fields: Any) -> ModelProfile:
    return ModelProfile(name=name, engine="sim", replicas=replicas, **fields)


def control_config(
    server: TestNatsServer, name: str, *, models: tuple[ModelProfile, ...] = (), **over: Any
) -> ControlConfig:
    """A config for control plane `name` against `server`, with short test timings."""
    server.pki.client_tls("control", name)  # issue the certificate (and reload the server)
    identity = Identity("control", name)
    certs = server.pki.certs
    fields: dict[str, Any] = {
        "name": name,
        "nats": NatsConfig(
            servers=(server.url,),
            ca_file=str(certs.ca_cert),
            cert_file=str(certs.cert(identity)),
            key_file=str(certs.key(identity)),
        ),
        "lease_ttl_s": 2.0,
        "reconcile_interval_s": 0.2,
        "reconcile": FAST,
        "snapshot": SnapshotConfig(every_events=0, every_s=0),
        "models": models,
        "admin": AdminListener(host="127.0.0.1", port=0),
    }
    fields.update(over)
    return ControlConfig(**fields)


def write_config(cfg: ControlConfig, path: Path) -> Path:
    path.write_text(yaml.safe_dump(msgspec.to_builtins(cfg)))
    return path


@contextlib.asynccontextmanager
async def running(svc: ControlService) -> AsyncIterator[ControlService]:
    """Run `svc` in a task; stop it cleanly (lease released) at exit."""
    stop = asyncio.Event()
    task = asyncio.create_task(svc.run(stop))
    ready = asyncio.create_task(svc.ready.wait())
    await asyncio.wait([task, ready], return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        ready.cancel()
        task.result()  # raises what stopped it
    try:
        yield svc
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


async def read_log(nc: bus.BusClient) -> list[bus.Record]:
    """Everything in the log now (follow=False)."""
    out: list[bus.Record] = []
    async with bus.Reader(nc, follow=False, name="test") as reader:
        async for batch in reader.batches():
            out.extend(batch)
    return out


def sim_gpus(count: int, gpu_class: str = "h100-80g") -> tuple[Gpu, ...]:
    return tuple(
        Gpu(
            index=i,
            uuid=f"GPU-{i:04d}",
            name="NVIDIA H100 80GB HBM3",
            gpu_class=gpu_class,
            memory_mib=81559,
            compute_capability="9.0",
            nvlink_domain=0,
        )
        for i in range(count)
    )


class SimAgent:
    """A node on the wire: registers, heartbeats, answers its commands with ShardStatus.

    On `server` as the node's identity, or on any event log port given as `log` (an
    in-memory one, llmgw.bus.memory, for tests of the control plane without NATS)."""

    def __init__(
        self,
        server: TestNatsServer | None,
        node: str,
        *,
        gpus: int = 2,
        heartbeat_s: float = 0.5,
        serve_after_s: float = 0.1,
        log: bus.EventLog | None = None,
    ) -> None:
        if (server is None) == (log is None):
            raise ValueError("a SimAgent runs on a server or on a log, one of them")
        self.server = server
        self._log = log
        self.node = node
        self.gpus = sim_gpus(gpus)
        self.heartbeat_s = heartbeat_s
        self.serve_after_s = serve_after_s
        """Delay between loading and serving (a slow replacement)."""
        self.beating = True
        self.running: dict[tuple[str, int], int] = {}
        """(replica, shard) -> generation of what this node runs."""
        self.commands: list[events.Event] = []
        self._nc: bus.BusClient | None = None
        self._pub: bus.Publisher | None = None
        """On a server: the publisher behind the log (batches for the quota tests)."""
        self._tasks: list[asyncio.Task[None]] = []
        self._hb = 0
        self._n = 0

    async def start(self) -> SimAgent:
        if self.server is not None:
            self._nc = await connect_as(self.server, "node", self.node)
            log = bus.JetStreamLog(self._nc)
            self._log, self._pub = log, log.publisher
        await self.register()
        self._tasks = [
            asyncio.create_task(self._heartbeats()),
            asyncio.create_task(self._commands()),
        ]
        return self

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._nc is not None:
            await bus.close(self._nc)

    def _id(self, what: str) -> str:
        self._n += 1
        return f"{self.node}-{what}-{self._n}-{time.monotonic_ns()}"

    async def publish(self, event: events.Event, **kw: Any) -> bus.Published:
        assert self._log is not None
        return await self._log.append(event, **kw)

    async def register(self) -> None:
        await self.publish(
            events.NodeRegistered(
                id=self._id("reg"),
                ts=time.time(),
                node=self.node,
                address="127.0.0.1",
                gpus=self.gpus,
                agent_version="sim-agent",
            )
        )

    async def _heartbeats(self) -> None:
        while True:
            if self.beating:
                self._hb += 1
                with contextlib.suppress(bus.PublishError):
                    await self.publish(
                        events.Heartbeat(
                            id=self._id("hb"), ts=time.time(), node=self.node, seq=self._hb
                        ),
                        ttl_s=60,
                    )
            await asyncio.sleep(self.heartbeat_s)

    async def _commands(self) -> None:
        assert self._log is not None
        reader: bus.LogReader
        if self._nc is not None:
            # The node's authorization allows exactly one consumer name on its commands.
            reader = bus.Reader(
                self._nc,
                subjects_filter=[subjects.command(self.node)],
                consumer_name=command_consumer(self.node),
            )
        else:
            reader = self._log.reader(subjects_filter=[subjects.command(self.node)])
        async with reader:
            async for batch in reader.batches():
                for rec in batch:
                    self.commands.append(rec.event)
                    await self._on_command(rec.event)

    async def status(self, cmd: events.Command, phase: events.ShardPhase, **kw: Any) -> None:
        await self.publish(
            events.ShardStatus(
                id=self._id(phase),
                ts=time.time(),
                node=self.node,
                replica_id=cmd.replica_id,
                generation=cmd.generation,
                shard=cmd.shard,
                phase=phase,
                **kw,
            )
        )

    async def _on_command(self, cmd: events.Event) -> None:
        match cmd:
            case events.StartShard():
                key = (cmd.replica_id, cmd.shard)
                if self.running.get(key) == cmd.generation:
                    return  # already running this generation: idempotent
                self.running[key] = cmd.generation
                await self.status(cmd, "starting")
                await self.status(cmd, "loading")
                task = asyncio.create_task(self._serve_later(cmd))
                self._tasks.append(task)
            case events.DrainShard():
                if self.running.get((cmd.replica_id, cmd.shard)) == cmd.generation:
                    await self.status(cmd, "draining")
            case events.StopShard():
                if self.running.pop((cmd.replica_id, cmd.shard), None) is not None:
                    await self.status(cmd, "stopped")

    async def _serve_later(self, cmd: events.StartShard) -> None:
        await asyncio.sleep(self.serve_after_s)
        if self.running.get((cmd.replica_id, cmd.shard)) == cmd.generation:
            with contextlib.suppress(Exception):  # the agent may be closing
                await self.status(cmd, "serving", endpoint=f"http://127.0.0.1:{cmd.launch.port}")

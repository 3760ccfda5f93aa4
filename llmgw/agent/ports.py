"""What an agent is built on: where its reports go, where its commands come from, and
the leader lease that bounds the epochs it obeys, as ports.

`AgentService(cfg, ports=...)` runs its command handling against any implementation;
without `ports` it connects to NATS as its node and builds the JetStream ones here
(`connect_jetstream`), which is the production wiring and only routes each call to the
code that has always done it. Tests of the agent's logic pass the in-memory ones
(`memory_ports`, over `llmgw.bus.memory`) and run in milliseconds.

- `Reports`: an append of the node's events (registration, shard status, heartbeats
  with a TTL), deduplicated by event id; `connected` says whether to try now, and
  `reconnects` counts the connection's reconnects (each one queues a registration).
- `Commands`: a reader of `llmgw.cmd.<node>` after a sequence, yielding (seq, command)
  records in order. Acknowledgement is the agent's own: it records in its ledger the
  sequence up to which every command's effect is kept, and the next reader starts
  after it (the durable consumer `cmd-<node>` is bound to that start).
- `LeaseView`: the live, trusted leader lease's holder and epoch (None when no leader
  holds it, or when what is stored is not signed by the control plane).
"""

from __future__ import annotations

import math
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import nats.js.errors

from llmgw import bus, logs
from llmgw.agent import ledger
from llmgw.bus import keys as bus_keys
from llmgw.bus import lease as bus_lease
from llmgw.bus.lease import Holder
from llmgw.bus.memory import MemoryLease, MemoryLog
from llmgw.bus.settings import NatsConnection
from llmgw.core import events, subjects
from llmgw.pki import authorization
from llmgw.pki.identity import Identity

log = logs.get("llmgw.agent.service")


class Reports(Protocol):
    """Where the node's events go."""

    @property
    def connected(self) -> bool: ...

    @property
    def reconnects(self) -> int: ...

    async def append(self, event: events.Event, *, ttl_s: float | None = None) -> bus.Published:
        """Store `event` on its own subject; raises PublishError when it was not stored."""
        ...


class CommandReader(Protocol):
    """The records of `llmgw.cmd.<node>` after a sequence, then every later one."""

    undecodable: int

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def batches(self) -> AsyncIterator[list[bus.Record]]: ...


class Commands(Protocol):
    """Where the node's commands come from."""

    def reader(self, after_seq: int) -> CommandReader: ...


class LeaseView(Protocol):
    """The leader lease as an agent reads it (`LeasePort.holder`)."""

    async def holder(self) -> Holder | None:
        """The live, trusted holder; None when there is none. Raises when unreadable."""
        ...


@dataclass(frozen=True)
class AgentPorts:
    """The reports an agent appends, the commands it reads, and the lease it checks."""

    reports: Reports
    commands: Commands
    lease: LeaseView


# ---------------------------------------------------------------------- JetStream


class JetStreamReports:
    """`Reports` on the agent's connection: `Publisher` as the agent has always used it."""

    def __init__(self, nc: bus.BusClient) -> None:
        self.nc = nc
        self.publisher = bus.Publisher(nc.jetstream(), timeout_s=2.0, attempts=2)

    @property
    def connected(self) -> bool:
        return bool(self.nc.is_connected)

    @property
    def reconnects(self) -> int:
        return int(self.nc.stats["reconnects"])

    async def append(self, event: events.Event, *, ttl_s: float | None = None) -> bus.Published:
        return await self.publisher.publish(event, ttl_s=ttl_s)


class JetStreamCommands:
    """`Commands` through the node's durable consumer `cmd-<node>`."""

    def __init__(self, nc: bus.BusClient, node: str) -> None:
        self.nc = nc
        self.node = node

    def reader(self, after_seq: int) -> bus.Reader:
        return bus.Reader(
            self.nc,
            after_seq=after_seq,
            subjects_filter=[subjects.command(self.node)],
            consumer_name=authorization.command_consumer(self.node),
            name=f"agent-{self.node}",
        )


class JetStreamLeaseView:
    """`LeaseView` over the lease bucket's stream: the last entry of the key `leader`,
    trusted only when its control plane signed it."""

    def __init__(self, nc: bus.BusClient) -> None:
        self.nc = nc

    async def holder(self) -> Holder | None:
        stream = f"KV_{bus.LEASE_BUCKET}"
        try:
            msg = await self.nc.jetstream().get_last_msg(stream, f"$KV.{bus.LEASE_BUCKET}.leader")
        except nats.js.errors.NotFoundError:
            return None  # no leader now (expired or released)
        seq = msg.seq or 0
        epoch = ledger.lease_epoch(seq, msg.data, msg.headers)
        if epoch is None:
            return None
        # Only a value its control plane signed shows an epoch (a forged one raises none).
        verifier = bus_keys.verifier_of(self.nc)
        checked = (
            "no verifier"
            if verifier is None
            else bus_lease.verified_value(verifier, msg.data or b"", time.time(), math.inf)
        )
        if isinstance(checked, str):
            log.warning("lease_refused", seq=msg.seq, why=checked)
            return None
        return Holder(checked.holder, epoch, seq)


async def connect_jetstream(
    node: str,
    nats_cfg: NatsConnection,
    tls: ssl.SSLContext,
    backoff: tuple[float, float] | None,
) -> tuple[bus.BusClient, AgentPorts]:
    """Connect as this node (mutual TLS, reconnecting forever) and bind the ports to it."""
    nc = await bus.connect(
        list(nats_cfg.servers),
        tls=tls,
        identity=Identity("node", node),
        name=f"agent-{node}",
        keys=nats_cfg.keys(),
    )
    if backoff is not None:
        nc.backoff_base, nc.backoff_cap = backoff
    ports = AgentPorts(
        reports=JetStreamReports(nc),
        commands=JetStreamCommands(nc, node),
        lease=JetStreamLeaseView(nc),
    )
    return nc, ports


# ---------------------------------------------------------------------- in memory


class MemoryReports:
    """`Reports` appended to a `MemoryLog`; `connected` and `reconnects` are set by a test."""

    def __init__(self, log: MemoryLog) -> None:
        self.log = log
        self.reconnects = 0

    @property
    def connected(self) -> bool:
        return self.log.connected

    async def append(self, event: events.Event, *, ttl_s: float | None = None) -> bus.Published:
        if not self.log.connected:
            raise bus.PublishError(f"{event.id}: the log is unreachable")
        return await self.log.append(event, ttl_s=ttl_s)


class MemoryCommands:
    """`Commands`: what is appended to `llmgw.cmd.<node>` in a `MemoryLog`."""

    def __init__(self, log: MemoryLog, node: str) -> None:
        self.log = log
        self.node = node

    def reader(self, after_seq: int) -> CommandReader:
        return self.log.reader(
            after_seq=after_seq,
            subjects_filter=[subjects.command(self.node)],
            name=f"agent-{self.node}",
        )


def memory_ports(log: MemoryLog, node: str, lease: LeaseView) -> AgentPorts:
    """In-memory ports for `node`: reports and commands in `log`, the lease `lease` (a
    `MemoryLease`, or anything with `holder()`)."""
    return AgentPorts(reports=MemoryReports(log), commands=MemoryCommands(log, node), lease=lease)


def _conforms(
    nc: bus.BusClient, log: MemoryLog, lease: bus_lease.Lease, memory_lease: MemoryLease
) -> None:
    """Type-checked only: both sides satisfy every port."""
    _r: Reports = JetStreamReports(nc)
    _c: Commands = JetStreamCommands(nc, "n")
    _l: LeaseView = JetStreamLeaseView(nc)
    _mr: Reports = MemoryReports(log)
    _mc: Commands = MemoryCommands(log, "n")
    _jl: LeaseView = lease
    _ml: LeaseView = memory_lease
    del _r, _c, _l, _mr, _mc, _jl, _ml

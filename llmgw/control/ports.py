"""What a control plane is built on: the event log, snapshots and the lease, as ports.

`ControlService(cfg, ports=...)` runs its logic against any implementation of
llmgw.bus.ports; without `ports` it connects to NATS and builds the JetStream ones
here (`connect`, then `open_jetstream`), which is the production wiring. Tests of the
control plane's logic pass in-memory ports (llmgw.bus.memory) and run in milliseconds.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmgw import bus
from llmgw.bus.jetstream import JetStreamLog
from llmgw.bus.ports import EventLog, LeasePort, SnapshotPort
from llmgw.control.config import ControlConfig
from llmgw.pki.identity import Identity


@dataclass(frozen=True)
class ControlPorts:
    """The log a control plane folds and writes, where it keeps snapshots, and its lease."""

    log: EventLog
    snapshots: SnapshotPort
    lease: LeasePort


async def connect(cfg: ControlConfig, tls: ssl.SSLContext) -> bus.BusClient:
    """The control plane's connection: its own identity, its keys to sign and verify."""
    n = cfg.nats
    return await bus.connect(
        list(n.servers),
        tls=tls,
        identity=Identity("control", cfg.name),
        name=f"control-{cfg.name}",
        keys=n.keys(),
    )


async def open_jetstream(
    cfg: ControlConfig, nc: bus.BusClient, clock: Callable[[], float] = time.time
) -> ControlPorts:
    """Provision the log (the control identity may) and bind the ports to it; the lease
    judges time by `clock` (the control plane's: the server's time)."""
    n = cfg.nats
    js = nc.jetstream()
    await bus.provision(js, replicas=n.stream_replicas, duplicate_window_s=n.duplicate_window_s)
    return ControlPorts(
        log=JetStreamLog(nc),
        snapshots=await bus.SnapshotStore.open(js, keep=cfg.snapshot.keep),
        lease=await bus.Lease.open(js, cfg.name, ttl_s=cfg.lease_ttl_s, clock=clock),
    )

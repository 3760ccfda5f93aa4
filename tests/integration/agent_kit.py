"""Helpers for the agent-service tests: configs, a stand-in control plane, reading the log back.

The control plane is played by the test itself: it connects as a `control`
identity, provisions the stream, and publishes StartShard / StopShard /
DrainShard on `llmgw.cmd.<node>`. Everything is real: nats-server from the
harness, `llmgw sim` engines as subprocesses, and (where it matters) the agent
as a `llmgw agent` subprocess.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec
import yaml
from nats.aio.client import Client

from llmgw import bus, pidfiles, processes
from llmgw.agent import config as agent_config
from llmgw.bus import lease as bus_lease
from llmgw.core import events, subjects
from llmgw.core.profile import LaunchSpec
from llmgw.pki.identity import Identity
from tests.harness import TestNatsServer
from tests.kit.processes import Proc
from tests.kit.processes import pid_alive as pid_alive  # the agent tests read it from here

REPO = Path(__file__).resolve().parents[2]


def agent_settings(
    server: TestNatsServer, node: str, state_dir: Path, **over: Any
) -> dict[str, Any]:
    """The YAML mapping of an agent config for `node` against the harness server."""
    certs = server.pki.certs
    identity = Identity("node", node)
    server.pki.client_tls("node", node)  # issues the certificate and reloads the server
    settings: dict[str, Any] = {
        "node_id": node,
        "address": "127.0.0.1",
        "nats": {
            "servers": [server.url],
            "ca_file": str(certs.ca_cert),
            "cert_file": str(certs.cert(identity)),
            "key_file": str(certs.key(identity)),
        },
        "state_dir": str(state_dir),
        "sim_gpus": "8xh100-80g",
        "engine_host": "127.0.0.1",
        "engine_ports": {"first": 1024, "last": 65535},
        "heartbeat_s": 0.5,
        "heartbeat_ttl_s": 60,
        "engine_poll_s": 0.1,
        "stop_grace_s": 5,
    }
    settings.update(over)
    return settings


def agent_cfg(server: TestNatsServer, node: str, state_dir: Path, **over: Any) -> Any:
    raw = msgspec.convert(agent_settings(server, node, state_dir, **over), agent_config.AgentConfig)
    return agent_config.complete(raw)


def write_config(path: Path, settings: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(settings))
    return path


def sim_spec(port: int, gpus: tuple[int, ...] = (0,), name: str = "m", **over: Any) -> LaunchSpec:
    return LaunchSpec(
        engine=over.pop("engine", "sim"),
        model=over.pop("model", name),
        served_name=name,
        port=port,
        gpus=gpus,
        start_timeout_s=over.pop("start_timeout_s", 30.0),
        load_timeout_s=over.pop("load_timeout_s", 30.0),
        **over,
    )


class Control:
    """The test playing the control-plane leader: provisions the stream, sends commands."""

    LEASE_EPOCH = 1000
    """The epoch the leader lease shows: agents refuse commands from beyond it."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.publisher = bus.Publisher(self.js)
        self.epoch = 1

    async def provision(self) -> None:
        await bus.provision(self.js)
        await self.hold_lease(self.LEASE_EPOCH)

    async def hold_lease(self, epoch: int) -> None:
        """Write the leader lease as a holder of `epoch` renewing it would."""
        kv = await self.js.key_value(bus.LEASE_BUCKET)
        signer = self.publisher.signer  # signed as this control identity, as a holder signs
        value = bus_lease.signed_value(signer, signer.identity.name, epoch, time.time() + 3600)
        await kv.put("leader", value)

    async def send(self, cmd: events.Command) -> bus.Published:
        return await self.publisher.publish(cmd)

    async def start(
        self, node: str, replica_id: str, spec: LaunchSpec, *, generation: int = 1, **kw: Any
    ) -> events.StartShard:
        cmd = events.StartShard(
            id=kw.pop("id", uuid.uuid4().hex),
            ts=time.time(),
            epoch=kw.pop("epoch", self.epoch),
            node=node,
            replica_id=replica_id,
            generation=generation,
            launch=spec,
            **kw,
        )
        await self.send(cmd)
        return cmd

    async def stop(
        self, node: str, replica_id: str, *, generation: int = 1, **kw: Any
    ) -> events.StopShard:
        cmd = events.StopShard(
            id=kw.pop("id", uuid.uuid4().hex),
            ts=time.time(),
            epoch=kw.pop("epoch", self.epoch),
            node=node,
            replica_id=replica_id,
            generation=generation,
            grace_s=kw.pop("grace_s", 5.0),
            **kw,
        )
        await self.send(cmd)
        return cmd

    async def drain(self, node: str, replica_id: str, *, generation: int = 1) -> None:
        await self.send(
            events.DrainShard(
                id=uuid.uuid4().hex,
                ts=time.time(),
                epoch=self.epoch,
                node=node,
                replica_id=replica_id,
                generation=generation,
            )
        )


async def node_records(nc: Client, node: str) -> list[bus.Record]:
    """Every event the node has in the log now (heartbeats included), in stream order."""
    async with bus.Reader(
        nc, subjects_filter=[subjects.node_events(node)], follow=False, heartbeat_s=0.5
    ) as reader:
        out: list[bus.Record] = []
        async for batch in reader.batches():
            out.extend(batch)
        return out


def without_heartbeats(records: Iterable[bus.Record]) -> list[events.AnyEvent]:
    return [r.event for r in records if not isinstance(r.event, events.Heartbeat)]


async def wait_for(
    nc: Client,
    node: str,
    match: Callable[[events.AnyEvent], bool],
    *,
    within: float = 30.0,
    what: str = "an event",
) -> events.AnyEvent:
    """Poll the log until an event of `node` matches; return the first match."""
    deadline = time.monotonic() + within
    while True:
        records = await node_records(nc, node)
        for r in records:
            if match(r.event):
                return r.event
        if time.monotonic() > deadline:
            seen = [_short(r.event) for r in records if not isinstance(r.event, events.Heartbeat)]
            raise AssertionError(f"no {what} from {node} within {within} s; saw {seen}")
        await asyncio.sleep(0.1)


def status(replica_id: str, phase: str, generation: int | None = None) -> Callable[[Any], bool]:
    def match(ev: Any) -> bool:
        return (
            isinstance(ev, events.ShardStatus)
            and ev.replica_id == replica_id
            and ev.phase == phase
            and (generation is None or ev.generation == generation)
        )

    return match


def statuses(evs: Iterable[events.AnyEvent], replica_id: str) -> list[tuple[int, str]]:
    return [
        (e.generation, e.phase)
        for e in evs
        if isinstance(e, events.ShardStatus) and e.replica_id == replica_id
    ]


def phases(evs: Iterable[events.AnyEvent], replica_id: str) -> list[tuple[int, str]]:
    """`statuses` without loading: the sim may answer /v1/models at the first probe."""
    return [p for p in statuses(evs, replica_id) if p[1] != "loading"]


def _short(ev: events.AnyEvent) -> str:
    if isinstance(ev, events.ShardStatus):
        return f"{ev.replica_id}/g{ev.generation}:{ev.phase}:{ev.error[:80]}"
    return events.tag_of(type(ev))


def kill_engines(state_dir: Path) -> None:
    """Tests end with no engine left: engines outlive the agent by design."""
    for _, record in pidfiles.load_all(state_dir):
        if record is not None and record.pgid > 0 and processes.group_members(record.pgid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(record.pgid, signal.SIGKILL)


class AgentProcess(Proc):
    """`llmgw agent --config FILE` as a real subprocess."""

    def __init__(self, config_path: Path, log_path: Path) -> None:
        super().__init__(None, log_path)
        self.config_path = config_path

    def start(self, wait_started: bool = True) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 (handed to the child)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llmgw", "agent", "--config", str(self.config_path)],
            stdout=subprocess.PIPE,
            stderr=log,
            cwd=REPO,
        )
        log.close()
        if wait_started:
            assert self.proc.stdout is not None
            line = self.proc.stdout.readline().decode()
            assert line.startswith("llmgw agent "), (line, self.log_tail())
            assert "started" in line, (line, self.log_tail())

    def kill9(self) -> None:
        assert self.proc is not None
        self.kill()

    def terminate(self) -> int:
        """SIGTERM; its exit code (SIGKILL after 15 s)."""
        code = self.stop(15)
        return 0 if code is None else code


def new_agent(
    server: TestNatsServer, node: str, tmp_path: Path, state_dir: Path, agents: list[AgentProcess]
) -> AgentProcess:
    """`node`'s agent with the test's settings, not started (terminated after the test:
    `agents` is the test's list)."""
    config = write_config(tmp_path / "agent.yaml", agent_settings(server, node, state_dir))
    agent = AgentProcess(config, tmp_path / "agent.log")
    agents.append(agent)
    return agent


async def start_agent(
    server: TestNatsServer, node: str, tmp_path: Path, state_dir: Path, agents: list[AgentProcess]
) -> AgentProcess:
    """`new_agent`, started."""
    agent = new_agent(server, node, tmp_path, state_dir, agents)
    await asyncio.to_thread(agent.start)
    return agent

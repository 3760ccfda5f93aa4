"""The agent's command handling on in-memory ports (llmgw.agent.ports): no nats-server.

The same `AgentService` as production, constructed with `memory_ports`: its reports
are appended to a `MemoryLog`, its commands are what the test appends to
`llmgw.cmd.<node>` there, and the leader lease is a `MemoryLease` on a `LeaseBucket`
the test writes as a leader would. Starts the node must refuse need no engine; the one
start that serves runs the `sim` engine as the real process it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from llmgw import bus
from llmgw.agent import config as agent_config
from llmgw.agent.ports import MemoryCommands, MemoryReports, memory_ports
from llmgw.agent.service import AgentService
from llmgw.bus.memory import LeaseBucket, MemoryLease, MemoryLog, subject_matches
from llmgw.core import events, subjects
from llmgw.core.profile import LaunchSpec
from llmgw.natsd import free_port
from tests.integration import agent_kit as kit

NODE = "node-a"
DEADLINE_S = 20.0
"""Generous: a loaded machine may be slow; the refusals take milliseconds."""
LEASE_EPOCH = 5


class Clock:
    """The log's clock: real time plus what a test skips ahead."""

    def __init__(self) -> None:
        self.skipped = 0.0

    def __call__(self) -> float:
        return time.time() + self.skipped


class Node:
    """An agent running on memory ports, and the log and lease it sees."""

    def __init__(self, svc: AgentService, log: MemoryLog, bucket: LeaseBucket) -> None:
        self.svc = svc
        self.log = log
        self.bucket = bucket
        self.epoch = LEASE_EPOCH

    async def send(self, cmd: events.Command) -> bus.Published:
        return await self.log.append(cmd)

    async def start(self, replica_id: str, spec: LaunchSpec, **kw: Any) -> events.StartShard:
        cmd = events.StartShard(
            id=kw.pop("id", uuid.uuid4().hex),
            ts=time.time(),
            epoch=kw.pop("epoch", self.epoch),
            node=NODE,
            replica_id=replica_id,
            generation=kw.pop("generation", 1),
            launch=spec,
        )
        await self.send(cmd)
        return cmd

    def reports(self) -> list[bus.Record]:
        mine = subjects.node_events(NODE)
        return [r for r in self.log.records() if subject_matches(r.subject, mine)]

    def statuses(self, replica_id: str) -> list[events.ShardStatus]:
        return [
            r.event
            for r in self.reports()
            if isinstance(r.event, events.ShardStatus) and r.event.replica_id == replica_id
        ]


def refused_spec(name: str = "m") -> LaunchSpec:
    """A start this node must refuse: it has GPUs 0-7, not 9."""
    return kit.sim_spec(free_port(), gpus=(9,), name=name)


def agent_cfg(state_dir: Path, **over: Any) -> agent_config.AgentConfig:
    settings: dict[str, Any] = {
        "node_id": NODE,
        "address": "127.0.0.1",
        "state_dir": str(state_dir),
        "sim_gpus": "8xh100-80g",
        "engine_host": "127.0.0.1",
        "engine_ports": {"first": 1024, "last": 65535},
        "heartbeat_s": 0.05,
        "heartbeat_ttl_s": 10,
        "engine_poll_s": 0.05,
        "stop_grace_s": 5,
    }
    settings.update(over)
    return agent_config.complete(msgspec.convert(settings, agent_config.AgentConfig))


@contextlib.asynccontextmanager
async def running(
    state_dir: Path, log: MemoryLog | None = None, bucket: LeaseBucket | None = None
) -> AsyncIterator[Node]:
    log = log if log is not None else MemoryLog(clock=Clock())
    if bucket is None:
        bucket = LeaseBucket()
        bucket.write("control-a", LEASE_EPOCH, 3600)
    ports = memory_ports(log, NODE, MemoryLease(bucket, f"agent-{NODE}"))
    svc = AgentService(agent_cfg(state_dir), ports=ports)
    stop = asyncio.Event()
    task = asyncio.create_task(svc.run(stop))
    try:
        await until(lambda: svc.started.is_set() or task.done(), "the agent's start")
        if task.done():
            task.result()
        yield Node(svc, log, bucket)
    finally:
        stop.set()
        await asyncio.wait_for(task, DEADLINE_S)
        kit.kill_engines(state_dir)


async def until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def test_registration_and_heartbeats_with_a_ttl_go_on_the_nodes_own_subjects(
    tmp_path: Path,
) -> None:
    clock = Clock()
    log = MemoryLog(clock=clock)
    async with running(tmp_path, log) as node:

        def heartbeats() -> list[bus.Record]:
            return [r for r in log.records() if isinstance(r.event, events.Heartbeat)]

        await until(lambda: len(heartbeats()) >= 2, "two heartbeats")
        (reg,) = [r for r in log.records() if isinstance(r.event, events.NodeRegistered)]
        assert reg.subject == subjects.node_event(NODE, "registered")
        assert isinstance(reg.event, events.NodeRegistered)
        assert reg.event.node == NODE
        assert len(reg.event.gpus) == 8
        assert {r.subject for r in heartbeats()} == {subjects.node_event(NODE, "heartbeat")}
        assert len(node.reports()) == len(log.records())  # nothing off the node's subjects
        seen = [r.seq for r in heartbeats()]
        # Past the configured heartbeat TTL (10 s; the log's default is 120 s) the
        # heartbeats then stored expire; the rest stays.
        clock.skipped = 11.0
        left = {r.seq for r in log.records()}
        assert reg.seq in left
        assert not left & set(seen)
        assert node.svc.heartbeats_sent >= 2


async def test_a_start_yields_its_shard_statuses_and_a_stop_ends_it(tmp_path: Path) -> None:
    async with running(tmp_path) as node:
        await node.start("rep-1", kit.sim_spec(free_port(), name="llama"))
        await until(
            lambda: any(s.phase == "serving" for s in node.statuses("rep-1")), "rep-1 serving"
        )
        await node.send(
            events.StopShard(
                id="stop-1",
                ts=time.time(),
                epoch=LEASE_EPOCH,
                node=NODE,
                replica_id="rep-1",
                generation=1,
                reason="test over",
            )
        )
        await until(
            lambda: any(s.phase == "stopped" for s in node.statuses("rep-1")), "rep-1 stopped"
        )
        phases = [(s.generation, s.phase) for s in node.statuses("rep-1") if s.phase != "loading"]
        assert phases == [(1, "starting"), (1, "serving"), (1, "stopped")]
        assert node.statuses("rep-1")[-1].error == "test over"
        # Every command's effect is recorded: the next run reads after the stop.
        commands = [r.seq for r in node.log.after(0, [subjects.command(NODE)])]
        await until(lambda: node.svc.ledger.last_seq == commands[-1], "the ledger's sequence")


async def test_a_refused_start_reports_failed_with_the_reason(tmp_path: Path) -> None:
    async with running(tmp_path) as node:
        await node.start("rep-x", refused_spec())
        await until(lambda: bool(node.statuses("rep-x")), "rep-x's status")
        (failed,) = node.statuses("rep-x")
        assert failed.phase == "failed"
        assert failed.error.startswith(f"node {NODE} refused the shard")


async def test_a_redelivered_command_is_applied_once(tmp_path: Path) -> None:
    async with running(tmp_path) as node:
        first = await node.start("rep-x", refused_spec())
        # A re-send with a new id: what a redelivery past the duplicate window looks like.
        again = msgspec.structs.replace(first, id="redelivered")
        await node.send(again)
        await node.start("marker", refused_spec("marker"))
        await until(lambda: bool(node.statuses("marker")), "the marker's status")
        assert len(node.statuses("rep-x")) == 1
    # A restart on the same state reads after what it recorded: nothing runs twice.
    async with running(tmp_path, node.log, node.bucket) as again_node:
        await again_node.start("marker-2", refused_spec("marker-2"))
        await until(lambda: bool(again_node.statuses("marker-2")), "the second marker")
        assert len(again_node.statuses("rep-x")) == 1
        assert len(again_node.statuses("marker")) == 1


async def test_a_command_from_a_deposed_leaders_epoch_is_ignored(tmp_path: Path) -> None:
    async with running(tmp_path) as node:
        await node.start("rep-a", refused_spec(), epoch=4)
        await until(lambda: bool(node.statuses("rep-a")), "rep-a's status")
        await node.start("rep-old", refused_spec(), epoch=3)
        await node.start("marker", refused_spec("marker"), epoch=4)
        await until(lambda: bool(node.statuses("marker")), "the marker's status")
        assert node.statuses("rep-old") == []
        assert node.svc.ledger.epoch == 4


async def test_a_command_beyond_the_lease_is_refused_until_a_leader_shows_its_epoch(
    tmp_path: Path,
) -> None:
    async with running(tmp_path) as node:
        await node.start("rep-far", refused_spec(), epoch=LEASE_EPOCH + 4)
        await until(lambda: node.svc.lease.refused == 1, "the refusal")
        await node.start("marker", refused_spec("marker"))
        await until(lambda: bool(node.statuses("marker")), "the marker's status")
        assert node.statuses("rep-far") == []
        assert node.svc.ledger.epoch == LEASE_EPOCH  # the refused epoch raised nothing
        # A new leader of that epoch writes the lease: its commands are obeyed.
        node.bucket.write("control-b", LEASE_EPOCH + 4, 3600)
        await node.start("rep-new", refused_spec("new"), epoch=LEASE_EPOCH + 4)
        await until(lambda: bool(node.statuses("rep-new")), "rep-new's status")
        assert node.svc.lease.epoch == LEASE_EPOCH + 4
        assert node.svc.lease.refused == 1


async def test_reports_wait_while_the_log_is_unreachable(tmp_path: Path) -> None:
    log = MemoryLog(clock=Clock())
    log.connected = False
    async with running(tmp_path, log) as node:
        await node.start("rep-x", refused_spec())
        await until(lambda: len(node.svc.outbox or []) >= 2, "the registration and status queued")
        assert node.reports() == []
        log.connected = True
        await until(lambda: not len(node.svc.outbox or []), "the outbox drained")
        kinds = [type(r.event) for r in node.reports() if not isinstance(r.event, events.Heartbeat)]
        assert kinds == [events.NodeRegistered, events.ShardStatus]


async def test_the_memory_ports_read_the_nodes_commands_and_refuse_reports_offline() -> None:
    log = MemoryLog()
    spec = refused_spec()
    for i, node in enumerate([NODE, "node-b", NODE]):
        await log.append(
            events.StartShard(
                id=f"c{i}",
                ts=1.0,
                epoch=1,
                node=node,
                replica_id=f"r{i}",
                generation=1,
                launch=spec,
            )
        )
    reader = MemoryCommands(log, NODE).reader(1)
    await reader.start()
    batch = await anext(aiter(reader.batches()))
    await reader.close()
    assert [(r.seq, r.event.id) for r in batch] == [(3, "c2")]  # after seq 1, its own only
    reports = MemoryReports(log)
    log.connected = False
    hb = events.Heartbeat(id="hb", ts=1.0, node=NODE, seq=1)
    with pytest.raises(bus.PublishError):
        await reports.append(hb, ttl_s=10)
    assert not reports.connected

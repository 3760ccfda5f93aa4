"""The agent as a real `llmgw agent --config FILE` subprocess: kill -9, restart, adoption,
commands sent while it was away, and a NATS server that is down when it starts."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from llmgw import processes
from llmgw.core import events
from llmgw.natsd import free_port
from tests.harness import Connector, TestNatsServer, wait_for
from tests.integration import agent_kit as kit
from tests.integration.agent_kit import AgentProcess, Control, status

pytestmark = pytest.mark.slow

NODE = "node-p"


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "agent-state"
    yield path
    kit.kill_engines(path)


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[list[AgentProcess]]:
    started: list[AgentProcess] = []
    yield started
    for agent in started:
        agent.terminate()


def engines_on_port(port: int) -> list[int]:
    """Pids of every process whose command line asks for `--port PORT`."""
    found = []
    for entry in processes.PROC.iterdir():
        if not entry.name.isdigit():
            continue
        argv = processes.cmdline(int(entry.name))
        if argv and "--port" in argv:
            i = argv.index("--port")
            if i + 1 < len(argv) and argv[i + 1] == str(port):
                found.append(int(entry.name))
    return found


async def models(port: int, api_key: str) -> list[str]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http,
        http.get(
            f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {api_key}"}
        ) as resp,
    ):
        return [m["id"] for m in (await resp.json())["data"]]


async def test_kill9_restart_adopts_and_runs_what_was_sent_meanwhile(
    nats_server: TestNatsServer,
    connect: Connector,
    tmp_path: Path,
    state_dir: Path,
    agents: list[AgentProcess],
) -> None:
    control = Control(await connect("control", "control-1"))
    await control.provision()
    admin = await connect.admin()
    agent = await kit.start_agent(nats_server, NODE, tmp_path, state_dir, agents)
    await kit.wait_for(admin, NODE, lambda e: isinstance(e, events.NodeRegistered))

    port = free_port()
    await control.start(NODE, "rep-1", kit.sim_spec(port, gpus=(0,), name="one"))
    serving = await kit.wait_for(admin, NODE, status("rep-1", "serving"), what="serving")
    assert isinstance(serving, events.ShardStatus)
    engine_pid, key = serving.pid, serving.api_key
    assert engine_pid is not None
    assert engines_on_port(port) == [engine_pid]

    agent.kill9()
    # Serving survives the agent.
    assert await models(port, key) == ["one"]
    # A command sent while the agent is away waits in the stream for it.
    port2 = free_port()
    await control.start(NODE, "rep-2", kit.sim_spec(port2, gpus=(1,), name="two"))
    before = len(await kit.node_records(admin, NODE))

    await asyncio.to_thread(agent.start)
    # It registers again, with the engine it adopted...
    reg = await kit.wait_for(
        admin,
        NODE,
        lambda e: (
            isinstance(e, events.NodeRegistered) and any(s.replica_id == "rep-1" for s in e.shards)
        ),
        what="a registration listing rep-1",
    )
    assert isinstance(reg, events.NodeRegistered)
    (shard,) = [s for s in reg.shards if s.replica_id == "rep-1"]
    assert shard.phase == "serving"
    assert shard.endpoint == f"http://127.0.0.1:{port}"
    assert shard.gpus == (0,)
    # ...and runs the command it missed.
    serving2 = await kit.wait_for(admin, NODE, status("rep-2", "serving"), what="rep-2 serving")
    assert isinstance(serving2, events.ShardStatus)
    key2 = serving2.api_key
    assert key2 not in ("", key)
    assert await models(port2, key2) == ["two"]

    # Adopted, not started again: the same single engine process serves rep-1.
    assert engines_on_port(port) == [engine_pid]
    after = (await kit.node_records(admin, NODE))[before:]
    rep1 = [
        r.event
        for r in after
        if isinstance(r.event, events.ShardStatus) and r.event.replica_id == "rep-1"
    ]
    # The adopting agent reports the key it found in the pid file.
    assert [(e.phase, e.pid, e.api_key) for e in rep1] == [("serving", engine_pid, key)]
    assert await models(port, key) == ["one"]

    # The StartShard of rep-1 is not re-applied by a third run either (ledger + adoption),
    # and a plain SIGTERM leaves both engines serving.
    assert agent.terminate() == 0
    assert await models(port, key) == ["one"]
    assert await models(port2, key2) == ["two"]
    await asyncio.to_thread(agent.start)
    await control.stop(NODE, "rep-2")
    await kit.wait_for(admin, NODE, status("rep-2", "stopped"))
    assert engines_on_port(port2) == []
    assert engines_on_port(port) == [engine_pid]
    log_text = (tmp_path / "agent.log").read_text()
    assert "engine_spawned" in log_text
    # No agent log line carries a key.
    assert key not in log_text
    assert key2 not in log_text


async def test_nats_down_at_start_the_agent_waits_then_registers(
    nats_server: TestNatsServer,
    connect: Connector,
    tmp_path: Path,
    state_dir: Path,
    agents: list[AgentProcess],
) -> None:
    settings = kit.agent_settings(nats_server, NODE, state_dir)
    control = Control(await connect("control", "control-1"))
    await control.provision()
    nats_server.stop()
    agent = AgentProcess(kit.write_config(tmp_path / "agent.yaml", settings), tmp_path / "a.log")
    agents.append(agent)
    await asyncio.to_thread(agent.start)
    # Let it fail a few connection attempts (each is logged, none is fatal).
    deadline = time.monotonic() + 15
    while agent.log_tail(200).count("connect_failed") < 3:
        assert time.monotonic() < deadline, agent.log_tail()
        assert agent.proc is not None
        assert agent.proc.poll() is None, agent.log_tail()
        await asyncio.sleep(0.2)
    nats_server.start()
    admin = await connect.admin()
    with contextlib.suppress(Exception):
        await control.nc.flush(timeout=5)
    reg = await kit.wait_for(
        admin, NODE, lambda e: isinstance(e, events.NodeRegistered), within=30, what="registration"
    )
    assert isinstance(reg, events.NodeRegistered)
    assert len(reg.gpus) == 8
    await kit.wait_for(admin, NODE, lambda e: isinstance(e, events.Heartbeat), what="heartbeat")


async def test_events_queued_when_the_agent_is_killed_are_published_by_the_next_run(
    nats_server: TestNatsServer,
    connect: Connector,
    tmp_path: Path,
    state_dir: Path,
    agents: list[AgentProcess],
) -> None:
    control = Control(await connect("control", "control-1"))
    await control.provision()
    admin = await connect.admin()
    agent = await kit.start_agent(nats_server, NODE, tmp_path, state_dir, agents)
    await control.start(NODE, "rep-x", kit.sim_spec(free_port(), gpus=(2,)))
    serving = await kit.wait_for(admin, NODE, status("rep-x", "serving"))
    assert isinstance(serving, events.ShardStatus)
    assert serving.pid is not None

    # NATS goes away, the engine dies: its `failed` waits in the outbox on disk...
    nats_server.stop()
    processes.signal_group(serving.pid, 9)
    pending = state_dir / "outbox" / "pending.jsonl"
    deadline = time.monotonic() + 20
    while b'"phase":"failed"' not in (pending.read_bytes() if pending.exists() else b""):
        assert time.monotonic() < deadline, agent.log_tail()
        await asyncio.sleep(0.1)
    # ...and the agent is killed before it could publish it.
    agent.kill9()
    nats_server.start()
    await asyncio.to_thread(agent.start)
    failed = await kit.wait_for(admin, NODE, status("rep-x", "failed"), within=30)
    assert isinstance(failed, events.ShardStatus)
    assert "exited with code -9" in failed.error
    logged: list[events.AnyEvent] = []

    async def registered_again() -> bool:
        # The outbox's `failed` goes out first, the new run's registration a moment after.
        nonlocal logged
        logged = kit.without_heartbeats(await kit.node_records(admin, NODE))
        return isinstance(logged[-1], events.NodeRegistered)

    await wait_for(registered_again, 30, "the new run's registration after the failed status")
    ids = [e.id for e in logged]
    assert len(ids) == len(set(ids))
    assert kit.statuses(logged, "rep-x")[-1] == (1, "failed")
    # The failed status precedes the new run's registration, which lists no shard.
    last = logged[-1]
    assert isinstance(last, events.NodeRegistered)
    assert last.shards == ()


async def test_a_hangup_signal_leaves_the_agent_running(
    nats_server: TestNatsServer, tmp_path: Path, state_dir: Path, agents: list[AgentProcess]
) -> None:
    """SIGHUP (what `systemctl reload`, or habit, sends a daemon) ended the agent: it has
    nothing to reload, so it says so and runs on; SIGTERM still stops it."""
    agent = await kit.start_agent(nats_server, NODE, tmp_path, state_dir, agents)
    assert agent.proc is not None
    agent.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while "hangup_ignored" not in agent.log_tail(200):
        assert agent.proc.poll() is None, agent.log_tail()
        assert time.monotonic() < deadline, agent.log_tail()
        await asyncio.sleep(0.1)
    assert agent.proc.poll() is None
    assert agent.terminate() == 0

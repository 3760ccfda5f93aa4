"""What a node obeys: its own launch policy, and only epochs the leader lease could have had.

A real `llmgw agent` subprocess against a real nats-server; the test plays the
control plane (a `control` identity) and the leader lease (KV `llmgw-lease`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.agent import ledger
from llmgw.agent.service import AgentService
from llmgw.control.service import ControlService
from llmgw.core import events
from llmgw.natsd import free_port
from tests import harness
from tests.harness import Connector, TestNatsServer
from tests.integration import agent_kit as kit
from tests.integration import control_kit
from tests.integration.agent_kit import AgentProcess, Control, status
from tests.integration.ctl_kit import Ctl

pytestmark = pytest.mark.slow

NODE = "node-g"
FORGED = 10**12


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "agent-state"
    yield path
    kit.kill_engines(path)


@pytest.fixture
def agents() -> Iterator[list[AgentProcess]]:
    started: list[AgentProcess] = []
    yield started
    for agent in started:
        agent.terminate()


def write_ledger(state_dir: Path, content: dict[str, int]) -> None:
    state_dir.mkdir(parents=True)
    ledger.path_in(state_dir).write_text(json.dumps(content))


def saved_epoch(state_dir: Path) -> int:
    epoch: int = json.loads(ledger.path_in(state_dir).read_text())["epoch"]
    return epoch


async def test_a_launch_outside_the_node_policy_is_refused_and_reported_failed(
    nats_server: TestNatsServer,
    connect: Connector,
    tmp_path: Path,
    state_dir: Path,
    agents: list[AgentProcess],
) -> None:
    control = Control(await connect("control", "control-1"))
    await control.provision()
    admin = await connect.admin()
    agent = kit.new_agent(nats_server, NODE, tmp_path, state_dir, agents)
    await asyncio.to_thread(agent.start)

    port = free_port()
    env = {"LD_PRELOAD": "/tmp/evil.so", "LLMGW_SIM__SEED": "3"}
    await control.start(NODE, "rep-env", kit.sim_spec(port, env=env))
    failed = await kit.wait_for(admin, NODE, status("rep-env", "failed"), what="a refusal")
    assert isinstance(failed, events.ShardStatus)
    where = f"agent config {agent.config_path.resolve()}"
    assert (
        f"env LD_PRELOAD is not allowed by this node's launch.env_allow ({where}): "
        "add it there if this node should run it"
    ) in failed.error, failed.error

    args = ("--config", "/tmp/sim.yaml")
    await control.start(NODE, "rep-args", kit.sim_spec(port, gpus=(1,), engine_args=args))
    failed = await kit.wait_for(admin, NODE, status("rep-args", "failed"), what="a refusal")
    assert isinstance(failed, events.ShardStatus)
    assert (
        f"engine argument --config is not allowed by this node's launch.args_allow.sim ({where})"
        in (failed.error)
    )

    # Nothing was started for either, and the node still runs what its policy allows.
    evs = kit.without_heartbeats(await kit.node_records(admin, NODE))
    assert kit.statuses(evs, "rep-env") == [(1, "failed")]
    assert kit.statuses(evs, "rep-args") == [(1, "failed")]
    ok = kit.sim_spec(port, gpus=(2,), engine_args=("--decode-base-ms", "1"))
    await control.start(NODE, "rep-ok", ok)
    await kit.wait_for(admin, NODE, status("rep-ok", "serving"), what="serving")
    assert "shard_refused" in agent.log_tail(200)


async def test_an_epoch_beyond_the_lease_is_refused_and_blocks_nothing_across_a_restart(
    nats_server: TestNatsServer,
    connect: Connector,
    tmp_path: Path,
    state_dir: Path,
    agents: list[AgentProcess],
) -> None:
    control = Control(await connect("control", "control-1"))
    await control.provision()
    lease = Control.LEASE_EPOCH
    admin = await connect.admin()
    agent = kit.new_agent(nats_server, NODE, tmp_path, state_dir, agents)
    await asyncio.to_thread(agent.start)

    await control.start(NODE, "rep-b", kit.sim_spec(free_port()), epoch=lease)
    await kit.wait_for(admin, NODE, status("rep-b", "serving"), what="serving")

    # A forged stop from an epoch no leader had: refused. The leader's next command runs.
    await control.stop(NODE, "rep-b", epoch=FORGED)
    await control.stop(NODE, "marker-1", epoch=lease)
    await kit.wait_for(admin, NODE, status("marker-1", "stopped"), what="marker-1")

    # A new leader (a higher epoch than the agent has cached): re-read, then obeyed.
    await control.hold_lease(lease + 500)
    await control.stop(NODE, "marker-2", epoch=lease + 500)
    await kit.wait_for(admin, NODE, status("marker-2", "stopped"), what="marker-2")

    assert agent.terminate() == 0
    assert saved_epoch(state_dir) == lease + 500  # the forged epoch was never kept

    # While the agent is away: another forged stop, then the leader's command.
    await control.stop(NODE, "rep-b", epoch=FORGED)
    await control.stop(NODE, "marker-3", epoch=lease + 500)
    await asyncio.to_thread(agent.start)
    await kit.wait_for(admin, NODE, status("marker-3", "stopped"), what="marker-3")

    evs = kit.without_heartbeats(await kit.node_records(admin, NODE))
    # Never stopped: the adopted engine reports serving again, nothing else.
    assert {phase for _, phase in kit.phases(evs, "rep-b")} == {"starting", "serving"}
    reg = [e for e in evs if isinstance(e, events.NodeRegistered)][-1]
    assert [s.replica_id for s in reg.shards] == ["rep-b"]  # adopted, still serving
    log = agent.log_tail(400)
    assert log.count("command_refused") == 2, log
    assert f"from leader epoch {FORGED}, beyond the leader lease" in log
    assert agent.terminate() == 0
    assert saved_epoch(state_dir) == lease + 500


@pytest.mark.parametrize("garbage", [FORGED, 2**62])
async def test_an_epoch_on_disk_no_leader_had_is_dropped(
    nats_server: TestNatsServer,
    connect: Connector,
    tmp_path: Path,
    state_dir: Path,
    agents: list[AgentProcess],
    garbage: int,
) -> None:
    # What an agent before this check kept after obeying a forged command.
    write_ledger(state_dir, {"last_seq": 0, "epoch": garbage})
    control = Control(await connect("control", "control-1"))
    await control.provision()
    admin = await connect.admin()
    agent = kit.new_agent(nats_server, NODE, tmp_path, state_dir, agents)
    await asyncio.to_thread(agent.start)
    await control.stop(NODE, "marker", epoch=Control.LEASE_EPOCH)
    await kit.wait_for(admin, NODE, status("marker", "stopped"), what="the leader's command")
    assert agent.terminate() == 0
    assert saved_epoch(state_dir) == Control.LEASE_EPOCH
    log = agent.log_tail(200)
    assert ("ledger_garbage" in log) or ("ledger_epoch_beyond_lease" in log), log


async def test_ctl_replicas_shows_why_the_node_refused(
    nats_server: TestNatsServer, tmp_path: Path
) -> None:
    """Under the real control plane: the refusal reaches `llmgw ctl replicas`."""
    node = "node-r"
    state_dir = tmp_path / "agent"
    cfg = kit.agent_cfg(nats_server, node, state_dir)
    tls = await asyncio.to_thread(nats_server.pki.client_tls, "node", node)
    source = "/etc/llmgw/agent.yaml"
    svc = AgentService(cfg, tls=tls, reconnect_backoff=(0.05, 0.5), config_source=source)
    stop = asyncio.Event()
    task = asyncio.create_task(svc.run(stop))
    bad = control_kit.model("m-bad", replicas=1, env={"LD_PRELOAD": "/tmp/evil.so"})
    control_cfg = control_kit.control_config(nats_server, "control-1", models=(bad,))
    ctl = Ctl(nats_server)
    want = (
        "env LD_PRELOAD is not allowed by this node's launch.env_allow "
        f"(agent config {source}): add it there if this node should run it"
    )
    try:
        async with control_kit.running(ControlService(control_cfg)):

            async def shown() -> bool:
                result = await ctl.subprocess("replicas", "--model", "m-bad", "--json")
                replicas = result.json()
                errors = [s["error"] for r in replicas for s in r["shards"]]
                return any(want in e for e in errors)

            await harness.wait_for(shown, 60, "the refusal in ctl replicas", every_s=1.0)
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 30)
        kit.kill_engines(state_dir)
    assert svc.supervisor is not None
    assert svc.supervisor.views() == []  # nothing was ever started

"""The agent service in-process, against a real nats-server and real `llmgw sim` engines.

The test plays the control plane (commands published as the `control`
identity) and reads the node's events back from the log as the test admin.
The kill -9, down-at-start and command-while-away cases run the agent as a
subprocess: tests/integration/test_agent_service_process.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import nats.errors
import pytest

from llmgw import bus, processes
from llmgw.agent.service import AgentService
from llmgw.core import events, subjects
from llmgw.natsd import free_port
from tests.harness import Connector, TestNatsServer
from tests.harness import wait_for as harness_wait_for
from tests.integration import agent_kit as kit
from tests.integration.agent_kit import Control, status

pytestmark = pytest.mark.slow

NODE = "node-a"


class Running:
    """An AgentService running in this event loop, with every event it queued recorded."""

    def __init__(self, svc: AgentService, task: asyncio.Task[None], stop: asyncio.Event) -> None:
        self.svc = svc
        self.task = task
        self.stop_event = stop
        self.emitted: list[events.AnyEvent] = []

    async def stop(self) -> None:
        self.stop_event.set()
        await asyncio.wait_for(self.task, 30)


@pytest.fixture
async def control(connect: Connector) -> Control:
    ctl = Control(await connect("control", "control-1"))
    await ctl.provision()
    return ctl


@pytest.fixture
async def admin(connect: Connector) -> Any:
    return await connect.admin()


@pytest.fixture
async def start_agent(
    nats_server: TestNatsServer, tmp_path: Path
) -> AsyncIterator[Callable[..., Any]]:
    running: list[Running] = []
    states: list[Path] = []

    async def start(node: str = NODE, state: str = "state", **over: Any) -> Running:
        state_dir = tmp_path / f"{node}-{state}"
        states.append(state_dir)
        cfg = kit.agent_cfg(nats_server, node, state_dir, **over)
        tls = await asyncio.to_thread(nats_server.pki.client_tls, "node", node)
        svc = AgentService(cfg, tls=tls, reconnect_backoff=(0.05, 0.5))
        stop = asyncio.Event()
        run = Running(svc, asyncio.create_task(svc.run(stop)), stop)
        original = svc._emit

        def record(event: events.AnyEvent) -> None:
            run.emitted.append(event)
            original(event)

        svc._emit = record  # type: ignore[method-assign]
        running.append(run)
        waiter = asyncio.create_task(svc.connected_once.wait())
        await asyncio.wait([waiter, run.task], timeout=30, return_when=asyncio.FIRST_COMPLETED)
        if run.task.done():
            run.task.result()
        assert svc.connected_once.is_set()
        return run

    yield start
    for run in running:
        if not run.task.done():
            with contextlib.suppress(Exception):
                await run.stop()
    for state_dir in states:
        kit.kill_engines(state_dir)


async def get_models(endpoint: str, api_key: str) -> list[str]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http,
        http.get(f"{endpoint}/v1/models", headers={"Authorization": f"Bearer {api_key}"}) as resp,
    ):
        body = await resp.json()
        return [m["id"] for m in body["data"]]


async def test_start_serves_and_stop_ends_the_whole_group(
    start_agent: Any, control: Control, admin: Any
) -> None:
    agent = await start_agent()
    reg = await kit.wait_for(admin, NODE, lambda e: isinstance(e, events.NodeRegistered))
    assert isinstance(reg, events.NodeRegistered)
    assert len(reg.gpus) == 8
    assert reg.shards == ()

    port = free_port()
    await control.start(NODE, "rep-1", kit.sim_spec(port, name="llama"))
    serving = await kit.wait_for(admin, NODE, status("rep-1", "serving"), what="serving")
    assert isinstance(serving, events.ShardStatus)
    assert serving.endpoint == f"http://127.0.0.1:{port}"
    assert serving.api_key
    assert await get_models(serving.endpoint, serving.api_key) == ["llama"]
    pid = serving.pid
    assert pid is not None
    assert kit.pid_alive(pid)
    pgid = pid  # the engine leads its own process group
    assert processes.group_members(pgid)

    await control.stop(NODE, "rep-1", reason="test over")
    stopped = await kit.wait_for(admin, NODE, status("rep-1", "stopped"), what="stopped")
    assert isinstance(stopped, events.ShardStatus)
    assert stopped.error == "test over"
    assert processes.group_members(pgid) == []
    assert not kit.pid_alive(pid)
    evs = kit.without_heartbeats(await kit.node_records(admin, NODE))
    # The sim may answer /v1/models at the first probe: loading is then skipped.
    assert kit.phases(evs, "rep-1") == [
        (1, "starting"),
        (1, "serving"),
        (1, "stopped"),
    ]
    # The ledger records the command sequence up to which effects are recorded.
    assert agent.svc.ledger.last_seq > 0
    # Heartbeats flow with a TTL while the outbox is empty.
    await kit.wait_for(admin, NODE, lambda e: isinstance(e, events.Heartbeat), what="heartbeat")
    last = await admin.jetstream().get_last_msg(
        subjects.STREAM, subjects.node_event(NODE, "heartbeat")
    )
    assert (last.headers or {}).get("Nats-TTL") == "60s"
    # Reconnects are never given up (the bus's jittered backoff between attempts).
    assert agent.svc.nc.options["max_reconnect_attempts"] == -1


FAILING_ENGINE = textwrap.dedent(
    """
    import socket, sys, time
    port = int(sys.argv[sys.argv.index("--port") + 1])
    s = socket.socket(); s.bind(("127.0.0.1", port)); s.listen()
    print("loading weights from /models/none", flush=True)
    time.sleep(0.5)
    print("RuntimeError: CUDA out of memory (simulated)", flush=True)
    sys.exit(3)
    """
)


async def test_engine_exiting_while_loading_fails_with_its_log_tail(
    start_agent: Any, control: Control, admin: Any, tmp_path: Path
) -> None:
    script = tmp_path / "bad_engine.py"
    script.write_text(FAILING_ENGINE)
    await start_agent(engine_commands={"llamacpp": [sys.executable, str(script)]})
    spec = kit.sim_spec(free_port(), name="bad", engine="llamacpp", model="/models/none")
    await control.start(NODE, "rep-bad", spec)
    failed = await kit.wait_for(admin, NODE, status("rep-bad", "failed"), what="failed")
    assert isinstance(failed, events.ShardStatus)
    assert "exited with code 3 while loading" in failed.error
    assert failed.log_tail[-1] == "RuntimeError: CUDA out of memory (simulated)"
    assert "loading weights from /models/none" in failed.log_tail


async def test_bad_commands_fail_the_shard_never_the_agent(
    start_agent: Any, control: Control, admin: Any
) -> None:
    agent = await start_agent(sim_gpus="4xh100-80g,2xv100-32g")
    await control.start(NODE, "rep-ok", kit.sim_spec(free_port(), gpus=(0,)))
    await kit.wait_for(admin, NODE, status("rep-ok", "serving"))

    # GPU 0 is taken; GPU 4 is a V100 (compute capability 7.0) and cannot run fp8.
    await control.start(NODE, "rep-dup", kit.sim_spec(free_port(), gpus=(0,)))
    await control.start(NODE, "rep-fp8", kit.sim_spec(free_port(), gpus=(4,), dtype="fp8"))
    # Garbage on the node's command subject (only an admin can write it): skipped, counted.
    await admin.jetstream().publish(subjects.command(NODE), b"\x00not json")
    await admin.jetstream().publish(subjects.command(NODE), b'{"type":"cmd.start_shard"}')
    dup = await kit.wait_for(admin, NODE, status("rep-dup", "failed"))
    fp8 = await kit.wait_for(admin, NODE, status("rep-fp8", "failed"))
    assert isinstance(dup, events.ShardStatus)
    assert isinstance(fp8, events.ShardStatus)
    assert "GPU 0 is already used by another shard" in dup.error
    assert "fp8 needs compute capability 8.9" in fp8.error
    assert dup.error.startswith(f"node {NODE} refused the shard")

    # Still alive and obeying: a good command after the bad ones runs.
    await control.start(NODE, "rep-after", kit.sim_spec(free_port(), gpus=(1,)))
    await kit.wait_for(admin, NODE, status("rep-after", "serving"))
    assert not agent.task.done()
    assert agent.svc._reader is not None
    assert agent.svc._reader.undecodable == 2


def refuse_writes(path: Path) -> None:
    """What a full disk does to a save (temporary file, then rename): the write fails.
    A folder in the temporary file's place fails it the same way (EISDIR for ENOSPC)."""
    tmp = path.with_suffix(f".tmp{os.getpid()}")  # the agent runs in this process
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()


async def serve_and_stop(control: Control, admin: Any, replica_id: str) -> None:
    """Start a shard and stop it: it serves, stops, and leaves no engine behind."""
    await control.start(NODE, replica_id, kit.sim_spec(free_port()))
    serving = await kit.wait_for(admin, NODE, status(replica_id, "serving"), what="serving")
    assert isinstance(serving, events.ShardStatus)
    assert serving.pid is not None
    await control.stop(NODE, replica_id, reason="test over")
    await kit.wait_for(admin, NODE, status(replica_id, "stopped"), what="stopped")
    assert not kit.pid_alive(serving.pid)
    evs = kit.without_heartbeats(await kit.node_records(admin, NODE))
    assert kit.phases(evs, replica_id) == [(1, "starting"), (1, "serving"), (1, "stopped")]


async def test_a_pid_file_the_disk_refuses_never_loses_an_engine(
    start_agent: Any, control: Control, admin: Any
) -> None:
    """Before: on a full disk the pid file's save raised after the spawn, so the engine ran
    on unsupervised (never stopped, its exit never reported: an orphan holding its GPUs)
    while the agent reported the shard failed."""
    agent = await start_agent()
    refuse_writes(agent.svc.state_dir / "shards" / "rep-full.0.json")
    await serve_and_stop(control, admin, "rep-full")
    assert not agent.task.done()


async def test_a_ledger_the_disk_refuses_never_fails_a_running_engine(
    start_agent: Any, control: Control, admin: Any
) -> None:
    """Before: on a full disk the ledger's save raised after the spawn, and the agent then
    reported the shard failed while its engine ran (and raised again in the callback
    that records the command sequence)."""
    agent = await start_agent()
    refuse_writes(agent.svc.state_dir / "commands.json")
    await serve_and_stop(control, admin, "rep-full")
    assert not agent.task.done()
    book = agent.svc.ledger.shards["rep-full/0"]  # kept in memory
    assert (book.started, book.ended) == (1, 1)


async def test_commands_apply_once_by_generation_and_epoch(
    start_agent: Any, control: Control, admin: Any
) -> None:
    agent = await start_agent()
    control.epoch = 3
    port = free_port()
    spec = kit.sim_spec(port)
    first = await control.start(NODE, "rep-1", spec, generation=2)
    await kit.wait_for(admin, NODE, status("rep-1", "serving", 2))
    # The same command again (the server's duplicate window drops it), a re-send with a
    # new id (what a redelivery past that window looks like), an older generation,
    # and a stop from a deposed leader (epoch 2 < 3): none may touch the running engine.
    await control.send(first)
    await control.start(NODE, "rep-1", spec, generation=2, epoch=3)
    await control.start(NODE, "rep-1", spec, generation=1, epoch=3)
    await control.stop(NODE, "rep-1", generation=2, epoch=2)
    # A stale stop (generation 1 < 2) from the current leader: ignored too.
    await control.stop(NODE, "rep-1", generation=1, epoch=3)
    # A marker command on another shard tells us when everything before it was applied.
    await control.start(NODE, "marker", kit.sim_spec(free_port(), gpus=(1,)), epoch=3)
    await kit.wait_for(admin, NODE, status("marker", "starting"))
    await asyncio.sleep(0.3)
    evs = kit.without_heartbeats(await kit.node_records(admin, NODE))
    assert kit.phases(evs, "rep-1") == [(2, "starting"), (2, "serving")]
    view = agent.svc.supervisor.view("rep-1")
    assert view is not None
    assert view.phase == "serving"
    assert view.generation == 2

    # Drain, then a newer generation replaces it in place (the stop of 2 runs first).
    await control.drain(NODE, "rep-1", generation=2)
    await kit.wait_for(admin, NODE, status("rep-1", "draining", 2))
    await control.stop(NODE, "rep-1", generation=2, epoch=3)
    await control.start(NODE, "rep-1", spec, generation=3, epoch=3)
    await kit.wait_for(admin, NODE, status("rep-1", "serving", 3))
    evs = kit.without_heartbeats(await kit.node_records(admin, NODE))
    assert kit.phases(evs, "rep-1")[2:] == [
        (2, "draining"),
        (2, "stopped"),
        (3, "starting"),
        (3, "serving"),
    ]
    assert agent.svc.ledger.epoch == 3
    assert agent.svc.ledger.shards["rep-1/0"].started == 3


async def test_outage_events_arrive_exactly_once_in_order(
    start_agent: Any,
    control: Control,
    admin: Any,
    nats_server: TestNatsServer,
    connect: Connector,
) -> None:
    # The issue asks for 30 s; LLMGW_TEST_OUTAGE_S=3 makes a quick local run.
    outage_s = float(os.environ.get("LLMGW_TEST_OUTAGE_S", "30"))
    agent = await start_agent()
    svc = agent.svc
    await control.start(NODE, "rep-a", kit.sim_spec(free_port(), gpus=(0,)))
    serving_a = await kit.wait_for(admin, NODE, status("rep-a", "serving"))
    assert isinstance(serving_a, events.ShardStatus)
    assert serving_a.pid is not None
    await control.start(NODE, "rep-b", kit.sim_spec(free_port(), gpus=(1,)))
    await kit.wait_for(admin, NODE, status("rep-b", "starting"))

    nats_server.stop()
    down_at = time.monotonic()
    # While NATS is down, shards change phase: B comes up, A's engine dies.
    assert svc.supervisor is not None
    while (v := svc.supervisor.view("rep-b")) is None or v.phase != "serving":
        assert time.monotonic() - down_at < 30, v
        await asyncio.sleep(0.1)
    processes.signal_group(serving_a.pid, 9)
    while (v := svc.supervisor.view("rep-a")) is not None and v.phase != "failed":
        assert time.monotonic() - down_at < 30, v
        await asyncio.sleep(0.1)
    queued = len(svc.outbox or [])
    assert queued >= 2, "the transitions wait in the outbox"
    await asyncio.sleep(max(0.0, outage_s - (time.monotonic() - down_at)))
    nats_server.start()

    # The agent reconnects by itself, re-registers, and drains its outbox.
    deadline = time.monotonic() + 30
    while len(svc.outbox or []) or svc.registrations < 2:
        assert time.monotonic() < deadline, (len(svc.outbox or []), svc.registrations)
        await asyncio.sleep(0.1)
    records = await kit.node_records(admin, NODE)
    logged = kit.without_heartbeats(records)
    ids = [e.id for e in logged]
    assert len(ids) == len(set(ids)), "no event twice"
    assert ids == [e.id for e in agent.emitted], "every event, once, in the order it happened"
    assert kit.statuses(logged, "rep-b")[-1] == (1, "serving")
    assert kit.statuses(logged, "rep-a")[-1] == (1, "failed")
    last = logged[-1]
    assert isinstance(last, events.NodeRegistered)
    assert [(s.replica_id, s.phase) for s in last.shards] == [("rep-b", "serving")]
    # Commands flow again: the command consumer was recreated after the server restart.
    sent = time.monotonic()
    await control.stop(NODE, "rep-b")
    await kit.wait_for(admin, NODE, status("rep-b", "stopped"), within=20)
    print(f"first command after the outage applied in {time.monotonic() - sent:.2f} s")
    # Heartbeats resume after the outbox drained.
    seqs = [r.seq for r in records if isinstance(r.event, events.Heartbeat)]
    hb_before = len(seqs)
    await asyncio.sleep(1.5)
    after = await kit.node_records(admin, NODE)
    assert sum(isinstance(r.event, events.Heartbeat) for r in after) > hb_before


async def test_the_agent_cannot_publish_as_another_node(
    start_agent: Any, control: Control, admin: Any
) -> None:
    agent = await start_agent()
    svc = agent.svc
    assert svc.nc is not None
    forged = events.ShardStatus(
        id="forged-1",
        ts=time.time(),
        node="node-b",
        replica_id="rep-x",
        generation=1,
        phase="serving",
        endpoint="http://evil:1",
    )
    publisher = bus.Publisher(svc.nc.jetstream(), timeout_s=0.5, attempts=1)
    with pytest.raises(bus.PublishError):
        await publisher.publish(forged)
    deadline = time.monotonic() + 3
    while not svc.nc.permission_violations:
        assert time.monotonic() < deadline, "the server reported no violation"
        await asyncio.sleep(0.05)
    assert any("llmgw.events.node.node-b.shard" in v for v in svc.nc.permission_violations), (
        svc.nc.permission_violations
    )
    # Nor read another node's commands: creating its consumer is refused too.
    seen = len(svc.nc.permission_violations)
    create = f"$JS.API.CONSUMER.CREATE.{subjects.STREAM}.cmd-node-b.{subjects.command('node-b')}"
    with pytest.raises((TimeoutError, nats.errors.Error)):
        await svc.nc.request(create, b"{}", timeout=0.5)
    while len(svc.nc.permission_violations) == seen:
        assert time.monotonic() < deadline + 3, "the server reported no violation"
        await asyncio.sleep(0.05)
    assert "cmd-node-b" in svc.nc.permission_violations[-1]
    assert await kit.node_records(admin, "node-b") == []


NDR_SYSFS = (
    Path(__file__).resolve().parents[1]
    / "fixtures/hw/derived/sysfs-h100-cx7-ndr-x8/sys/class/infiniband"
)


async def test_a_fabric_whose_ports_go_down_is_withdrawn_then_advertised_again(
    start_agent: Any, control: Control, admin: Any, tmp_path: Path
) -> None:
    """Before: the fabrics were read once at start, so a fabric whose ports went down stayed
    advertised until the agent restarted, and multi-node replicas kept landing on it."""
    root = tmp_path / "infiniband"
    shutil.copytree(NDR_SYSFS, root)
    agent = await start_agent(
        infiniband_root=str(root), fabrics=[{"name": "ib-pod-a", "hcas": ["mlx5_0", "mlx5_1"]}]
    )

    def registered(fabrics: tuple[str, ...], after: int) -> Callable[[events.AnyEvent], bool]:
        def match(e: events.AnyEvent) -> bool:
            return (
                isinstance(e, events.NodeRegistered)
                and tuple(f.name for f in e.fabrics) == fabrics
                and e.id not in seen[:after]
            )

        return match

    seen: list[str] = []
    first = await kit.wait_for(admin, NODE, registered(("ib-pod-a",), 0), what="registration")
    seen.append(first.id)
    for hca in ("mlx5_0", "mlx5_1"):
        (root / hca / "ports" / "1" / "state").write_text("1: DOWN\n")
    down = await kit.wait_for(admin, NODE, registered((), 1), what="fabric withdrawn")
    assert isinstance(down, events.NodeRegistered)
    assert {h.state for h in down.hcas if h.name in ("mlx5_0", "mlx5_1")} == {"DOWN"}
    seen.append(down.id)
    for hca in ("mlx5_0", "mlx5_1"):
        (root / hca / "ports" / "1" / "state").write_text("4: ACTIVE\n")
    back = await kit.wait_for(admin, NODE, registered(("ib-pod-a",), 2), what="fabric back")
    assert back.id not in seen
    assert agent.svc.context.fabrics == agent.svc.inventory.fabrics != ()


async def _get(url: str) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http,
        http.get(url) as resp,
    ):
        return resp.status, await resp.text()


def _sample(text: str, line_start: str) -> float:
    found = [ln for ln in text.splitlines() if ln.startswith(line_start + " ")]
    assert len(found) == 1, (line_start, text[-2000:])
    return float(found[0].rsplit(" ", 1)[1])


async def test_the_agent_serves_its_own_metrics_and_health(
    start_agent: Any, control: Control, admin: Any, nats_server: TestNatsServer
) -> None:
    agent = await start_agent(admin={"host": "127.0.0.1", "port": 0})
    url = agent.svc.admin_url
    assert url.startswith("http://127.0.0.1:")
    await kit.wait_for(admin, NODE, lambda e: isinstance(e, events.NodeRegistered))
    status_, body = await _get(f"{url}/health")
    assert status_ == 200, body

    port = free_port()
    await control.start(NODE, "rep-1", kit.sim_spec(port, name="llama"))
    await kit.wait_for(admin, NODE, status("rep-1", "serving"), what="serving")
    _, text = await _get(f"{url}/metrics")
    assert _sample(text, "llmgw_agent_nats_connected") == 1
    assert _sample(text, 'llmgw_agent_shards{phase="serving"}') == 1
    assert _sample(text, 'llmgw_agent_shard_transitions_total{phase="starting"}') == 1
    assert _sample(text, 'llmgw_agent_shard_transitions_total{phase="serving"}') == 1
    assert _sample(text, 'llmgw_agent_startup_probes{result="ready"}') >= 1
    assert _sample(text, "llmgw_agent_outbox_events") >= 0

    await control.stop(NODE, "rep-1", reason="test over")
    await kit.wait_for(admin, NODE, status("rep-1", "stopped"), what="stopped")
    _, text = await _get(f"{url}/metrics")
    assert _sample(text, 'llmgw_agent_shard_phase_seconds_count{phase="serving"}') == 1
    assert _sample(text, 'llmgw_agent_shard_phase_seconds_count{phase="starting"}') == 1

    # NATS gone: health says what is missing, the metrics that it is disconnected.
    await asyncio.to_thread(nats_server.stop)

    async def unhealthy() -> bool:
        code, body = await _get(f"{url}/health")
        return code == 503 and "connected to NATS" in body

    await harness_wait_for(unhealthy, 15, "health 503 without NATS", every_s=0.2)
    _, text = await _get(f"{url}/metrics")
    assert _sample(text, "llmgw_agent_nats_connected") == 0
    await asyncio.to_thread(nats_server.start)

"""The supervisor against real engine processes: `llmgw sim` and small scripted engines.

Everything here spawns real subprocesses in their own process groups and
checks by pid, through /proc, that nothing of a stopped engine is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import msgspec
import pytest

from llmgw import pidfiles, processes
from llmgw.agent import engines
from llmgw.agent.discovery import simulated
from llmgw.agent.engines import Launch, LaunchContext
from llmgw.agent.shards import ShardView, status_event
from llmgw.agent.supervisor import Settings, Supervisor
from llmgw.core import events, redaction
from llmgw.core.inventory import Inventory
from llmgw.core.profile import LaunchSpec
from llmgw.natsd import free_port

pytestmark = pytest.mark.slow

INVENTORY = Inventory(gpus=simulated.parse_spec("8xh100-80g"))
CONTEXT = LaunchContext(host="127.0.0.1")
REPO = Path(__file__).resolve().parents[2]


class Recorder:
    """Collects every view the supervisor reports, and waits for a phase."""

    def __init__(self) -> None:
        self.views: list[ShardView] = []
        self.changed = asyncio.Event()

    async def __call__(self, view: ShardView) -> None:
        self.views.append(view)
        self.changed.set()

    def phases(self, replica_id: str) -> list[str]:
        return [v.phase for v in self.views if v.replica_id == replica_id]

    async def wait_for(self, replica_id: str, phase: str, within: float = 60) -> ShardView:
        deadline = time.monotonic() + within
        while True:
            for view in self.views:
                if view.replica_id == replica_id and view.phase == phase:
                    return view
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"{replica_id} never reached {phase}: {self.views!r}")
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), remaining)


@pytest.fixture
async def sup(tmp_path: Path) -> AsyncIterator[tuple[Supervisor, Recorder]]:
    recorder = Recorder()
    supervisor = Supervisor(Settings(state_dir=str(tmp_path / "state"), poll_s=0.1), recorder)
    yield supervisor, recorder
    await supervisor.stop_all(grace_s=2)
    await supervisor.close()


def sim_spec(name: str, port: int, **fields: object) -> LaunchSpec:
    base: dict[str, object] = {
        "engine": "sim",
        "model": name,
        "served_name": name,
        "port": port,
        "gpus": (0,),
    }
    return LaunchSpec(**(base | fields))  # type: ignore[arg-type]


def alive(pid: int) -> bool:
    return processes.state(pid) not in (None, "Z")


async def test_sim_reaches_serving_and_stop_ends_the_whole_group(
    sup: tuple[Supervisor, Recorder],
) -> None:
    supervisor, recorder = sup
    port, name = free_port(), f"m-{uuid.uuid4().hex[:8]}"
    spec = sim_spec(name, port)
    sim = engines.plan(spec, INVENTORY, CONTEXT)
    # The engine's workers: one ignores SIGTERM, as a wedged CUDA worker does.
    worker = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"
    shell = f"{sys.executable} -c '{worker}' & exec {' '.join(sim.argv)}"
    launch = Launch(argv=("sh", "-c", shell), env=sim.env, port=port, served_name=name)

    started = await supervisor.start("rep-a", 1, 0, spec, launch)
    assert started.phase == "starting"
    serving = await recorder.wait_for("rep-a", "serving")
    assert serving.endpoint == f"http://127.0.0.1:{port}"
    assert recorder.phases("rep-a")[0] == "starting"
    # The engine got its own key, reported with serving only, and answers only with it.
    assert len(serving.api_key) >= 40
    assert [v.api_key for v in recorder.views if v.phase != "serving"] == [""] * (
        len(recorder.views) - 1
    )
    bearer = {"Authorization": f"Bearer {serving.api_key}"}
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{serving.endpoint}/v1/models") as r:
            assert r.status == 401
        async with http.get(f"{serving.endpoint}/v1/models", headers=bearer) as r:
            assert name in [m["id"] for m in (await r.json())["data"]]
    assert serving.api_key not in " ".join(processes.cmdline(started.pid or 0) or ())
    record_file = pidfiles.path_for(supervisor.state_dir, "rep-a", 0)
    assert record_file.stat().st_mode & 0o777 == 0o600
    (log_file,) = (supervisor.state_dir / "logs").rglob("*.log")
    assert log_file.stat().st_mode & 0o777 == 0o600
    assert status_event(serving, node="n", event_id="e0", ts=1.0).api_key == serving.api_key
    assert supervisor.busy_gpus() == {0}

    group = processes.group_members(started.pid or 0)
    assert len(group) == 2, group  # the engine and its worker
    assert set(group) <= supervisor.own_pids()
    began = time.monotonic()
    stopped = await supervisor.stop("rep-a", grace_s=1.0, reason="test")
    assert stopped is not None
    assert stopped.phase == "stopped"
    assert time.monotonic() - began >= 1.0  # the worker needed SIGKILL after the grace
    assert [pid for pid in group if alive(pid)] == []
    assert processes.group_members(started.pid or 0) == []
    assert supervisor.busy_gpus() == frozenset()
    assert not pidfiles.path_for(supervisor.state_dir, "rep-a", 0).exists()
    assert list((supervisor.state_dir / "logs").rglob("*.log")) == []  # a clean stop leaves no log
    event = status_event(stopped, node="node-a", event_id="e1", ts=1.0)
    assert events.decode(events.encode(event)) == event


FAKE_ENGINE = textwrap.dedent(
    """
    import asyncio, sys
    from aiohttp import web

    async def health(request):
        return web.json_response({"status": "ok"})

    async def models(request):
        return web.json_response({"object": "list", "data": []})

    async def main():
        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", int(sys.argv[1])).start()
        for i in range(300):
            print(f"loading weights: shard {i}/300", flush=True)
        await asyncio.sleep(float(sys.argv[2]))
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", flush=True)
        sys.exit(3)

    asyncio.run(main())
    """
)


async def test_engine_exiting_while_loading_fails_with_its_log_tail(
    sup: tuple[Supervisor, Recorder], tmp_path: Path
) -> None:
    supervisor, recorder = sup
    script = tmp_path / "engine.py"
    script.write_text(FAKE_ENGINE)
    port = free_port()
    spec = sim_spec("big-model", port)
    launch = Launch(
        argv=(sys.executable, str(script), str(port), "1.5"),
        env={},
        port=port,
        served_name="big-model",
    )
    await supervisor.start("rep-b", 1, 0, spec, launch)
    failed = await recorder.wait_for("rep-b", "failed")
    assert recorder.phases("rep-b") == ["starting", "loading", "failed"]
    assert failed.error == "engine exited with code 3 while loading"
    assert failed.log_tail[-1].startswith("torch.OutOfMemoryError: CUDA out of memory")
    assert len(failed.log_tail) == supervisor.settings.tail_lines  # bounded
    assert failed.endpoint == ""
    assert supervisor.busy_gpus() == frozenset()
    (log_file,) = (supervisor.state_dir / "logs").rglob("*.log")  # kept until forgotten
    supervisor.forget("rep-b")
    assert supervisor.view("rep-b") is None
    assert not log_file.exists()


async def test_a_failed_engines_log_tail_leaves_without_its_api_key(
    sup: tuple[Supervisor, Recorder], tmp_path: Path
) -> None:
    """SGLang prints its arguments at start, the key among them: the tail is redacted."""
    supervisor, recorder = sup
    script = tmp_path / "engine.py"
    script.write_text(
        "import os, sys\n"
        "print('server_args=ServerArgs(api_key=' + repr(os.environ['LLMGW_SIM_API_KEY']) + ')')\n"
        "sys.exit(1)\n"
    )
    spec = sim_spec("leaky", free_port())
    launch = Launch(argv=(sys.executable, str(script)), env={}, port=spec.port)
    await supervisor.start("rep-k", 1, 0, spec, launch)
    failed = await recorder.wait_for("rep-k", "failed")
    assert failed.log_tail == (f"server_args=ServerArgs(api_key='{redaction.KEY_MARK}')",)
    assert failed.api_key == ""


async def test_engine_that_never_answers_times_out_and_is_killed(
    sup: tuple[Supervisor, Recorder],
) -> None:
    supervisor, recorder = sup
    spec = sim_spec("slow", free_port(), start_timeout_s=1.0)
    launch = Launch(argv=("sh", "-c", "echo starting up; exec sleep 300"), env={}, port=spec.port)
    started = await supervisor.start("rep-c", 1, 0, spec, launch)
    failed = await recorder.wait_for("rep-c", "failed", within=20)
    assert "did not open port" in failed.error
    assert "within 1 s (start_timeout_s)" in failed.error
    assert failed.log_tail == ("starting up",)
    assert not alive(started.pid or 0)


STALLING_ENGINE = textwrap.dedent(
    """
    import socket, sys, time
    # Like vLLM while it loads weights: the port accepts connections, HTTP never answers.
    server = socket.create_server(("127.0.0.1", int(sys.argv[1])))
    held = []
    print("loading model weights...", flush=True)
    while True:
        conn, _ = server.accept()
        held.append(conn)
    """
)


async def test_listening_engine_is_loading_until_its_load_timeout(
    sup: tuple[Supervisor, Recorder], tmp_path: Path
) -> None:
    supervisor, recorder = sup
    script = tmp_path / "stall.py"
    script.write_text(STALLING_ENGINE)
    spec = sim_spec("stalled", free_port(), load_timeout_s=1.5)
    launch = Launch(
        argv=(sys.executable, str(script), str(spec.port)),
        env={},
        port=spec.port,
        served_name="stalled",
    )
    supervisor.settings = msgspec.structs.replace(supervisor.settings, probe_timeout_s=0.3)
    started = await supervisor.start("rep-g", 1, 0, spec, launch)
    failed = await recorder.wait_for("rep-g", "failed", within=30)
    assert recorder.phases("rep-g") == ["starting", "loading", "failed"]
    assert failed.error == (
        "/v1/models did not list 'stalled' within 1.5 s "
        "of the engine opening its port (load_timeout_s)"
    )
    assert failed.log_tail == ("loading model weights...",)
    assert not alive(started.pid or 0)


async def test_engine_listening_only_once_loaded_gets_the_whole_budget(
    sup: tuple[Supervisor, Recorder],
) -> None:
    # SGLang opens its port after loading: its start deadline includes load_timeout_s.
    supervisor, recorder = sup
    spec = sim_spec("late", free_port(), start_timeout_s=0.5, load_timeout_s=1.0)
    launch = Launch(argv=("sleep", "300"), env={}, port=spec.port, listens_before_loading=False)
    began = time.monotonic()
    await supervisor.start("rep-h", 1, 0, spec, launch)
    failed = await recorder.wait_for("rep-h", "failed", within=20)
    assert time.monotonic() - began >= 1.5
    assert "within 1.5 s (start_timeout_s + load_timeout_s" in failed.error


async def test_start_is_idempotent_by_generation(sup: tuple[Supervisor, Recorder]) -> None:
    supervisor, recorder = sup
    spec = sim_spec("idem", free_port())
    launch = Launch(argv=("sleep", "300"), env={}, port=spec.port, http=False)
    first = await supervisor.start("rep-d", 2, 0, spec, launch)
    again = await supervisor.start("rep-d", 2, 0, spec, launch)
    stale = await supervisor.start("rep-d", 1, 0, spec, launch)
    assert first.pid == again.pid == stale.pid
    newer = await supervisor.start("rep-d", 3, 0, spec, launch)
    assert newer.pid != first.pid
    assert not alive(first.pid or 0)
    gen2 = [v.phase for v in recorder.views if v.generation == 2]
    assert gen2[0] == "starting"
    assert gen2[-1] == "stopped"
    assert gen2.count("starting") == 1  # the repeated and the stale start spawned nothing


async def test_missing_engine_binary_fails_with_what_to_do(
    sup: tuple[Supervisor, Recorder],
) -> None:
    supervisor, _ = sup
    spec = sim_spec("none", free_port())
    launch = Launch(argv=("/nonexistent/vllm", "serve"), env={}, port=spec.port)
    view = await supervisor.start("rep-e", 1, 0, spec, launch)
    assert view.phase == "failed"
    assert "cannot start '/nonexistent/vllm'" in view.error
    assert "install the engine" in view.error


async def test_restarted_agent_adopts_its_running_engine(tmp_path: Path) -> None:
    state, port, name = tmp_path / "state", free_port(), f"adopt-{uuid.uuid4().hex[:8]}"
    child_log = tmp_path / "agent_child.log"
    with child_log.open("w") as stderr:
        child = subprocess.Popen(  # noqa: ASYNC220 - a plain child we SIGKILL, not awaited
            [sys.executable, "-m", "tests.integration.agent_child", str(state), str(port), name],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 90)
        assert line.startswith("SERVING "), line
        engine_pid, key = int(line.split()[1]), line.split()[2]
    finally:
        child.send_signal(signal.SIGKILL)  # the agent dies without cleaning up
        child.wait(10)
    assert alive(engine_pid)  # serving survives the agent
    assert "engine_spawned" in child_log.read_text()
    assert key not in child_log.read_text()  # the agent's log never carries the key

    recorder = Recorder()
    supervisor = Supervisor(Settings(state_dir=str(state), poll_s=0.1), recorder)
    try:
        results = await supervisor.adopt()
        assert [(r.replica_id, r.adopted, r.pid) for r in results] == [
            ("rep-adopt", True, engine_pid)
        ]
        view = await recorder.wait_for("rep-adopt", "serving")
        assert view.pid == engine_pid
        assert view.adopted
        assert view.endpoint == f"http://127.0.0.1:{port}"
        # The adopting agent knows the engine's key from the pid file, and it still works.
        assert view.api_key == key
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{view.endpoint}/v1/models", headers={"Authorization": f"Bearer {key}"}) as r,
        ):
            assert r.status == 200
        # No second engine was started: exactly one process serves this model name.
        serving_it = [
            p
            for p in os.listdir("/proc")
            if p.isdigit() and name in " ".join(processes.cmdline(int(p)) or ())
        ]
        assert serving_it == [str(engine_pid)]
        stopped = await supervisor.stop("rep-adopt", grace_s=5)
        assert stopped is not None
        assert stopped.phase == "stopped"
        assert not alive(engine_pid)
    finally:
        await supervisor.stop_all(grace_s=1)
        await supervisor.close()


@pytest.mark.parametrize("lie", ["start_time", "cmdline"])
async def test_foreign_process_with_a_reused_pid_is_not_adopted(tmp_path: Path, lie: str) -> None:
    key = "engine-key-in-a-command-line"
    # The process now at the pid shows the key on its command line (as SGLang's would).
    foreign = subprocess.Popen(  # noqa: ASYNC220
        [sys.executable, "-c", "import time; time.sleep(300)", key], start_new_session=True
    )
    try:
        real = processes.fingerprint(foreign.pid)
        assert real is not None
        spec = sim_spec("x", free_port())
        launch = engines.keyed(spec, engines.plan(spec, INVENTORY, CONTEXT), key)
        # The pid file of an engine that died while the agent was away; its pid now
        # belongs to `sleep`. Either the start time or the command line gives it away.
        recorded = processes.Fingerprint(
            pid=foreign.pid,
            start_time=real.start_time - 100 if lie == "start_time" else real.start_time,
            boot_id=real.boot_id,
            cmdline=launch.argv if lie == "cmdline" else real.cmdline,
        )
        state = tmp_path / "state"
        pidfiles.save(
            state,
            pidfiles.ShardRecord(
                replica_id="rep-old",
                generation=1,
                shard=0,
                spec=spec,
                launch=launch,
                process=recorded,
                pgid=foreign.pid,
                log_path=str(tmp_path / "x.log"),
                phase="serving",
            ),
        )
        supervisor = Supervisor(Settings(state_dir=str(state), poll_s=0.1))
        (result,) = await supervisor.adopt()
        assert not result.adopted
        assert ("was reused" if lie == "start_time" else "not the engine") in result.reason
        assert key not in result.reason  # the reason is logged and reported
        assert supervisor.views() == []
        assert not pidfiles.path_for(state, "rep-old", 0).exists()
        await supervisor.stop_all()
        await supervisor.close()
        assert foreign.poll() is None  # never signalled
    finally:
        foreign.kill()
        foreign.wait()


async def test_adopted_engine_that_dies_is_reported_failed(tmp_path: Path) -> None:
    state = str(tmp_path / "state")
    spec = sim_spec("worker", free_port(), nnodes=1)
    launch = Launch(argv=("sleep", "300"), env={}, port=spec.port, http=False)
    first = Supervisor(Settings(state_dir=state, poll_s=0.1, headless_settle_s=0.2))
    view = await first.start("rep-f", 1, 0, spec, launch)
    await first.close()  # the agent goes away; the engine stays
    (tmp_path / "state" / "shards" / "junk.0.json").write_text("{not json")

    recorder = Recorder()
    second = Supervisor(Settings(state_dir=state, poll_s=0.1), recorder)
    try:
        results = {r.replica_id: r for r in await second.adopt()}
        assert results["rep-f"].adopted
        assert not results["junk.0"].adopted
        assert not (tmp_path / "state" / "shards" / "junk.0.json").exists()
        await recorder.wait_for("rep-f", "serving")
        os.kill(view.pid or 0, signal.SIGKILL)
        failed = await recorder.wait_for("rep-f", "failed", within=10)
        assert failed.error == "engine disappeared while serving"
    finally:
        await second.close()

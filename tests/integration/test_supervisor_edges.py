"""The supervisor's edges against real processes: restarts of a failed generation, what a
stop of a dead shard does, the files and descriptors each start leaves behind."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from llmgw import pidfiles, processes
from llmgw.agent import engines, probe
from llmgw.agent.engines import Launch
from llmgw.agent.shards import ShardView
from llmgw.agent.supervisor import Settings, Supervisor
from llmgw.core.profile import LaunchSpec
from llmgw.natsd import free_port
from tests.integration.test_supervisor import CONTEXT, INVENTORY, Recorder, alive

pytestmark = pytest.mark.slow


@pytest.fixture
async def supervised(tmp_path: Path) -> AsyncIterator[tuple[Supervisor, Recorder]]:
    recorder = Recorder()
    supervisor = Supervisor(
        Settings(state_dir=str(tmp_path / "state"), poll_s=0.1, headless_settle_s=0.2), recorder
    )
    yield supervisor, recorder
    await supervisor.stop_all(grace_s=2)
    await supervisor.close()


def spec(name: str, **fields: object) -> LaunchSpec:
    base: dict[str, object] = {
        "engine": "sim",
        "model": name,
        "served_name": name,
        "port": free_port(),
        "gpus": (0,),
    }
    return LaunchSpec(**(base | fields))  # type: ignore[arg-type]


def headless(argv: tuple[str, ...], port: int) -> Launch:
    return Launch(argv=argv, env={}, port=port, http=False)


def fd_flags(pid: int, fd: int) -> int:
    """The open flags of a process's descriptor, as /proc shows them (octal)."""
    info = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
    return int(next(line.split()[1] for line in info.splitlines() if line.startswith("flags")), 8)


def logs(supervisor: Supervisor) -> list[str]:
    return sorted(p.name for p in (supervisor.state_dir / "logs").rglob("*.log"))


async def test_a_failed_generation_started_again_is_spawned_again(
    supervised: tuple[Supervisor, Recorder],
) -> None:
    """Only a live shard of the same generation is left alone: one that failed to spawn
    (the binary was missing, then installed) is started when its start comes again."""
    supervisor, _ = supervised
    s = spec("again")
    failed = await supervisor.start("rep-1", 1, 0, s, headless(("/nonexistent/vllm",), s.port))
    assert failed.phase == "failed"
    again = await supervisor.start("rep-1", 1, 0, s, headless(("sleep", "300"), s.port))
    assert again.phase == "starting"
    assert again.pid is not None
    assert alive(again.pid)


async def test_stopping_a_failed_shard_reports_nothing_new(
    supervised: tuple[Supervisor, Recorder],
) -> None:
    supervisor, recorder = supervised
    s = spec("dead")
    await supervisor.start("rep-2", 1, 0, s, headless((sys.executable, "-c", "exit(4)"), s.port))
    failed = await recorder.wait_for("rep-2", "failed")
    # Nothing is left to adopt: a restarted agent must not look for this engine.
    assert not pidfiles.path_for(supervisor.state_dir, "rep-2", 0).exists()
    seen = len(recorder.views)
    view = await supervisor.stop("rep-2", reason="stopped by command")
    assert view == failed
    assert len(recorder.views) == seen
    assert logs(supervisor) != []  # its log stays for the report until it is forgotten


async def test_a_new_generation_deletes_the_output_of_older_ones(
    supervised: tuple[Supervisor, Recorder],
) -> None:
    supervisor, recorder = supervised
    s = spec("gens")
    exits = headless((sys.executable, "-c", "print('boom'); exit(1)"), s.port)
    await supervisor.start("rep-3", 1, 0, s, exits)
    await recorder.wait_for("rep-3", "failed")
    assert [name.rsplit(".", 2)[-2] for name in logs(supervisor)] == ["g1"]
    await supervisor.start("rep-3", 2, 0, s, headless(("sleep", "300"), s.port))
    assert [name.rsplit(".", 2)[-2] for name in logs(supervisor)] == ["g2"]


async def test_the_engine_writes_its_output_appending(
    supervised: tuple[Supervisor, Recorder],
) -> None:
    """O_APPEND on the engine's output: trimming the file in place is safe only if the
    engine's next write lands at the new end, not at its old offset (a file of zeros)."""
    supervisor, _ = supervised
    s = spec("append")
    view = await supervisor.start("rep-4", 1, 0, s, headless(("sleep", "300"), s.port))
    assert fd_flags(view.pid or 0, 1) & os.O_APPEND


async def test_a_start_leaves_no_descriptor_open_in_the_agent(
    supervised: tuple[Supervisor, Recorder],
) -> None:
    supervisor, _ = supervised
    s = spec("fds")
    launch = headless(("sleep", "300"), s.port)
    await supervisor.start("rep-w", 1, 0, s, launch)  # the event loop's own, opened once
    await supervisor.stop("rep-w", grace_s=1)
    before = len(os.listdir("/proc/self/fd"))
    for generation in range(1, 6):
        await supervisor.start("rep-5", generation, 0, s, launch)
    await supervisor.stop("rep-5", grace_s=1)
    await asyncio.sleep(0)
    assert len(os.listdir("/proc/self/fd")) <= before


async def test_only_a_serving_shard_is_drained(supervised: tuple[Supervisor, Recorder]) -> None:
    supervisor, recorder = supervised
    s = spec("drain", start_timeout_s=300.0)
    # Listens on nothing: it stays starting.
    await supervisor.start("rep-6", 1, 0, s, Launch(argv=("sleep", "300"), env={}, port=s.port))
    view = await supervisor.mark_draining("rep-6")
    assert view is not None
    assert view.phase == "starting"
    assert [v.phase for v in recorder.views if v.replica_id == "rep-6"] == ["starting"]


async def test_forget_keeps_a_live_shard_and_adopt_skips_what_it_already_watches(
    supervised: tuple[Supervisor, Recorder],
) -> None:
    """Forgetting a live shard would lose its engine (and its GPUs) from the table; adopting
    one already watched would watch it twice, as if another agent had left it."""
    supervisor, _ = supervised
    s = spec("live")
    started = await supervisor.start("rep-7", 1, 0, s, headless(("sleep", "300"), s.port))
    supervisor.forget("rep-7")
    assert supervisor.view("rep-7") is not None
    assert supervisor.busy_gpus() == {0}
    assert await supervisor.adopt() == []
    view = supervisor.view("rep-7")
    assert view is not None
    assert not view.adopted
    assert view.pid == started.pid


async def test_a_draining_shard_keeps_its_endpoint_and_key(
    supervised: tuple[Supervisor, Recorder],
) -> None:
    """Routers finish what they sent to a draining engine: its status still says where it
    is and with which key (an empty endpoint would read as gone)."""
    supervisor, recorder = supervised
    s = spec(f"drain-{free_port()}")
    launch = engines.plan(s, INVENTORY, CONTEXT)
    await supervisor.start("rep-8", 1, 0, s, launch)
    serving = await recorder.wait_for("rep-8", "serving")
    draining = await supervisor.mark_draining("rep-8")
    assert draining is not None
    assert draining.phase == "draining"
    assert (draining.endpoint, draining.api_key) == (serving.endpoint, serving.api_key)
    assert serving.endpoint
    assert serving.api_key


async def test_the_pid_file_follows_the_phase_but_never_another_process(
    supervised: tuple[Supervisor, Recorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An adopting agent resumes from the pid file's phase, so each transition is written
    there; the command line is re-recorded only for the same process (same start time),
    never for whatever a reused pid now names."""
    supervisor, recorder = supervised
    s = spec("pidfile")
    started = await supervisor.start("rep-9", 1, 0, s, headless(("sleep", "300"), s.port))
    (_, first), *_ = pidfiles.load_all(supervisor.state_dir)
    assert first is not None
    real = processes.fingerprint

    def another_at_the_pid(pid: int) -> processes.Fingerprint | None:
        found = real(pid)
        if found is None or pid != started.pid:
            return found
        return msgspec.structs.replace(found, start_time=found.start_time + 1, cmdline=("x",))

    monkeypatch.setattr(processes, "fingerprint", another_at_the_pid)
    await recorder.wait_for("rep-9", "serving")
    ((_, record),) = pidfiles.load_all(supervisor.state_dir)
    assert record is not None
    assert record.phase == "serving"
    assert record.process == first.process


GRACEFUL = """
import pathlib, signal, sys, time
def done(*_):
    pathlib.Path(sys.argv[1]).write_text("shut down cleanly")
    sys.exit(0)
signal.signal(signal.SIGTERM, done)
print("ready", flush=True)
time.sleep(300)
"""


async def test_a_stop_asks_the_engine_to_shut_down_before_it_kills(
    supervised: tuple[Supervisor, Recorder], tmp_path: Path
) -> None:
    """SIGTERM first: an engine frees its GPU memory and finishes its writes on it."""
    supervisor, recorder = supervised
    s = spec("graceful")
    marker = tmp_path / "marker"
    launch = headless((sys.executable, "-c", GRACEFUL, str(marker)), s.port)
    view = await supervisor.start("rep-10", 1, 0, s, launch)
    await recorder.wait_for("rep-10", "serving")
    for _ in range(1200):  # its SIGTERM handler is in place once it says ready
        if "ready" in await asyncio.to_thread(_output, supervisor):
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the engine never said ready")
    stopped = await supervisor.stop("rep-10", grace_s=30)
    assert stopped is not None
    assert stopped.phase == "stopped"
    assert not alive(view.pid or 0)
    assert marker.read_text() == "shut down cleanly"


def _output(supervisor: Supervisor) -> str:
    return "".join(p.read_text() for p in (supervisor.state_dir / "logs").rglob("*.log"))


async def test_an_engines_output_is_trimmed_while_it_runs(tmp_path: Path) -> None:
    """A chatty engine's file is cut back to its end (the check runs every 10 s)."""
    recorder = Recorder()
    supervisor = Supervisor(
        Settings(
            state_dir=str(tmp_path / "state"),
            poll_s=0.1,
            headless_settle_s=0.2,
            max_log_bytes=20_000,
            keep_log_bytes=1_000,
        ),
        recorder,
    )
    chatty = "import time\nfor i in range(1000): print('line', i, 'x' * 80)\ntime.sleep(300)\n"
    s = spec("chatty")
    try:
        await supervisor.start("rep-11", 1, 0, s, headless((sys.executable, "-c", chatty), s.port))
        for _ in range(600):  # up to 60 s for the first check past 10 s
            text = await asyncio.to_thread(_output, supervisor)
            if text.startswith("[llmgw: earlier output trimmed]"):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"never trimmed: {len(text)} bytes")
        assert len(text) < 2_000
        assert text.rstrip().endswith("line 999 " + "x" * 80)
    finally:
        await supervisor.stop_all(grace_s=2)
        await supervisor.close()


async def test_a_headless_worker_that_dies_while_settling_never_counts_as_serving(
    tmp_path: Path,
) -> None:
    recorder = Recorder()
    supervisor = Supervisor(
        Settings(state_dir=str(tmp_path / "state"), poll_s=0.1, headless_settle_s=60.0),
        recorder,
    )
    s = spec("worker")
    dies = headless((sys.executable, "-c", "import time; time.sleep(1); exit(2)"), s.port)
    try:
        await supervisor.start("rep-12", 1, 0, s, dies)
        failed = await recorder.wait_for("rep-12", "failed", within=50)
        assert recorder.phases("rep-12") == ["starting", "failed"]
        assert failed.error == "engine exited with code 2 while starting"
    finally:
        await supervisor.stop_all(grace_s=2)
        await supervisor.close()


LATE_STALL = """
import socket, sys, time
time.sleep(float(sys.argv[2]))  # a slow start: the port opens late
server = socket.create_server(("127.0.0.1", int(sys.argv[1])))
held = []
while True:  # then, like vLLM loading weights, HTTP never answers
    held.append(server.accept()[0])
"""


class Timed(Recorder):
    def __init__(self) -> None:
        super().__init__()
        self.at: dict[str, float] = {}

    async def __call__(self, view: ShardView) -> None:
        self.at.setdefault(view.phase, time.monotonic())
        await super().__call__(view)


async def test_the_load_timeout_runs_from_when_the_port_opened(tmp_path: Path) -> None:
    recorder = Timed()
    supervisor = Supervisor(
        Settings(state_dir=str(tmp_path / "state"), poll_s=0.1, probe_timeout_s=0.3), recorder
    )
    s = spec("late", start_timeout_s=120.0, load_timeout_s=3.0)
    launch = Launch(
        argv=(sys.executable, "-c", LATE_STALL, str(s.port), "4"),
        env={},
        port=s.port,
        served_name="late",
    )
    try:
        began = time.monotonic()
        await supervisor.start("rep-13", 1, 0, s, launch)
        failed = await recorder.wait_for("rep-13", "failed", within=100)
        assert "(load_timeout_s)" in failed.error
        assert recorder.phases("rep-13") == ["starting", "loading", "failed"]
        # All of its load budget (3 s), counted from the port opening (4 s in), not from
        # the first probe: a busy machine only makes this longer.
        assert recorder.at["failed"] - began >= 6.5
    finally:
        await supervisor.stop_all(grace_s=2)
        await supervisor.close()


async def test_an_adopted_engine_resumes_in_the_phase_its_pid_file_says(tmp_path: Path) -> None:
    state = str(tmp_path / "state")
    s = spec("resume")
    first = Supervisor(Settings(state_dir=state, poll_s=0.1, headless_settle_s=0.2), Recorder())
    await first.start("rep-14", 1, 0, s, headless(("sleep", "300"), s.port))
    for _ in range(600):
        view = first.view("rep-14")
        if view is not None and view.phase == "serving":
            break
        await asyncio.sleep(0.05)
    await first.close()  # the agent goes away; the engine serves on
    second = Supervisor(Settings(state_dir=state, poll_s=0.1, headless_settle_s=60.0))
    try:
        (adopted,) = await second.adopt()
        assert adopted.adopted
        view = second.view("rep-14")
        assert view is not None
        assert view.phase == "serving"  # at once: not started over (60 s of settling here)
    finally:
        await second.stop_all(grace_s=2)
        await second.close()


async def test_the_launch_environment_wins_over_the_agents(
    supervised: tuple[Supervisor, Recorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA_VISIBLE_DEVICES and the like are the launch's: the agent's own (a leftover in
    its unit file) must not put an engine on GPUs it was not given."""
    supervisor, recorder = supervised
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    s = spec("env")
    shows = "import os; print('gpus=' + os.environ['CUDA_VISIBLE_DEVICES']); exit(1)"
    launch = Launch(
        argv=(sys.executable, "-c", shows), env={"CUDA_VISIBLE_DEVICES": "2"}, port=s.port
    )
    await supervisor.start("rep-15", 1, 0, s, launch)
    failed = await recorder.wait_for("rep-15", "failed")
    assert failed.log_tail == ("gpus=2",)


async def test_an_adopted_engine_still_loading_is_announced(tmp_path: Path) -> None:
    """The adopting agent says what it found even when the probe sees no change: else the
    control plane hears nothing of this engine until it serves or fails."""
    state = str(tmp_path / "state")
    s = spec("loading", start_timeout_s=300.0, load_timeout_s=300.0)
    launch = Launch(
        argv=(sys.executable, "-c", LATE_STALL, str(s.port), "0"),
        env={},
        port=s.port,
        served_name="loading",
    )
    first_seen = Recorder()
    first = Supervisor(Settings(state_dir=state, poll_s=0.1, probe_timeout_s=0.3), first_seen)
    await first.start("rep-16", 1, 0, s, launch)
    await first_seen.wait_for("rep-16", "loading")
    await first.close()
    recorder = Recorder()
    second = Supervisor(Settings(state_dir=state, poll_s=0.1, probe_timeout_s=0.3), recorder)
    try:
        (adopted,) = await second.adopt()
        assert adopted.adopted
        view = await recorder.wait_for("rep-16", "loading", within=30)
        assert view.adopted
    finally:
        await second.stop_all(grace_s=2)
        await second.close()


async def test_closing_the_supervisor_closes_its_probes_http_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[aiohttp.ClientSession] = []
    session = aiohttp.ClientSession

    def kept(*args: Any, **kwargs: Any) -> aiohttp.ClientSession:
        opened.append(session(*args, **kwargs))
        return opened[-1]

    monkeypatch.setattr(probe.aiohttp, "ClientSession", kept)
    recorder = Recorder()
    supervisor = Supervisor(Settings(state_dir=str(tmp_path / "state"), poll_s=0.1), recorder)
    s = spec(f"probed-{free_port()}")
    try:
        await supervisor.start("rep-17", 1, 0, s, engines.plan(s, INVENTORY, CONTEXT))
        await recorder.wait_for("rep-17", "serving")
    finally:
        await supervisor.stop_all(grace_s=2)
        await supervisor.close()
    assert len(opened) == 1
    assert opened[0].closed


async def test_a_start_that_cannot_spawn_leaves_no_output_file(
    supervised: tuple[Supervisor, Recorder],
) -> None:
    """Nothing ran, so nothing was written: the file opened for the engine's output goes
    too, else each replica whose engine binary is missing leaves one behind for good."""
    supervisor, _ = supervised
    s = spec("nobinary")
    view = await supervisor.start("rep-18", 1, 0, s, headless(("/nonexistent/vllm",), s.port))
    assert view.phase == "failed"
    supervisor.forget("rep-18")
    assert logs(supervisor) == []

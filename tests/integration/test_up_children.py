"""How `llmgw up` stops its processes, with real subprocesses standing in for the services:
SIGTERM first and SIGKILL only after the timeout, whatever a child left in its process group,
a pid file's process alone when it leads no group of its own, the fleet in order (router,
agents together, control, nats), and a service that dies while the fleet runs named with
its log."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest

from llmgw import pidfiles, processes
from llmgw.agent.engines import Launch
from llmgw.core.profile import LaunchSpec
from llmgw.natsd import free_port
from llmgw.up import children, running
from llmgw.up.children import Child, UpError
from llmgw.up.layout import Layout
from llmgw.up.render import Plan

# A service stand-in. argv: its name, the file it appends "<name> <event> <time>" lines to,
# and what it does on SIGTERM: "exit", "ignore" or "linger:<seconds>" (exit that much later).
# With "spawn" last it first starts a grandchild (in its process group) and, once that
# ignores SIGTERM, writes its pid to the record.
SERVICE = r"""
import os, signal, subprocess, sys, time
name, record, on_term = sys.argv[1:4]
def note(event):
    with open(record, "a") as f:
        f.write(f"{name} {event} {time.monotonic()}\n")
def term(signum, frame):
    note("term")
    if on_term == "exit":
        sys.exit(0)
    if on_term.startswith("linger:"):
        time.sleep(float(on_term.split(":")[1]))
        note("exit")
        sys.exit(0)
signal.signal(signal.SIGTERM, term)
if sys.argv[4:] == ["spawn"]:
    ignoring = record + ".ignoring"
    grandchild = subprocess.Popen([sys.executable, "-c",
        "import signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "open(sys.argv[1], 'w').close()\ntime.sleep(600)", ignoring])
    while not os.path.exists(ignoring):
        time.sleep(0.01)
    note(f"grandchild {grandchild.pid}")
print(f"{name} ready", flush=True)
while True:
    time.sleep(0.05)
"""


def service_argv(name: str, record: Path, on_term: str, *more: str) -> list[str]:
    return [sys.executable, "-c", SERVICE, name, str(record), on_term, *more]


def until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def noted(record: Path) -> list[tuple[str, str, float]]:
    """The (name, event, time) lines the stand-ins wrote."""
    if not record.exists():
        return []
    out = []
    for line in record.read_text().splitlines():
        name, rest = line.split(" ", 1)
        event, at = rest.rsplit(" ", 1)
        out.append((name, event, float(at)))
    return out


@pytest.fixture
def started() -> Iterator[list[Child]]:
    """The children a test started; anything of theirs still running is killed after it."""
    kids: list[Child] = []
    yield kids
    for kid in kids:
        if kid.pid is not None:
            processes.signal_group(kid.pid, signal.SIGKILL)
        if kid.proc is not None:
            kid.proc.wait(10)


def start(kids: list[Child], tmp: Path, name: str, on_term: str, *more: str) -> Child:
    record = tmp / "record"
    child = Child(
        name,
        service_argv(name, record, on_term, *more),
        log_path=tmp / "logs" / f"{name}.log",
        pid_file=tmp / "run" / f"{name}.json",
    )
    child.start()
    kids.append(child)
    child.wait_for(rf"^{name} ready$", 60.0, lambda: False)
    return child


def test_stop_sends_sigterm_and_waits_for_the_child(tmp_path: Path, started: list[Child]) -> None:
    child = start(started, tmp_path, "svc", "exit")
    recorded = children.recorded(child.pid_file)
    assert recorded is not None
    assert recorded.pid == child.pid
    child.stop(30.0)
    assert child.proc is not None
    assert child.proc.returncode == 0
    assert [(n, e) for n, e, _ in noted(tmp_path / "record")] == [("svc", "term")]
    assert not child.pid_file.exists()
    assert not child.running


def test_a_child_ignoring_sigterm_is_killed_after_the_timeout(
    tmp_path: Path, started: list[Child]
) -> None:
    child = start(started, tmp_path, "stubborn", "ignore")
    began = time.monotonic()
    child.stop(1.5)
    assert child.proc is not None
    assert child.proc.returncode == -signal.SIGKILL
    # SIGTERM first, and the full timeout granted before SIGKILL.
    terms = [at for _, e, at in noted(tmp_path / "record") if e == "term"]
    assert len(terms) == 1
    assert time.monotonic() - began >= 1.5
    assert not child.pid_file.exists()


def test_what_a_child_left_in_its_group_is_killed_with_it(
    tmp_path: Path, started: list[Child]
) -> None:
    child = start(started, tmp_path, "parent", "exit", "spawn")
    pgid = child.pid
    assert pgid is not None
    [grandchild] = [int(e.split()[1]) for _, e, _ in noted(tmp_path / "record") if "grand" in e]
    assert grandchild in processes.group_members(pgid)
    child.stop(30.0)
    until(lambda: not processes.group_members(pgid))


def test_a_recorded_group_leader_is_stopped_with_its_group(
    tmp_path: Path, started: list[Child]
) -> None:
    child = start(started, tmp_path, "leftover", "exit", "spawn")
    assert child.proc is not None
    assert child.pid is not None
    pgid = child.pid
    # As a later `up` finds it: through the pid file only.
    assert children.stop_recorded(child.pid_file, 30.0) == pgid
    assert child.proc.wait(30) == 0  # SIGTERM, handled
    until(lambda: not processes.group_members(pgid))
    assert not child.pid_file.exists()


def test_a_recorded_process_outside_its_own_group_is_signalled_alone(tmp_path: Path) -> None:
    """A process in a group it does not lead (here: this test's own group) gets SIGTERM
    itself; its group, which holds this very test, is never signalled."""
    record = tmp_path / "record"
    argv = service_argv("member", record, "exit")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"member ready\n"
        assert os.getpgid(proc.pid) == os.getpgid(0) != proc.pid
        fingerprint = processes.fingerprint(proc.pid)
        assert fingerprint is not None
        pid_file = tmp_path / "member.json"
        pid_file.write_bytes(msgspec.json.encode(fingerprint))
        assert children.stop_recorded(pid_file, timeout_s=60.0) == proc.pid
        # Ended by the SIGTERM it was sent, not by a SIGKILL after the timeout.
        assert proc.wait(10) == 0
        assert [(n, e) for n, e, _ in noted(record)] == [("member", "term")]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def fleet_of(tmp_path: Path, started: list[Child], agents_linger_s: float = 0.0) -> running.Fleet:
    """A Fleet whose services are stand-ins: nats, control, two agents and the router."""
    plan = Plan(layout=Layout(tmp_path / "state"), nodes=2, port=free_port())
    plan.layout.make()
    fleet = running.Fleet(plan, io.StringIO(), tty=False)
    agent_term = f"linger:{agents_linger_s}" if agents_linger_s else "exit"
    fleet.nats = start(started, tmp_path, "nats", "exit")
    fleet.control = start(started, tmp_path, "control", "exit")
    fleet.agents = [start(started, tmp_path, n, agent_term) for n in plan.node_ids]
    fleet.router = start(started, tmp_path, "router", "exit")
    return fleet


def test_the_fleet_stops_router_then_agents_together_then_control_then_nats(
    tmp_path: Path, started: list[Child]
) -> None:
    linger = 3.0
    fleet = fleet_of(tmp_path, started, agents_linger_s=linger)
    fleet.stop()
    events = noted(tmp_path / "record")
    # In the order each service got its first SIGTERM (a lingering agent may get a second).
    terms = list(dict.fromkeys(name for name, e, _ in events if e == "term"))
    assert terms[0] == "router"
    assert sorted(terms[1:3]) == ["node-1", "node-2"]
    assert terms[3:] == ["control", "nats"]
    # Both agents had their SIGTERM before either finished stopping: they stop together.
    at: dict[tuple[str, str], float] = {}
    for name, e, t in events:
        at.setdefault((name, e), t)
    assert max(at["node-1", "term"], at["node-2", "term"]) < min(
        at["node-1", "exit"], at["node-2", "exit"]
    )
    # Each next service only once the one before has exited.
    assert at["control", "term"] > max(at["node-1", "exit"], at["node-2", "exit"])
    assert all(not c.running for c in started)
    assert not list(fleet.layout.run.glob("*.json"))


def test_a_service_that_dies_while_the_fleet_runs_is_named_with_its_log(
    tmp_path: Path, started: list[Child]
) -> None:
    fleet = fleet_of(tmp_path, started)
    victim = fleet.agents[1]
    assert victim.proc is not None
    victim.proc.kill()
    victim.proc.wait(10)
    # Should the death go unnoticed, a stop a minute later ends the watch (and the test).
    unnoticed = threading.Timer(60.0, lambda: setattr(fleet, "stopping", True))
    unnoticed.start()
    try:
        with pytest.raises(UpError) as stopped:
            running._watch(fleet, time.monotonic())
    finally:
        unnoticed.cancel()
    message = str(stopped.value)
    assert message.startswith(f"node-2 exited (log {victim.log_path})")
    assert "node-2 ready" in message  # the tail of its log
    # The others were running and are the fleet's to stop.
    assert [c.name for c in started if c.running] == ["nats", "control", "node-1", "router"]


def test_a_child_that_exits_while_starting_fails_at_once_with_its_log(tmp_path: Path) -> None:
    log = tmp_path / "svc.log"
    # A previous run's ready line in the same log must not count for this run.
    log.write_text("svc ready\n")
    child = Child(
        "svc",
        [sys.executable, "-c", "print('bad config', flush=True); raise SystemExit(3)"],
        log_path=log,
        pid_file=tmp_path / "svc.json",
    )
    child.start()
    began = time.monotonic()
    with pytest.raises(UpError) as failed:
        child.wait_for(r"^svc ready$", 120.0, lambda: False)
    assert time.monotonic() - began < 60  # not the timeout: the exit is noticed
    assert f"svc exited while starting (log {log})" in str(failed.value)
    assert "bad config" in str(failed.value)
    child.stop()


def test_a_stop_while_a_child_starts_ends_the_wait(tmp_path: Path, started: list[Child]) -> None:
    child = Child(
        "slow",
        service_argv("slow", tmp_path / "record", "exit"),
        log_path=tmp_path / "slow.log",
        pid_file=tmp_path / "slow.json",
    )
    child.start()
    started.append(child)
    with pytest.raises(UpError, match="stopped while slow was starting"):
        child.wait_for(r"^never printed$", 120.0, lambda: True)


def test_a_recorded_process_ignoring_sigterm_is_killed(
    tmp_path: Path, started: list[Child]
) -> None:
    child = start(started, tmp_path, "stuck", "ignore")
    assert child.proc is not None
    assert children.stop_recorded(child.pid_file, timeout_s=1.0) == child.pid
    assert child.proc.wait(30) == -signal.SIGKILL
    assert [e for _, e, _ in noted(tmp_path / "record")] == ["term"]


def engine_record(proc: subprocess.Popen[bytes], pgid: int) -> pidfiles.ShardRecord:
    fingerprint = processes.fingerprint(proc.pid)
    assert fingerprint is not None
    return pidfiles.ShardRecord(
        replica_id=f"rep-{proc.pid}",
        generation=1,
        shard=0,
        spec=LaunchSpec(engine="sim", model="m", served_name="m", port=1, gpus=()),
        launch=Launch(argv=fingerprint.cmdline, env={}, port=1, http=False),
        process=fingerprint,
        pgid=pgid,
        log_path="x.log",
        phase="serving",
    )


@pytest.fixture
def sessions() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Stand-ins started in sessions of their own, as engines are; killed afterwards."""
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(name: str, record: Path, on_term: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            service_argv(name, record, on_term), stdout=subprocess.PIPE, start_new_session=True
        )
        procs.append(proc)
        assert proc.stdout is not None
        assert proc.stdout.readline() == f"{name} ready\n".encode()
        return proc

    yield spawn
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_engines_left_by_the_agents_are_stopped_and_stale_files_dropped(
    tmp_path: Path, sessions: Callable[..., subprocess.Popen[bytes]]
) -> None:
    record = tmp_path / "record"
    polite = sessions("polite", record, "exit")
    stuck = sessions("stuck", record, "ignore")
    gone = sessions("gone", record, "exit")
    state_a, state_b = tmp_path / "a" / "state", tmp_path / "b" / "state"
    live = [pidfiles.save(state_a, engine_record(polite, polite.pid))]
    live.append(pidfiles.save(state_b, engine_record(stuck, stuck.pid)))
    stale = pidfiles.save(state_b, engine_record(gone, gone.pid))
    gone.kill()
    gone.wait(10)
    stopped = children.stop_engines([state_a, state_b], timeout_s=1.0)
    assert sorted(stopped) == sorted([polite.pid, stuck.pid])
    assert polite.wait(30) == 0  # SIGTERM, handled
    assert stuck.wait(30) == -signal.SIGKILL  # after the timeout
    assert not [p for p in (*live, stale) if p.exists()]


def test_an_engine_file_naming_another_process_group_signals_nobody(
    tmp_path: Path, sessions: Callable[..., subprocess.Popen[bytes]]
) -> None:
    """A pid file edited by hand to name a bystander's process group: the engine's
    fingerprint holds, but `up` must not signal a group that is not the engine's."""
    record = tmp_path / "record"
    engine = sessions("engine", record, "exit")
    bystander = sessions("bystander", record, "exit")
    state = tmp_path / "state"
    path = pidfiles.save(state, engine_record(engine, bystander.pid))
    assert children.stop_engines([state], timeout_s=1.0) == []
    assert bystander.poll() is None
    assert engine.poll() is None
    assert noted(record) == []
    assert path.exists()  # the agent reports it when it starts (it refuses to adopt it)


def test_a_new_run_stops_what_the_last_one_left_but_not_the_up_holding_the_lock(
    tmp_path: Path, started: list[Child]
) -> None:
    plan = Plan(layout=Layout(tmp_path / "state"), nodes=1, port=free_port())
    plan.layout.make()
    record = tmp_path / "record"
    # A router the last run left, and the `up` that holds the directory now.
    for name, pid_file in (
        ("router", plan.layout.pid_file("router")),
        ("up", plan.layout.up_pid_file),
    ):
        child = Child(
            name, service_argv(name, record, "exit"), log_path=tmp_path / name, pid_file=pid_file
        )
        child.start()
        started.append(child)
        child.wait_for(rf"^{name} ready$", 60.0, lambda: False)
    leftover, holder = started
    out = io.StringIO()
    running.Fleet(plan, out, tty=False).clean_up_previous()
    assert leftover.proc is not None
    assert leftover.proc.wait(30) == 0  # SIGTERM, handled
    assert f"stopped what a previous run left running: router (pid {leftover.pid})" in (
        out.getvalue()
    )
    assert holder.running
    assert plan.layout.up_pid_file.exists()
    assert [(n, e) for n, e, _ in noted(record)] == [("router", "term")]

"""What the supervisor must not trust: a pid file edited by hand (or left by a state folder
that moved) must not make the agent signal, trim or delete what is not its engine's, and an
engine's relative file names must not resolve against the agent's own working folder."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from llmgw import pidfiles, processes
from llmgw.agent.engines import Launch, policy
from llmgw.agent.supervisor import Settings, Supervisor
from llmgw.core.profile import LaunchSpec

SPEC = LaunchSpec(engine="sim", model="m", served_name="m", port=1, gpus=())


@pytest.fixture
def sleepers() -> Iterator[tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]]:
    """An engine and a bystander, each in its own process group (as engines are)."""
    engine = subprocess.Popen(["sleep", "300"], start_new_session=True)
    bystander = subprocess.Popen(["sleep", "301"], start_new_session=True)
    yield engine, bystander
    for proc in (engine, bystander):
        proc.kill()
        proc.wait()


def _record(engine_pid: int, *, pgid: int, log_path: Path) -> pidfiles.ShardRecord:
    fingerprint = processes.fingerprint(engine_pid)
    assert fingerprint is not None
    return pidfiles.ShardRecord(
        replica_id="rep",
        generation=1,
        shard=0,
        spec=SPEC,
        launch=Launch(argv=fingerprint.cmdline, env={}, port=1, http=False),
        process=fingerprint,
        pgid=pgid,
        log_path=str(log_path),
        phase="serving",
    )


async def test_a_pid_file_naming_another_process_group_is_not_adopted(
    tmp_path: Path, sleepers: tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]
) -> None:
    """Before: adopted, and a stop sent SIGTERM to the bystander's whole group."""
    engine, bystander = sleepers
    state = tmp_path / "state"
    pidfiles.save(state, _record(engine.pid, pgid=bystander.pid, log_path=tmp_path / "x.log"))
    supervisor = Supervisor(Settings(state_dir=str(state), poll_s=0.1))
    try:
        (result,) = await supervisor.adopt()
        assert not result.adopted
        assert f"process group {bystander.pid}" in result.reason
        await supervisor.stop("rep", grace_s=1)
    finally:
        await supervisor.close()
    assert bystander.poll() is None  # never signalled
    assert engine.poll() is None


async def test_an_adopted_engine_never_trims_or_deletes_a_file_outside_its_logs(
    tmp_path: Path, sleepers: tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]
) -> None:
    """Before: the record's log_path was trusted, and stopping the engine deleted it."""
    engine, _ = sleepers
    state = tmp_path / "state"
    precious = tmp_path / "precious.txt"
    precious.write_text("not an engine's output\n")
    pidfiles.save(state, _record(engine.pid, pgid=engine.pid, log_path=precious))
    supervisor = Supervisor(Settings(state_dir=str(state), poll_s=0.1))
    try:
        (result,) = await supervisor.adopt()
        assert result.adopted
        stopped = await supervisor.stop("rep", grace_s=5)
        assert stopped is not None
        assert stopped.phase == "stopped"
    finally:
        await supervisor.close()
    assert precious.read_text() == "not an engine's output\n"


async def test_an_engine_does_not_resolve_hugging_face_ids_against_the_agents_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launch policy admits `org/name` as a Hugging Face id, but an engine opens it as a
    file when it exists relative to its working folder. Before, that was the agent's (`/`
    under systemd): `--chat-template etc/x.jinja` read a file outside launch.file_dirs."""
    agent_cwd = tmp_path / "agent-cwd"
    (agent_cwd / "org").mkdir(parents=True)
    (agent_cwd / "org" / "template.jinja").write_text("{{ secret }}")
    monkeypatch.chdir(agent_cwd)
    assert not policy.args_problems(
        policy.LaunchPolicy(), "sglang", ["--chat-template", "org/template.jinja"]
    )
    supervisor = Supervisor(Settings(state_dir=str(tmp_path / "state"), poll_s=0.1))
    try:
        launch = Launch(argv=("sleep", "300"), env={}, port=1, http=False)
        view = await supervisor.start("rep", 1, 0, SPEC, launch)
        assert view.pid is not None
        engine_cwd = Path(os.readlink(f"/proc/{view.pid}/cwd"))
        assert not (engine_cwd / "org" / "template.jinja").exists()
    finally:
        await supervisor.stop_all(grace_s=1)
        await supervisor.close()


async def test_an_unreadable_pid_file_is_set_aside_not_deleted(
    tmp_path: Path, sleepers: tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]
) -> None:
    """Before: a pid file that did not decode (a hand edit's typo, a newer agent's fields)
    was deleted, and with it the only record of the engine it names, which runs on
    unsupervised; the warning did not say so. Now it is kept aside and the log says what
    to do."""
    engine, _ = sleepers
    state = tmp_path / "state"
    path = pidfiles.save(state, _record(engine.pid, pgid=engine.pid, log_path=tmp_path / "x"))
    damaged = path.read_bytes()[:-1]  # one character lost to an editor
    path.write_bytes(damaged)
    with structlog.testing.capture_logs() as logged:
        (result,) = await Supervisor(Settings(state_dir=str(state))).adopt()
    assert (result.adopted, result.reason) == (False, "unreadable")
    assert not path.exists()  # the next start does not report it again
    aside = path.with_name(path.name + ".unreadable")
    assert aside.read_bytes() == damaged
    (warning,) = [e for e in logged if e["event"] == "pid_file_unreadable"]
    assert warning["moved_to"] == str(aside)
    assert "stop it by hand" in warning["detail"]

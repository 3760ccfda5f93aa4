"""Pid files on a disk that refuses, beside leftovers of a crash, and set aside: a record
is replaced whole, holds the engine's key for its owner alone, and a file that cannot be
read is moved out of the way, never deleted, never read again as a record."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import msgspec
import structlog

from llmgw import pidfiles, processes
from llmgw.agent.engines import Launch
from llmgw.core.profile import LaunchSpec


def _record(generation: int = 1) -> pidfiles.ShardRecord:
    fingerprint = processes.fingerprint(os.getpid())
    assert fingerprint is not None
    return pidfiles.ShardRecord(
        replica_id="rep",
        generation=generation,
        shard=0,
        spec=LaunchSpec(engine="sim", model="m", served_name="m", port=1, gpus=()),
        launch=Launch(argv=("engine",), env={"API_KEY": "secret"}, port=1, http=False),
        process=fingerprint,
        pgid=fingerprint.pid,
        log_path="engine.log",
    )


def test_a_record_saved_over_a_leftover_open_copy_is_the_owners_alone(tmp_path: Path) -> None:
    path = pidfiles.path_for(tmp_path, "rep", 0)
    path.parent.mkdir(parents=True)
    leftover = path.with_suffix(f".tmp{os.getpid()}")  # a crash between write and rename
    leftover.write_bytes(b"x" * 10_000)
    leftover.chmod(0o644)
    assert pidfiles.save(tmp_path, _record()) == path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    ((_, loaded),) = pidfiles.load_all(tmp_path)
    assert loaded == _record()


def test_a_record_the_disk_refuses_is_not_kept_and_no_copy_with_the_key_stays(
    tmp_path: Path,
) -> None:
    path = pidfiles.path_for(tmp_path, "rep", 0)
    (path / "blocker").mkdir(parents=True)  # the rename cannot replace a folder
    captured = structlog.testing.LogCapture()
    structlog.configure(processors=[captured])
    assert pidfiles.keep(tmp_path, _record()) is False
    assert [e["event"] for e in captured.entries] == ["pidfile_not_saved"]
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


_REFUSED = """
import msgspec, resource, signal, sys
from pathlib import Path
from llmgw import pidfiles
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
record = msgspec.json.decode(sys.stdin.buffer.read(), type=pidfiles.ShardRecord)
resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100))
print(pidfiles.keep(Path(sys.argv[1]), record))
"""


def test_a_full_disk_leaves_the_previous_record_whole(tmp_path: Path) -> None:
    """The disk refuses as a full one does (files may not grow past 100 bytes)."""
    path = pidfiles.save(tmp_path, _record(generation=1))
    before = path.read_bytes()
    out = subprocess.run(
        [sys.executable, "-c", _REFUSED, str(tmp_path)],
        input=msgspec.json.encode(_record(generation=2)),
        capture_output=True,
        timeout=60,
    )
    said, kept = out.stdout.splitlines()  # the log line, then what `keep` answered
    assert b"pidfile_not_saved" in said, out.stderr
    assert kept == b"False"
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


def test_an_unreadable_file_is_set_aside_whole_and_never_read_again(tmp_path: Path) -> None:
    pidfiles.save(tmp_path, _record())
    bad = tmp_path / "shards" / "other.0.json"
    bad.write_bytes(b'{"pid": 1234')  # cut short
    (tmp_path / "shards" / "rep.0.tmp999").write_bytes(b"{}")  # another agent's leftover
    records = pidfiles.load_all(tmp_path)
    assert [(p.name, r is None) for p, r in records] == [
        ("other.0.json", True),
        ("rep.0.json", False),
    ]
    pidfiles.set_aside(bad)
    assert not bad.exists()
    assert bad.with_name("other.0.json.unreadable").read_bytes() == b'{"pid": 1234'
    assert [p.name for p, _ in pidfiles.load_all(tmp_path)] == ["rep.0.json"]


def test_a_record_of_the_wrong_shape_is_reported_not_fatal(tmp_path: Path) -> None:
    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "rep.0.json").write_bytes(b'{"replica_id": 7}')
    assert pidfiles.load_all(tmp_path) == [(folder / "rep.0.json", None)]


def test_removing_a_record_that_is_gone_is_fine(tmp_path: Path) -> None:
    pidfiles.save(tmp_path, _record())
    pidfiles.remove(tmp_path, "rep", 0)
    pidfiles.remove(tmp_path, "rep", 0)
    assert pidfiles.load_all(tmp_path) == []

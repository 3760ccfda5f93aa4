"""Pid files: what a restarted agent needs to find, check and adopt its running engines.

One JSON file per shard under `<state_dir>/shards/`, written atomically
(temporary file + rename) so a crash never leaves half a record. It holds the
process fingerprint, the LaunchSpec and Launch (with the engine's API key, so the
file is mode 0600), and where the output goes.
Used by `llmgw.agent.supervisor`, and by `llmgw.up` to stop what a previous run left.
Outside the agent because both shells read it, and shells never import each other.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import msgspec

from llmgw import logs
from llmgw.agent.engines.common import Launch
from llmgw.core.events import ShardPhase
from llmgw.core.profile import LaunchSpec
from llmgw.processes import Fingerprint

log = logs.get("llmgw.pidfiles")


class ShardRecord(msgspec.Struct, frozen=True, kw_only=True):
    replica_id: str
    generation: int
    shard: int
    spec: LaunchSpec
    launch: Launch
    process: Fingerprint
    pgid: int
    log_path: str
    phase: ShardPhase = "starting"
    started_at: float = 0.0
    """Wall clock (UNIX seconds) of the spawn."""


_decoder = msgspec.json.Decoder(ShardRecord)


def path_for(state_dir: Path, replica_id: str, shard: int) -> Path:
    # replica ids pass subjects.check_token upstream; keep the name safe regardless.
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in replica_id)
    return state_dir / "shards" / f"{safe}.{shard}.json"


def log_path_for(state_dir: Path, replica_id: str, shard: int, generation: int) -> Path:
    """Where a shard's engine writes its output: `<state_dir>/logs/`, one file per generation."""
    return path_for(state_dir / "logs", replica_id, shard).with_suffix(f".g{generation}.log")


def foreign_group(record: ShardRecord) -> str:
    """Why `record` names a process group that is not its engine's; empty when it does.

    Engines lead their own group (started in a new session), so the group is the engine's
    pid. A file edited by hand may name another: stopping the engine would signal it."""
    if record.pgid == record.process.pid:
        return ""
    return (
        f"the pid file names process group {record.pgid}, not the engine's "
        f"({record.process.pid}): it was edited; stop the engine by hand if it still runs"
    )


def with_own_log(state_dir: Path, record: ShardRecord) -> ShardRecord:
    """`record` with the output file this agent would have given it: the agent trims and
    deletes that file, so a path edited by hand (or from a state folder that moved) must
    not name another."""
    own = str(log_path_for(state_dir, record.replica_id, record.shard, record.generation))
    return record if record.log_path == own else msgspec.structs.replace(record, log_path=own)


def save(state_dir: Path, record: ShardRecord) -> Path:
    path = path_for(state_dir, record.replica_id, record.shard)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        # Created 0600 rather than chmod-ed after: the key is never readable by others.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            os.fchmod(out.fileno(), 0o600)  # a leftover temporary file keeps its old mode
            out.write(msgspec.json.encode(record))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()  # a partial copy (with the engine's key) is of no use to anyone
        raise
    return path


def keep(state_dir: Path, record: ShardRecord) -> bool:
    """`save`, or False (said in the log) when the disk refuses: the engine runs already,
    and an error here would leave it unsupervised (its exit never reported, never stopped).
    The next phase change writes the record again."""
    try:
        save(state_dir, record)
    except OSError as exc:
        log.error(
            "pidfile_not_saved",
            replica_id=record.replica_id,
            pid=record.process.pid,
            error=str(exc),
            detail="the engine runs and is supervised, but an agent restarted now would "
            f"not adopt it; free space in {state_dir}",
        )
        return False
    return True


def remove(state_dir: Path, replica_id: str, shard: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        path_for(state_dir, replica_id, shard).unlink()


def set_aside(path: Path) -> None:
    """Move a pid file that does not decode out of the way (`<name>.unreadable`), saying so.

    Not deleted: it is the only record of the engine it names (pid, process group),
    which no agent can adopt now and which may still run and hold its GPUs."""
    aside = path.with_name(path.name + ".unreadable")
    with contextlib.suppress(OSError):
        os.replace(path, aside)
    log.warning(
        "pid_file_unreadable",
        path=str(path),
        moved_to=str(aside),
        detail="the agent cannot adopt the engine it names: if that engine still runs, "
        "stop it by hand (the file holds its pid and process group), then delete the file",
    )


def load_all(state_dir: Path) -> list[tuple[Path, ShardRecord | None]]:
    """Every pid file, decoded; None for one that does not decode (it is reported, not fatal)."""
    folder = state_dir / "shards"
    if not folder.is_dir():
        return []
    out: list[tuple[Path, ShardRecord | None]] = []
    for path in sorted(folder.glob("*.json")):
        try:
            out.append((path, _decoder.decode(path.read_bytes())))
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            out.append((path, None))
    return out

"""The command ledger: what the agent has already done about each shard, kept across restarts.

Commands arrive at least once: redelivered after a reconnect, re-read after an
agent restart, or sent by a deposed leader that still believes it leads. The
ledger makes applying them idempotent by replica id and generation:

- a StartShard of a generation already started (or ended) never restarts a shard;
- a StopShard of an older generation than the one running does not stop the new one;
- a command from a leader epoch lower than the highest seen is ignored (a stale
  leader's decision, published before the server's fence caught it);
- a command from an epoch higher than the leader lease shows is refused (no leader
  could have sent it: the current holder's epoch is the highest there is), and never
  raises the epoch kept here, so it cannot make the agent ignore the real leader;
  an epoch on disk that no lease could have had is dropped when the ledger is read;
- `last_seq` is the stream sequence up to which every command's effect is
  recorded: a restarted agent reads its commands from there, so a command sent
  while it was away still runs, and one already applied is not re-read.

`decide`, `stale_epoch`, `lease_epoch` and `sanitize` are purely computational;
`load` / `save` keep the ledger as one JSON file in the state dir, written
atomically. Used by `llmgw.agent.service`.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import msgspec

from llmgw import logs
from llmgw.agent.shards import LIVE, ShardView
from llmgw.core import events

Action = Literal["start", "stop", "drain", "report_stopped", "ignore"]

MAX_SHARDS_KEPT = 10_000

MAX_EPOCH = 2**40
"""No lease gets near this: an epoch is a sequence of the lease bucket's stream, which
grows by one per acquisition or renewal (a few per minute). More on disk is garbage."""
MAX_SEQ = 2**63 - 1
MAX_GENERATION = 2**53

log = logs.get("llmgw.agent.ledger")


class Applied(msgspec.Struct, kw_only=True):
    """The highest generations of one shard this agent started and saw end."""

    started: int = 0
    ended: int = 0
    updated: float = 0.0
    """Wall clock of the last change: the oldest entries go first when the ledger is full."""


class Ledger(msgspec.Struct, kw_only=True):
    last_seq: int = 0
    """Every command at or below this stream sequence has had its effect recorded."""
    epoch: int = 0
    """The highest leader epoch seen on a command."""
    shards: dict[str, Applied] = {}


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    action: Action
    reason: str = ""


def key(replica_id: str, shard: int) -> str:
    return f"{replica_id}/{shard}"


def stale_epoch(cmd: events.Command, highest: int) -> str:
    """Why `cmd` comes from a deposed leader, or "" when its epoch is current.

    Checked in stream order as commands arrive (the ledger's `epoch` then rises to
    the command's). Purely computational, no side effects.
    """
    if cmd.epoch < highest:
        return f"from leader epoch {cmd.epoch}, older than the {highest} already seen"
    return ""


class _LeaseValue(msgspec.Struct):
    holder: str = ""
    epoch: int = 0


LEASE_MARKERS = ("KV-Operation", "Nats-Marker-Reason")
"""Headers of a lease entry that is a delete, purge or expiry marker: no holder."""


def lease_epoch(seq: int, data: bytes | None, headers: dict[str, str] | None) -> int | None:
    """The epoch of the lease entry stored at `seq`, or None when it names no holder.

    As `llmgw.bus.lease` writes it: the acquiring write carries epoch 0 (its epoch is
    its own sequence), renewals carry the epoch. Purely computational, no side effects.
    """
    if any(h in (headers or {}) for h in LEASE_MARKERS) or not data:
        return None
    try:
        value = msgspec.json.decode(data, type=_LeaseValue)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    epoch = value.epoch or seq
    return epoch if epoch > 0 else None


def beyond_lease(cmd: events.Command, lease: int) -> str:
    """Why `cmd` cannot come from any leader, or "" when its epoch is within the lease's.

    The lease's current holder has the highest epoch there is. Purely computational.
    """
    if cmd.epoch > lease:
        shown = f"epoch {lease}" if lease else "no epoch yet"
        return f"from leader epoch {cmd.epoch}, beyond the leader lease ({shown})"
    return ""


def sanitize(ledger: Ledger) -> list[str]:
    """Drop what no real ledger holds (garbage on disk); what was dropped, one line each.

    Purely computational: changes `ledger` in place.
    """
    problems = []
    if not 0 <= ledger.epoch <= MAX_EPOCH:
        problems.append(f"epoch {ledger.epoch} is not a leader epoch: reset to 0")
        ledger.epoch = 0
    if not 0 <= ledger.last_seq <= MAX_SEQ:
        problems.append(
            f"last_seq {ledger.last_seq} is not a stream sequence: commands are re-read "
            "from the start (applied idempotently)"
        )
        ledger.last_seq = 0
    for k, entry in list(ledger.shards.items()):
        if not (
            0 <= entry.started <= MAX_GENERATION
            and 0 <= entry.ended <= MAX_GENERATION
            and math.isfinite(entry.updated)
        ):
            problems.append(f"shard {k}: generations {entry.started}/{entry.ended}: dropped")
            del ledger.shards[k]
    return problems


def decide(cmd: events.Command, ledger: Ledger, live: ShardView | None) -> Decision:
    """What to do with `cmd`, given the ledger and the shard as the supervisor has it now.

    The epoch is not checked here (see `stale_epoch`). Purely computational, no
    side effects; the service acts and then records.
    """
    applied = ledger.shards.get(key(cmd.replica_id, cmd.shard), Applied())
    running = live if live is not None and live.phase in LIVE else None
    g = cmd.generation
    match cmd:
        case events.StartShard():
            if running is not None and running.generation >= g:
                return Decision(
                    action="ignore", reason=f"generation {running.generation} already runs"
                )
            if applied.started >= g or applied.ended >= g:
                return Decision(
                    action="ignore",
                    reason=f"generation {g} was already started (highest started "
                    f"{applied.started}, ended {applied.ended})",
                )
            return Decision(action="start")
        case events.StopShard():
            if running is not None:
                if running.generation <= g:
                    return Decision(action="stop")
                return Decision(
                    action="ignore",
                    reason=f"stale: generation {running.generation} runs, the stop is for {g}",
                )
            if applied.ended >= g:
                return Decision(action="ignore", reason=f"generation {g} already ended")
            # Nothing runs: say so, so that the control plane can free the slot.
            return Decision(action="report_stopped")
        case events.DrainShard():
            if running is not None and running.generation == g:
                if running.phase == "serving":
                    return Decision(action="drain")
                return Decision(action="ignore", reason=f"the shard is {running.phase}")
            return Decision(action="ignore", reason=f"generation {g} does not run here")
    return Decision(action="ignore", reason=f"unknown command {type(cmd).__name__}")


def superseded(cmd: events.Command, later: Sequence[events.Command], epoch: int) -> bool:
    """True when a StartShard is undone by a command after it in the same backlog.

    An agent back from an outage reads its backlog at once; starting an engine
    (minutes of loading, for a real one) only to stop it at the next command is
    waste. Purely computational, no side effects.
    """
    if not isinstance(cmd, events.StartShard):
        return False
    for other in later:
        if other.replica_id != cmd.replica_id or other.shard != cmd.shard:
            continue
        if other.epoch < max(epoch, cmd.epoch):
            continue
        if isinstance(other, events.StopShard) and other.generation >= cmd.generation:
            return True
        if isinstance(other, events.StartShard) and other.generation > cmd.generation:
            return True
    return False


def successors(batch: Sequence[object]) -> list[list[events.Command]]:
    """For each event of a batch, the commands on its shard after it in the batch.

    What may supersede a start (`superseded`); an event that is no command has none.
    Purely computational, no side effects.
    """
    per_shard: dict[str, list[events.Command]] = {}
    for ev in batch:
        if isinstance(ev, events.Command):
            per_shard.setdefault(key(ev.replica_id, ev.shard), []).append(ev)
    position: dict[str, int] = {}
    out: list[list[events.Command]] = []
    for ev in batch:
        later: list[events.Command] = []
        if isinstance(ev, events.Command):
            k = key(ev.replica_id, ev.shard)
            p = position.get(k, 0)
            position[k] = p + 1
            later = per_shard[k][p + 1 :]
        out.append(later)
    return out


def note_started(ledger: Ledger, replica_id: str, shard: int, generation: int, now: float) -> None:
    entry = ledger.shards.setdefault(key(replica_id, shard), Applied())
    entry.started = max(entry.started, generation)
    entry.updated = now
    _prune(ledger)


def note_ended(ledger: Ledger, replica_id: str, shard: int, generation: int, now: float) -> None:
    entry = ledger.shards.setdefault(key(replica_id, shard), Applied())
    entry.ended = max(entry.ended, generation)
    entry.updated = now
    _prune(ledger)


def _prune(ledger: Ledger) -> None:
    """Keep the ledger bounded: forget the shards untouched for the longest time."""
    excess = len(ledger.shards) - MAX_SHARDS_KEPT
    if excess <= 0:
        return
    oldest = sorted(ledger.shards.items(), key=lambda kv: kv[1].updated)[:excess]
    for k, _ in oldest:
        del ledger.shards[k]


_decoder = msgspec.json.Decoder(Ledger)


class LedgerUnreadable(RuntimeError):
    """The ledger file exists but does not decode; the message says what to do."""


def path_in(state_dir: str | Path) -> Path:
    return Path(state_dir) / "commands.json"


def load(state_dir: str | Path) -> Ledger:
    """The saved ledger, or an empty one when there is none yet."""
    path = path_in(state_dir)
    try:
        ledger = _decoder.decode(path.read_bytes())
    except FileNotFoundError:
        return Ledger()
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise LedgerUnreadable(
            f"{path} is corrupt ({exc}): move it aside and restart the agent; it will re-read "
            "this node's commands from the start of the log (applied idempotently)"
        ) from None
    for problem in sanitize(ledger):
        log.warning("ledger_garbage", path=str(path), detail=problem)
    return ledger


def load_or_set_aside(state_dir: str | Path, now: float) -> Ledger:
    """`load`, or, for a ledger that does not decode, an empty one after moving the file
    aside (`commands.json.corrupt-<now>`). Starting is better than refusing: re-reading
    every command of the node is idempotent (generations, and the backlog's superseded
    starts are skipped)."""
    try:
        return load(state_dir)
    except LedgerUnreadable as exc:
        path = path_in(state_dir)
        aside = path.with_name(f"{path.name}.corrupt-{int(now)}")
        with contextlib.suppress(OSError):
            os.replace(path, aside)
        log.error("ledger_unreadable", detail=str(exc), moved_to=str(aside))
        return Ledger()


def save(state_dir: str | Path, ledger: Ledger) -> bool:
    """Write the ledger atomically; False (said in the log) when the disk refuses.

    Never raises for the disk: the save follows an action already taken (an engine
    spawned, a status queued), and raising there reported a running engine as failed.
    The ledger in memory stays right; only a restart before a later save succeeds
    re-reads commands from the older sequence on disk.
    """
    path = path_in(state_dir)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(msgspec.json.encode(ledger))
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()  # a partial copy would only take what room is left
        log.error(
            "ledger_not_saved",
            path=str(path),
            error=str(exc),
            detail="the agent goes on from the ledger in memory; free space (or fix the "
            "folder's permissions) before the agent restarts, else it re-reads commands "
            f"after the sequence last saved instead of {ledger.last_seq}",
        )
        return False
    return True

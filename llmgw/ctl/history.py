"""Rebuilding the cluster as it was at any point of the log: newest snapshot + tail.

`rebuild(nc, to_seq=..., at=...)` finds the newest snapshot at or before the target
in `llmgw-snapshots`, folds the records after it up to the target with the same
`llmgw.core.state.apply` the control plane runs, and returns the state with what it
took to get there (which snapshot, how many events, what the fold refused, what
did not decode). Every read view of `llmgw ctl` (nodes, replicas, models, explain,
cordon's checks) is `rebuild()` to the end of the log; `replay` passes a target.

Points in the log are sequences or times (the server's store time of each record).
A time is turned into a sequence with one direct-get of the first message stored at
or after it, so that a snapshot can be chosen before anything is read.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import nats.errors
import nats.js.errors

from llmgw import bus
from llmgw.core import attestation, state, subjects
from llmgw.ctl.errors import BadInput, Failed

_API = "$JS.API"

Progress = Callable[[int, int], None]
"""Called with (records folded, records to fold) while a rebuild reads the log."""


class Bounds(msgspec.Struct, frozen=True):
    """What the stream holds now: first and last sequences and their store times."""

    first_seq: int
    last_seq: int
    first_time: float
    last_time: float
    messages: int


class Rebuilt(msgspec.Struct, kw_only=True):
    state: state.ClusterState
    target_seq: int
    """Last sequence folded in (the target, or the last record at or before `at`)."""
    at: float | None
    """The time asked for, or the store time of the last record folded."""
    snapshot_seq: int
    """Sequence of the snapshot the fold started from; 0: from the beginning."""
    folded: int
    elapsed_s: float
    rejected: list[tuple[int, str]]
    skipped: list[bus.Skipped]
    bounds: Bounds


# --------------------------------------------------------------------------- points


_RELATIVE = re.compile(r"(\d+(?:\.\d+)?)\s*(s|m|h|d)(?:\s*ago)?", re.ASCII)
_TIME_OF_DAY = re.compile(r"([01]?\d|2[0-3]):([0-5]\d)(?::([0-5]\d(?:\.\d+)?))?Z?", re.ASCII)
_LAST_TIME = 253402300799.0
"""9999-12-31T23:59:59Z: the last time a point may name (and `format_time` can print)."""
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_time(text: str, now: float) -> float:
    """UNIX seconds from `2026-11-29T03:12:00Z`, `@1764386000`, `10m` / `2h ago`, or a time
    of day `03:12` (UTC, as ctl prints times: the latest 03:12 at or before `now`), between
    1970 and the year 9999; BadInput for anything else (a caller's text: never another
    exception). Pure."""
    when = _parsed_time(text, now)
    if when is None or not 0.0 <= when <= _LAST_TIME:  # NaN fails both comparisons
        raise BadInput(
            f"cannot read {text[:40]!r} as a time: use ISO 8601 (2026-11-29T03:12:00Z), a time of "
            "day in UTC (03:12, the latest one), @UNIX-SECONDS, or an age such as 10m or 2h, "
            "between 1970 and the year 9999"
        )
    return when


def _parsed_time(text: str, now: float) -> float | None:
    raw = text.strip()
    if raw.startswith("@"):
        try:
            return float(raw[1:])
        except ValueError:
            pass
    else:
        rel = _RELATIVE.fullmatch(raw)
        if rel:
            return now - float(rel.group(1)) * _UNITS[rel.group(2)]
        clock = _TIME_OF_DAY.fullmatch(raw)
        if clock:
            hour, minute, second = clock.groups()
            day = dt.datetime.fromtimestamp(now, dt.UTC).replace(
                hour=0, minute=0, second=0, microsecond=0
            )
            offset = int(hour) * 3600 + int(minute) * 60 + float(second or 0)
            when_s = day.timestamp() + offset
            return when_s if when_s <= now else when_s - 86400.0
        try:
            when = dt.datetime.fromisoformat(raw.replace("Z", "+00:00").replace(" ", "T", 1))
        except ValueError:
            pass
        else:
            if when.tzinfo is None:
                when = when.replace(tzinfo=dt.UTC)
            return when.timestamp()
    return None


class Point(msgspec.Struct, frozen=True):
    """A point of the log: a sequence, or a time."""

    seq: int | None = None
    time: float | None = None

    def describe(self) -> str:
        if self.seq is not None:
            return f"seq {self.seq}"
        assert self.time is not None
        return format_time(self.time)


def parse_point(text: str, now: float) -> Point:
    """`1234` (a sequence) or anything `parse_time` reads. Pure."""
    raw = text.strip()
    if raw.isascii() and raw.isdigit():  # "²" is a digit to str.isdigit, not to int
        if len(raw) > 20:
            raise BadInput(f"{raw[:24]}... is no sequence: a stream's are at most 20 digits")
        return Point(seq=int(raw))
    return Point(time=parse_time(raw, now))


def format_time(ts: float) -> str:
    return (
        dt.datetime.fromtimestamp(ts, dt.UTC)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z")
    )


def _parse_server_time(text: str) -> float:
    """The server's RFC 3339 times carry nanoseconds; datetime reads at most microseconds."""
    if not text or text.startswith("0001-01-01"):
        return 0.0
    m = re.fullmatch(r"(.*?T\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", text)
    if not m:
        return 0.0
    base, frac, zone = m.groups()
    when = dt.datetime.fromisoformat(base + ("+00:00" if zone == "Z" else zone))
    return when.timestamp() + (float("0." + frac) if frac else 0.0)


# --------------------------------------------------------------------------- the stream


async def _api(nc: bus.BusClient, subject: str, payload: dict[str, Any] | None) -> Any:
    body = json.dumps(payload).encode() if payload is not None else b""
    try:
        msg = await nc.request(f"{_API}.{subject}", body, timeout=5.0)
    except (TimeoutError, nats.errors.Error) as exc:
        raise Failed(
            f"no answer from JetStream to {subject}: {str(exc) or type(exc).__name__}; check "
            f"that the stream {subjects.STREAM} is provisioned (run `llmgw control` once) and "
            "that this certificate may read it"
        ) from None
    return json.loads(msg.data) if msg.data else {}


async def bounds(nc: bus.BusClient) -> Bounds:
    resp = await _api(nc, f"STREAM.INFO.{subjects.STREAM}", None)
    if "error" in resp:
        raise Failed(
            f"cannot read the stream {subjects.STREAM}: {resp['error'].get('description')}; "
            "provision it by running `llmgw control` once"
        )
    st = resp.get("state", {})
    return Bounds(
        first_seq=int(st.get("first_seq", 0)),
        last_seq=int(st.get("last_seq", 0)),
        first_time=_parse_server_time(st.get("first_ts", "")),
        last_time=_parse_server_time(st.get("last_ts", "")),
        messages=int(st.get("messages", 0)),
    )


async def first_seq_at_or_after(nc: bus.BusClient, when: float) -> int | None:
    """Sequence of the first message stored at or after `when`; None if there is none."""
    start = dt.datetime.fromtimestamp(when, dt.UTC).isoformat().replace("+00:00", "Z")
    resp = await _api(nc, f"STREAM.MSG.GET.{subjects.STREAM}", {"start_time": start})
    if "error" in resp:
        if resp["error"].get("code") == 404:
            return None
        # A server that does not know `start_time` (it came with nats-server 2.11):
        # search by sequence instead.
        return await search_seq_at_or_after(nc, when)
    return int(resp["message"]["seq"])


async def _message_at_or_after(nc: bus.BusClient, seq: int) -> tuple[int, float] | None:
    """(sequence, store time) of the first message at or after `seq` (gaps: expired ones)."""
    resp = await _api(nc, f"STREAM.MSG.GET.{subjects.STREAM}", {"seq": seq, "next_by_subj": ">"})
    if "error" in resp:
        if resp["error"].get("code") == 404:
            return None
        raise Failed(f"cannot read the log at seq {seq}: {resp['error'].get('description')}")
    msg = resp["message"]
    return int(msg["seq"]), _parse_server_time(msg.get("time", ""))


HEARTBEATS = f"{subjects.EVENTS_ROOT}.node.*.heartbeat"


async def oldest_heartbeat(nc: bus.BusClient, first_seq: int) -> float | None:
    """Store time of the oldest heartbeat the log still holds; None when it holds none."""
    resp = await _api(
        nc,
        f"STREAM.MSG.GET.{subjects.STREAM}",
        {"seq": max(first_seq, 1), "next_by_subj": HEARTBEATS},
    )
    if "error" in resp:
        if resp["error"].get("code") == 404:
            return None
        raise Failed(f"cannot read the log's heartbeats: {resp['error'].get('description')}")
    return _parse_server_time(resp["message"].get("time", ""))


def without_expired_heartbeats(rows: list[dict[str, Any]], horizon: float | None) -> int:
    """Unset the heartbeat age of every node row whose newest heartbeat, as replayed, is
    older than the oldest heartbeat the log still holds (`horizon`; None: it holds none).

    Heartbeats expire from the log (per-message TTL), so replaying a moment from before
    the horizon finds none of the heartbeats of that moment: the node's last sign of life
    is then its registration, and an age counted from it says how long ago the node
    registered, not when it last reported. Such an age is unknown, and said so
    (`heartbeat_expired`). Returns how many rows were changed. Pure.
    """
    changed = 0
    for row in rows:
        seen = row.get("last_seen")
        if seen is not None and (horizon is None or seen < horizon):
            row["heartbeat_age_s"] = None
            row["heartbeat_expired"] = True
            changed += 1
    return changed


async def search_seq_at_or_after(nc: bus.BusClient, when: float) -> int | None:
    """`first_seq_at_or_after` by binary search over sequences: ~log2(messages) requests."""
    b = await bounds(nc)
    lo, hi, found = b.first_seq, b.last_seq, None
    while lo <= hi:
        mid = (lo + hi) // 2
        got = await _message_at_or_after(nc, mid)
        if got is None:
            hi = mid - 1
            continue
        seq, stored = got
        if stored >= when:
            found, hi = seq, mid - 1
        else:
            lo = seq + 1
    return found


# --------------------------------------------------------------------------- reading


async def records(
    nc: bus.BusClient,
    *,
    after_seq: int = 0,
    to_seq: int | None = None,
    since: float | None = None,
    follow: bool = False,
) -> AsyncIterator[list[bus.Record]]:
    """Batches of records after `after_seq` (or from `since`) up to `to_seq` (inclusive)."""
    reader = bus.Reader(
        nc,
        after_seq=after_seq,
        since=since,
        follow=follow,
        name="ctl",
        batch=20_000,
        attestations=await bus.load_attestations(nc, after_seq=after_seq),
    )
    async with reader:
        async for batch in reader.batches():
            if to_seq is not None and batch[-1].seq > to_seq:
                batch = [r for r in batch if r.seq <= to_seq]
                if batch:
                    yield batch
                return
            yield batch
            if to_seq is not None and batch[-1].seq >= to_seq:
                return


async def _load_snapshot(
    nc: bus.BusClient, at_or_before: int
) -> tuple[int, state.ClusterState] | None:
    try:
        store = await bus.SnapshotStore.open(nc.jetstream())
        snap = await store.load(at_or_before=at_or_before)
    except (RuntimeError, nats.errors.Error, nats.js.errors.Error, TimeoutError):
        return None  # no store (or not readable): fold from the beginning
    if snap is None:
        return None
    try:
        return snap.seq, state.decode_snapshot(snap.data)
    except ValueError:
        return None


async def rebuild(
    nc: bus.BusClient,
    *,
    to_seq: int | None = None,
    at: float | None = None,
    use_snapshots: bool = True,
    progress: Progress | None = None,
    attested: attestation.Attestations | None = None,
) -> Rebuilt:
    """The cluster state at `to_seq`, at time `at`, or now; BadInput for a point outside the log.
    `attested`: the log's attestations, when the caller keeps them (the console): read
    from the log otherwise, every time."""
    started = time.perf_counter()
    b = await bounds(nc)
    if to_seq is not None and at is not None:
        raise BadInput("give --to SEQ or --at TIME, not both")
    target = await _target(nc, b, to_seq, at)
    start_seq, st = 0, state.ClusterState()
    if use_snapshots and target > 0:
        snap = await _load_snapshot(nc, target if at is None else max(target - 1, 0))
        if snap is not None:
            start_seq, st = snap
    tail = _Tail()
    if target > start_seq:
        await _fold_tail(nc, st, tail, start_seq, target, at, progress, attested)
    return Rebuilt(
        state=st,
        target_seq=st.last_seq,
        at=at if at is not None else tail.last_time,
        snapshot_seq=start_seq,
        folded=tail.folded,
        elapsed_s=time.perf_counter() - started,
        rejected=tail.rejected,
        skipped=tail.skipped,
        bounds=b,
    )


async def _target(nc: bus.BusClient, b: Bounds, to_seq: int | None, at: float | None) -> int:
    """The last sequence to fold for `--to` or `--at` (or the log's end); BadInput outside it."""
    if to_seq is not None:
        if to_seq < 0:
            raise BadInput(f"sequence {to_seq} is negative: sequences start at 1")
        if to_seq > b.last_seq:
            raise BadInput(
                f"sequence {to_seq} is beyond the end of the log (last sequence {b.last_seq}): "
                "pick a smaller one"
            )
        return to_seq
    if at is not None:
        if b.messages == 0 or at < b.first_time:
            begins = format_time(b.first_time) if b.messages else "nowhere (the log is empty)"
            raise BadInput(
                f"{format_time(at)} is before the log begins ({begins}): pick a later time, or "
                "`llmgw ctl events --seq 1` to see where it starts"
            )
        after = await first_seq_at_or_after(nc, at)
        return b.last_seq if after is None else after
    return b.last_seq


_NO_TIME_BOUND = float("inf")


class _Tail:
    """What folding the log after the snapshot found."""

    def __init__(self) -> None:
        self.rejected: list[tuple[int, str]] = []
        self.skipped: list[bus.Skipped] = []
        self.folded = 0
        self.last_time: float | None = None


async def _fold_tail(
    nc: bus.BusClient,
    st: state.ClusterState,
    tail: _Tail,
    start_seq: int,
    target: int,
    at: float | None,
    progress: Progress | None,
    attested: attestation.Attestations | None = None,
) -> None:
    """Fold into `st` the records after `start_seq` up to `target` (and time `at`)."""
    total = max(0, target - start_seq)
    apply = state.apply
    # What the leader attested is checked by digest, the rest by signature.
    if attested is None:
        attested = await bus.load_attestations(nc, after_seq=start_seq)
    reader = bus.Reader(
        nc,
        after_seq=start_seq,
        follow=False,
        name="ctl",
        batch=20_000,
        attestations=attested,
    )
    # No time bound is the same as one beyond every record.
    until = _NO_TIME_BOUND if at is None else at
    rejected = tail.rejected
    async with reader:
        done = False
        async for batch in reader.batches():
            folded = 0
            # Sequences ascend, so a batch whose last is within the target folds whole,
            # records unchecked; store times need not ascend: a time bound is checked on each.
            whole = batch[-1].seq <= target and until == _NO_TIME_BOUND
            for rec in batch:
                if not whole and (rec.seq > target or rec.time > until):
                    done = True
                    break
                reason = apply(st, rec.event, rec.seq, rec.time)
                if reason is not None:
                    rejected.append((rec.seq, reason))
                folded += 1
            if folded:
                tail.folded += folded
                tail.last_time = batch[folded - 1].time
            if progress is not None:
                progress(min(batch[-1].seq, target) - start_seq, total)
            if done or batch[-1].seq >= target:
                break
        tail.skipped = [s for s in reader.skipped if s.seq <= target]


def copy_state(st: state.ClusterState) -> state.ClusterState:
    """A deep copy (through the snapshot encoding): for what-if planning on the side."""
    return state.decode_snapshot(state.encode_snapshot(st))

"""The agent's outbox: events waiting to be published, kept on disk so no outage loses them.

Every event the agent produces (NodeRegistered, ShardStatus) is appended here
first and published from here, in order, by the agent service
(`llmgw.agent.service`); an event leaves the outbox only once the server has
acknowledged it. While NATS is unreachable the outbox grows; after a reconnect
it drains in the order the events happened, each with its own id as
`Nats-Msg-Id`, so an event whose acknowledgement was lost is stored once.
Because the outbox is a file, a kill -9 of the agent loses nothing either: the
next run publishes what the last one could not.

On disk, in `<state_dir>/outbox/`: `pending.jsonl` (one entry per line,
append-only between compactions) and `cursor` (the number of the last entry
the server acknowledged). Entries numbered at or below the cursor are already
published. A torn last line (a crash mid-write) is dropped on open.

Bounded by entries and bytes. When a bound is passed, the oldest droppable
entries go first: heartbeats (stale by the time they would be sent), then
registrations that a newer queued registration supersedes. ShardStatus is
never dropped: a lost transition would leave the control plane believing a
dead engine serves. The bound is therefore soft for them, and said so in the log.

Durable against power loss, not only against a crash: an entry is fsynced
before `put` returns (`put_many` writes a batch with one fsync), and every
file replaced by a rename (compaction, the first rewrite on open) is fsynced
before the rename and its directory after it. Without that, the page cache
holds a shard transition for up to half a minute, while NATS (`sync_interval:
always`) fsyncs before every acknowledgement: a power loss would keep what the
server acknowledged and lose what the agent had not yet sent. The cursor is
not fsynced: a cursor that goes back only re-publishes acknowledged entries,
which keep their ids.

A disk that refuses a write (full, or a file size limit) never loses an event nor stops
the agent: the entry stays in memory and is published, the outbox says
`outbox_not_durable` (what to free), and it writes nothing more to a file that may now
end in a torn line; every later put or acknowledgement tries to rewrite the file whole,
which makes it durable again once there is room (`outbox_durable_again`). An agent
started on a full disk keeps the file as it is (its readable entries) instead of failing
its first rewrite.

Synchronous file I/O of small records; an fsync costs a disk flush (about a
millisecond on an SSD), paid per transition, which come seconds apart. The
service calls it from its event loop.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path

import msgspec

from llmgw import logs
from llmgw.core import events
from llmgw.durable import sync_dir

log = logs.get("llmgw.agent.outbox")


def _sync_file(fd: int) -> None:
    # fdatasync covers the data and the size an append changed, without the mtime flush.
    (os.fdatasync if hasattr(os, "fdatasync") else os.fsync)(fd)


def _write_all(file: io.FileIO, data: bytes) -> None:
    """Write all of `data`: an unbuffered write may write part of it (a nearly full disk)
    and say so only by its return value; the next write then raises the disk's error."""
    view = memoryview(data)
    while view:
        view = view[file.write(view) :]


class _Line(msgspec.Struct, frozen=True, kw_only=True):
    """One line of pending.jsonl."""

    n: int
    ttl_s: float | None = None
    event: msgspec.Raw


class Entry(msgspec.Struct, frozen=True, kw_only=True):
    """One queued event: its number in this outbox, its publish TTL, and its size on disk."""

    n: int
    event: events.AnyEvent
    ttl_s: float | None = None
    size: int = 0


_line_decoder = msgspec.json.Decoder(_Line)
_line_encoder = msgspec.json.Encoder()


class Outbox:
    """A bounded, ordered, durable queue of events (see the module docstring)."""

    def __init__(
        self, folder: str | Path, *, max_events: int = 100_000, max_bytes: int = 64 * 1024 * 1024
    ) -> None:
        if max_events < 1 or max_bytes < 1:
            raise ValueError("an outbox needs max_events >= 1 and max_bytes >= 1")
        self.folder = Path(folder)
        self.max_events = max_events
        self.max_bytes = max_bytes
        self.dropped = 0
        """Entries dropped to stay within the bounds (heartbeats, superseded registrations)."""
        self.unreadable = 0
        """Lines found on disk that did not decode (torn writes, newer versions)."""
        self._entries: deque[Entry] = deque()
        self._bytes = 0
        self._dead_bytes = 0
        self._next = 1
        self._cursor = 0
        self._over_warned = False
        self._behind = False
        """A write failed: the file may lack entries, or end in a torn line. Nothing is
        appended to it until a rewrite from memory succeeds."""
        self._cursor_failed = False
        self.folder.mkdir(parents=True, exist_ok=True)
        sync_dir(self.folder.parent)
        self._path = self.folder / "pending.jsonl"
        self._cursor_path = self.folder / "cursor"
        self._load()
        self._file = open(self._path, "ab", buffering=0)  # noqa: SIM115 (kept open: appends)

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(list(self._entries))

    @property
    def size_bytes(self) -> int:
        """Bytes the pending entries take on disk."""
        return self._bytes

    def peek(self) -> Entry | None:
        """The oldest entry not yet acknowledged, or None."""
        return self._entries[0] if self._entries else None

    # ------------------------------------------------------------------ changes

    def put(self, event: events.AnyEvent, *, ttl_s: float | None = None) -> Entry:
        """Append `event`; it is on the disk itself (fsynced) when this returns."""
        (entry,) = self.put_many([(event, ttl_s)])
        return entry

    def put_many(self, items: Iterable[tuple[events.AnyEvent, float | None]]) -> list[Entry]:
        """Append (event, ttl_s) pairs in order with one write and one fsync."""
        added: list[Entry] = []
        chunks: list[bytes] = []
        for event, ttl_s in items:
            n = self._next
            self._next += 1
            line = _line_encoder.encode(
                _Line(n=n, ttl_s=ttl_s, event=msgspec.Raw(events.encode(event)))
            )
            data = line + b"\n"
            chunks.append(data)
            added.append(Entry(n=n, event=event, ttl_s=ttl_s, size=len(data)))
        if not added:
            return added
        for entry in added:
            self._entries.append(entry)
            self._bytes += entry.size
        self._persist(b"".join(chunks))
        self._enforce_bounds()
        return added

    def delivered(self, n: int) -> None:
        """The server acknowledged entry `n` (the head): drop it, and record that durably."""
        head = self.peek()
        if head is None or head.n != n:
            raise ValueError(f"entry {n} is not the head of the outbox ({head and head.n})")
        self._entries.popleft()
        self._bytes -= head.size
        self._dead_bytes += head.size
        self._cursor = n
        self._write_cursor()
        if not self._entries:
            # Everything is published: start the file over instead of letting it grow.
            # An empty file holds exactly what is pending, even after a failed write.
            try:
                self._file.truncate(0)
            except OSError as exc:
                self._disk_failed(exc)
            else:
                self._dead_bytes = 0
                self._disk_ok()
        elif self._behind or self._dead_bytes > max(1024 * 1024, self._bytes):
            # Behind: the file lacks entries a full disk refused; every acknowledgement
            # tries to rewrite it whole, not only the next put (which may be long off).
            self._compact()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()

    # ------------------------------------------------------------------ internals

    def _load(self) -> None:
        with contextlib.suppress(FileNotFoundError, ValueError):
            self._cursor = int(self._cursor_path.read_text().strip() or 0)
        highest = self._cursor
        if self._path.exists():
            for raw in self._path.read_bytes().split(b"\n"):
                if not raw.strip():
                    continue
                try:
                    line = _line_decoder.decode(raw)
                    event = events.decode(line.event)
                except (msgspec.DecodeError, msgspec.ValidationError, events.DecodeError) as exc:
                    self.unreadable += 1
                    log.warning("outbox_line_unreadable", error=str(exc), bytes=len(raw))
                    continue
                highest = max(highest, line.n)
                if line.n <= self._cursor:
                    continue  # published before the last run ended
                size = len(raw) + 1
                self._entries.append(Entry(n=line.n, event=event, ttl_s=line.ttl_s, size=size))
                self._bytes += size
        self._next = highest + 1
        # Rewrite what is pending: drops published entries and any torn last line, so
        # the next append starts on a line of its own. On a full disk the file stays as
        # it is (published entries are skipped by the cursor, a torn line on reading).
        try:
            self._rewrite()
        except OSError as exc:
            self._disk_failed(exc)
        if self._entries:
            log.info("outbox_loaded", pending=len(self._entries), bytes=self._bytes)

    def _rewrite(self) -> None:
        tmp = self._path.with_suffix(".tmp")
        try:
            with open(tmp, "wb", buffering=0) as out:
                for entry in self._entries:
                    _write_all(out, self._line(entry))
                # Before the rename: else a power loss can leave the new name on an empty file.
                _sync_file(out.fileno())
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()  # a partial copy would only take what room is left
            raise
        os.replace(tmp, self._path)
        # After it: else the old file may come back, without what is appended from now on.
        sync_dir(self.folder)

    def _persist(self, data: bytes) -> None:
        """Append `data` (whole lines) durably; after a failed write, rewrite the file whole."""
        if self._behind:
            self._compact()
            return
        try:
            _write_all(self._file, data)
            _sync_file(self._file.fileno())
        except OSError as exc:
            self._disk_failed(exc)

    def _compact(self) -> None:
        """Rewrite the file from memory; when the disk refuses, the outbox is behind it."""
        self._file.close()
        try:
            self._rewrite()
        except OSError as exc:
            self._disk_failed(exc)
        else:
            self._dead_bytes = 0
            self._disk_ok()
        finally:
            self._file = open(self._path, "ab", buffering=0)  # noqa: SIM115

    def _disk_failed(self, exc: OSError) -> None:
        # Raising would lose the entry (the supervisor's callback only logs) and, at
        # start, stop the agent on every restart: keep it in memory and say so.
        if not self._behind:
            log.error(
                "outbox_not_durable",
                folder=str(self.folder),
                error=str(exc),
                pending=len(self._entries),
                detail="the disk refused a write: events are kept in memory and still "
                "published, but those not yet published are lost if the agent stops "
                "before the disk takes writes again; free space there",
            )
        self._behind = True

    def _disk_ok(self) -> None:
        if self._behind:
            log.info("outbox_durable_again", folder=str(self.folder), pending=len(self._entries))
        self._behind = False

    @staticmethod
    def _line(entry: Entry) -> bytes:
        raw = msgspec.Raw(events.encode(entry.event))
        return _line_encoder.encode(_Line(n=entry.n, ttl_s=entry.ttl_s, event=raw)) + b"\n"

    def _write_cursor(self) -> None:
        tmp = self._cursor_path.with_suffix(".tmp")
        try:
            tmp.write_text(str(self._cursor))
            os.replace(tmp, self._cursor_path)
        except OSError as exc:
            # A cursor behind only re-publishes acknowledged entries, under their own ids.
            if not self._cursor_failed:
                log.warning("outbox_cursor_not_saved", folder=str(self.folder), error=str(exc))
            self._cursor_failed = True
        else:
            self._cursor_failed = False

    def _over(self) -> bool:
        return len(self._entries) > self.max_events or self._bytes > self.max_bytes

    def _enforce_bounds(self) -> None:
        if not self._over():
            return
        dropped = 0
        while self._over():
            victim = _droppable(self._entries)
            if victim is None:
                break
            entry = self._entries[victim]
            del self._entries[victim]
            self._bytes -= entry.size
            dropped += 1
        if dropped:
            self.dropped += dropped
            log.warning(
                "outbox_dropped",
                entries=dropped,
                pending=len(self._entries),
                detail="heartbeats and superseded registrations go first; shard statuses never",
            )
            self._compact()
        if self._over():
            if not self._over_warned:
                self._over_warned = True
                log.error(
                    "outbox_over_bound",
                    pending=len(self._entries),
                    bytes=self._bytes,
                    max_events=self.max_events,
                    max_bytes=self.max_bytes,
                    detail="only shard statuses are left and they are never dropped; check "
                    "why NATS has been unreachable for so long",
                )
        else:
            self._over_warned = False


def _droppable(entries: deque[Entry]) -> int | None:
    """Index of the entry to drop first: the oldest heartbeat, else the oldest registration
    that a later one supersedes. Purely computational, no side effects."""
    registration = None
    newest_registration = None
    for i, entry in enumerate(entries):
        if isinstance(entry.event, events.Heartbeat):
            return i
        if isinstance(entry.event, events.NodeRegistered):
            if registration is None:
                registration = i
            newest_registration = i
    if registration is not None and registration != newest_registration:
        return registration
    return None

"""The bus's ports in memory: an event log, snapshots and a lease on an injected clock.

For tests of a service's logic (llmgw.bus.ports) that need no nats-server: they run in
milliseconds and decide time themselves. What the log does is what JetStream does, as
far as llmgw relies on it, and the contract suite (tests/integration/test_log_contract.py)
checks both against the same expectations:

- an append whose event id was stored within the duplicate window is acknowledged as
  a duplicate with the first one's sequence, and stored once;
- a fence (expected last sequence on a subject filter) that no longer holds is refused
  with `FenceRefused`, unless the last message on the subject is this very event (a
  retry of a write that landed: acknowledged as a duplicate, as `Publisher` does);
- a message with a TTL (heartbeats only, as `Publisher` enforces) is gone from reads,
  fences and `last_seq` once the clock passes its store time plus the TTL;
- a following reader hands out every later append, in order.

Signatures are not modelled: whatever is appended here is trusted, which is what a
test of the logic above the bus wants. Events off their owner's subject are still
skipped, as every real reader skips them.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence

import msgspec

from llmgw.bus import attestations as attestations_
from llmgw.bus.deletion import Deleted
from llmgw.bus.lease import Holder, LeaseLost
from llmgw.bus.ports import EventLog, LeasePort, SnapshotPort
from llmgw.bus.publisher import Fence, FenceRefused, Published, stored_ttl_s
from llmgw.bus.reader import Record, Skipped, SkipSink
from llmgw.bus.snapshots import Snapshot, choose
from llmgw.core import attestation, events, subjects

Clock = Callable[[], float]


def subject_matches(subject: str, pattern: str) -> bool:
    """Whether `subject` matches the NATS subject filter `pattern` (`*` one token, `>`
    one or more trailing tokens). Pure."""
    have = subject.split(".")
    want = pattern.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(have) == len(want)


class _Stored(msgspec.Struct, gc=False):
    record: Record
    msg_id: str
    expires: float | None


class MemoryLog:
    """An in-memory `EventLog`. `clock` (UNIX seconds) decides store times, TTLs and the
    duplicate window; a test advances it to let heartbeats expire."""

    def __init__(self, *, clock: Clock = time.time, duplicate_window_s: float = 120.0) -> None:
        self.clock = clock
        self.duplicate_window_s = duplicate_window_s
        self.connected = True
        """Set False to have a service see the log as unreachable."""
        self._stored: dict[int, _Stored] = {}
        self._ids: dict[str, tuple[int, float]] = {}
        self._seq = 0
        self._wakes: set[asyncio.Event] = set()

    # ------------------------------------------------------------------ writing

    async def append(
        self,
        event: events.Event,
        *,
        subject: str | None = None,
        fence: Fence | None = None,
        ttl_s: float | None = None,
    ) -> Published:
        if subject is None:
            subject = events.subject_of(event)
        ttl = stored_ttl_s(event, ttl_s)
        now = self.clock()
        self._expire(now)
        if fence is not None:
            last = self._last(fence.subject_filter)
            if last != fence.last_seq:
                on_subject = self._last_stored(subject)
                if on_subject is not None and on_subject.msg_id == event.id:
                    return self._ack(on_subject.record.seq, duplicate=True)
                raise FenceRefused(fence, f"wrong last sequence: {last}")
        first = self._ids.get(event.id)
        if first is not None and now - first[1] < self.duplicate_window_s:
            return self._ack(first[0], duplicate=True)
        self._seq += 1
        payload = events.encode(event)
        record = Record(self._seq, subject, now, event, len(payload))  # type: ignore[arg-type]
        self._stored[self._seq] = _Stored(record, event.id, None if ttl is None else now + ttl)
        self._ids[event.id] = (self._seq, now)
        for wake in self._wakes:
            wake.set()
        return self._ack(self._seq, duplicate=False)

    @staticmethod
    def _ack(seq: int, *, duplicate: bool) -> Published:
        return Published(seq=seq, duplicate=duplicate, stream=subjects.STREAM)

    def _expire(self, now: float) -> None:
        gone = [s for s, m in self._stored.items() if m.expires is not None and m.expires <= now]
        for seq in gone:
            del self._stored[seq]
        window = self.duplicate_window_s
        if len(self._ids) > 1000:
            self._ids = {k: v for k, v in self._ids.items() if now - v[1] < window}

    def _last_stored(self, subject_filter: str) -> _Stored | None:
        for seq in sorted(self._stored, reverse=True):
            stored = self._stored[seq]
            if subject_matches(stored.record.subject, subject_filter):
                return stored
        return None

    def _last(self, subject_filter: str) -> int:
        found = self._last_stored(subject_filter)
        return 0 if found is None else found.record.seq

    # ------------------------------------------------------------------ reading

    def records(self) -> list[Record]:
        """Everything stored now, in order (expired messages excluded)."""
        self._expire(self.clock())
        return [self._stored[s].record for s in sorted(self._stored)]

    def after(self, seq: int, subjects_filter: Sequence[str]) -> list[Record]:
        """The stored records after `seq` on any of `subjects_filter`, in order."""
        return [
            r
            for r in self.records()
            if r.seq > seq and any(subject_matches(r.subject, f) for f in subjects_filter)
        ]

    def reader(
        self,
        *,
        after_seq: int = 0,
        subjects_filter: Sequence[str] = subjects.STREAM_SUBJECTS,
        follow: bool = True,
        name: str = "reader",
        attestations: attestation.Attestations | None = None,
        attester: attestation.Sink | None = None,
        on_skip: SkipSink | None = None,
    ) -> MemoryReader:
        del name, attestations, attester  # nothing here is signed, so nothing to attest
        return MemoryReader(
            self,
            after_seq=after_seq,
            subjects_filter=subjects_filter,
            follow=follow,
            on_skip=on_skip,
        )

    async def last_seq(self, subject_filter: str) -> int:
        self._expire(self.clock())
        return self._last(subject_filter)

    async def attestations(self, *, after_seq: int = 0) -> attestation.Attestations:
        book = attestation.Attestations()
        attestations_.add(book, self.after(0, [attestations_.SUBJECT]), after_seq=after_seq)
        return book

    async def delete(self, seqs: Iterable[int]) -> Deleted:
        out = Deleted()
        for seq in sorted(set(seqs)):
            if self._stored.pop(seq, None) is None:
                out.gone += 1
            else:
                out.deleted += 1
        return out


class MemoryReader:
    """A `LogReader` over a `MemoryLog`: the records after `after_seq`, then the live log."""

    def __init__(
        self,
        log: MemoryLog,
        *,
        after_seq: int,
        subjects_filter: Sequence[str],
        follow: bool,
        on_skip: SkipSink | None = None,
    ) -> None:
        if after_seq < 0:
            raise ValueError(f"after_seq must be >= 0, got {after_seq}")
        self._log = log
        self._on_skip = on_skip
        self._filters = list(subjects_filter)
        self.follow = follow
        self.last_seq = after_seq
        self.last_time = 0.0
        self.more_pending = False  # it reads all there is at each turn
        self.undecodable = 0
        self.refused = 0
        self.skipped: deque[Skipped] = deque(maxlen=1000)
        self.ttl_refused: deque[int] = deque(maxlen=10_000)
        self.caught_up = asyncio.Event()
        self.resets = 0
        self._wake = asyncio.Event()
        self._closed = False

    async def __aenter__(self) -> MemoryReader:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        self._log._wakes.add(self._wake)
        if not self._log.after(self.last_seq, self._filters):
            self.caught_up.set()  # as JetStream's reader: nothing pending at the start

    async def close(self) -> None:
        self._closed = True
        self._log._wakes.discard(self._wake)
        self._wake.set()

    def _take(self) -> list[Record]:
        out: list[Record] = []
        for record in self._log.after(self.last_seq, self._filters):
            self.last_seq, self.last_time = record.seq, record.time
            if events.published_where_owned(record.event, record.subject):
                out.append(record)
                continue
            error = f"{events.tag_of(type(record.event))} event refused on {record.subject}"
            self.undecodable += 1
            item = Skipped(record.seq, record.subject, record.time, error, record.size)
            self.skipped.append(item)
            if self._on_skip is not None:
                self._on_skip(item)
        return out

    async def batches(self) -> AsyncIterator[list[Record]]:
        await self.start()
        while not self._closed:
            self._wake.clear()
            out = self._take()
            self.caught_up.set()
            if out:
                yield out
                continue
            if not self.follow:
                return
            await self._wake.wait()

    async def __aiter__(self) -> AsyncIterator[Record]:
        async for batch in self.batches():
            for record in batch:
                yield record


class MemorySnapshots:
    """An in-memory `SnapshotPort` keeping the newest `keep` snapshots."""

    def __init__(self, *, keep: int = 5) -> None:
        self.keep = max(1, keep)
        self.saved: dict[int, bytes] = {}

    async def save(self, data: bytes, seq: int) -> None:
        self.saved[seq] = data
        for old in sorted(self.saved)[: max(0, len(self.saved) - self.keep)]:
            del self.saved[old]

    async def load(self, *, at_or_before: int | None = None) -> Snapshot | None:
        seq = choose(list(self.saved), at_or_before)
        return None if seq is None else Snapshot(seq=seq, data=self.saved[seq])


class _Entry(msgspec.Struct):
    holder: str
    epoch: int
    revision: int
    expires: float


class LeaseBucket:
    """The one lease key that contenders share, with a revision that every write bumps."""

    def __init__(self, *, clock: Clock = time.time) -> None:
        self.clock = clock
        self.revision = 0
        self._entry: _Entry | None = None

    def entry(self) -> _Entry | None:
        if self._entry is not None and self._entry.expires <= self.clock():
            self._entry = None  # the key's TTL ran out
        return self._entry

    def write(self, holder: str, epoch: int, ttl_s: float) -> _Entry:
        self.revision += 1
        self._entry = _Entry(holder, epoch or self.revision, self.revision, self.clock() + ttl_s)
        return self._entry

    def delete(self) -> None:
        self.revision += 1
        self._entry = None


class MemoryLease:
    """A `LeasePort` on a `LeaseBucket`: `Lease`'s semantics (create if free, renew only
    the revision this instance wrote last, release), with the bucket's clock."""

    def __init__(self, bucket: LeaseBucket, name: str, *, ttl_s: float = 10.0) -> None:
        self._bucket = bucket
        self.name = name
        self.ttl_s = float(ttl_s)
        self.epoch = 0
        self._revision = 0
        self._valid_until = 0.0

    @property
    def renew_every_s(self) -> float:
        return self.ttl_s / 3

    @property
    def held(self) -> bool:
        return self._revision > 0 and self._bucket.clock() < self._valid_until

    async def holder(self) -> Holder | None:
        entry = self._bucket.entry()
        return None if entry is None else Holder(entry.holder, entry.epoch, entry.revision)

    async def acquire(self) -> bool:
        if self.held:
            return True
        if self._bucket.entry() is not None:
            return False
        entry = self._bucket.write(self.name, 0, self.ttl_s)
        self._revision = self.epoch = entry.revision
        self._valid_until = self._bucket.clock() + self.ttl_s
        return True

    async def renew(self) -> None:
        if self._revision == 0:
            raise LeaseLost(f"{self.name} does not hold the lease: acquire it first")
        entry = self._bucket.entry()
        if entry is None or entry.revision != self._revision:
            epoch, self._revision, self._valid_until = self.epoch, 0, 0.0
            raise LeaseLost(f"{self.name} lost the lease (epoch {epoch})")
        self._revision = self._bucket.write(self.name, self.epoch, self.ttl_s).revision
        self._valid_until = self._bucket.clock() + self.ttl_s

    async def server_time(self) -> float | None:
        return self._bucket.clock()

    async def release(self) -> None:
        if self._revision == 0:
            return
        entry = self._bucket.entry()
        if entry is not None and entry.revision == self._revision:
            self._bucket.delete()
        self._revision, self._valid_until = 0, 0.0


def _conforms(log: MemoryLog, lease: MemoryLease, store: MemorySnapshots) -> None:
    """Type-checked only: the in-memory side satisfies every port."""
    _log: EventLog = log
    _lease: LeasePort = lease
    _store: SnapshotPort = store
    del _log, _lease, _store

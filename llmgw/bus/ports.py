"""The ports of the bus: what a service needs of the event log, snapshots and the lease.

A service (the control plane first) is written against these Protocols, not against
JetStream: `llmgw.bus.jetstream` adapts the real log to them (the production wiring),
`llmgw.bus.memory` implements them in memory for tests of a service's logic that run
in milliseconds. One contract suite (tests/integration/test_log_contract.py) holds both
to the same behaviour, so that what the in-memory log lets a test conclude holds on
the real one.

The shapes are those the services use today:

- `EventLog.append(event, subject=, fence=, ttl_s=)`: the event's id is the dedupe id
  (JetStream's Nats-Msg-Id): a second append of the same id inside the duplicate window
  is acknowledged with `duplicate=True` and stored once; a `Fence` is JetStream's
  expected-last-subject-sequence on a subject filter, refused with `FenceRefused`; a TTL
  (heartbeats only) makes the message expire from the log.
- `EventLog.reader(after_seq=, subjects_filter=, follow=)`: records with sequence above
  `after_seq` in stream order, then (when following) every later append.
- `SnapshotPort.save/load`, `LeasePort.acquire/renew/release`: as `SnapshotStore` and
  `Lease` (which satisfy them as they are).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Protocol

from llmgw.bus.deletion import Deleted
from llmgw.bus.lease import Holder
from llmgw.bus.publisher import Fence, Published
from llmgw.bus.reader import Record, Skipped, SkipSink
from llmgw.bus.snapshots import Snapshot
from llmgw.core import attestation, events, subjects


class LogReader(Protocol):
    """A replay from a sequence, then (when following) the live log. See `llmgw.bus.Reader`."""

    last_seq: int
    """Sequence of the last message handed out or skipped."""
    last_time: float
    """When the server stored it (UNIX seconds); 0 before any."""
    more_pending: bool
    """More was stored after it, not yet read (the reader is behind the log)."""
    undecodable: int
    refused: int
    skipped: deque[Skipped]
    ttl_refused: deque[int]
    caught_up: asyncio.Event
    """Set once everything stored when reading began has been handed out."""
    resets: int
    """How often the reader had to start over (its view of the log was interrupted); not
    the new consumer it starts after an empty message, which misses nothing."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def __aenter__(self) -> LogReader: ...

    async def __aexit__(self, *exc: object) -> None: ...

    def batches(self) -> AsyncIterator[list[Record]]: ...


class EventLog(Protocol):
    """The event log `llmgw-events`: append, read and follow, and the leader's upkeep."""

    @property
    def connected(self) -> bool:
        """False while the log cannot be reached: a leader then decides nothing."""
        ...

    async def append(
        self,
        event: events.Event,
        *,
        subject: str | None = None,
        fence: Fence | None = None,
        ttl_s: float | None = None,
    ) -> Published:
        """Store `event` on `subject` (default: its own, `events.subject_of`), deduplicated
        by its id; raises FenceRefused when `fence` no longer holds, PublishError when the
        log did not store it."""
        ...

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
    ) -> LogReader:
        """A reader of the records after `after_seq` on `subjects_filter`; `on_skip` hears of
        each message it passes over (undecodable, refused), as it does."""
        ...

    async def last_seq(self, subject_filter: str) -> int:
        """Sequence of the last message stored on `subject_filter`; 0 when there is none."""
        ...

    async def attestations(self, *, after_seq: int = 0) -> attestation.Attestations:
        """Every attestation in the log covering a sequence after `after_seq`."""
        ...

    async def delete(self, seqs: Iterable[int]) -> Deleted:
        """Delete the messages at `seqs`; never raises for one message's failure."""
        ...


class SnapshotPort(Protocol):
    """Folded state saved with the last sequence folded into it. See `SnapshotStore`."""

    async def save(self, data: bytes, seq: int) -> None: ...

    async def load(self, *, at_or_before: int | None = None) -> Snapshot | None: ...


class LeasePort(Protocol):
    """The control-plane leader lease. See `llmgw.bus.Lease`."""

    name: str
    epoch: int
    """Epoch of the lease this instance holds: increases with every new holder."""

    @property
    def renew_every_s(self) -> float: ...

    @property
    def held(self) -> bool: ...

    async def holder(self) -> Holder | None: ...

    async def acquire(self) -> bool:
        """Take the lease if it is free; True when this instance holds it afterwards."""
        ...

    async def renew(self) -> None:
        """Extend the lease; raises LeaseLost when someone else holds it now."""
        ...

    async def server_time(self) -> float | None:
        """The server's clock now, or None when it does not answer."""
        ...

    async def release(self) -> None: ...

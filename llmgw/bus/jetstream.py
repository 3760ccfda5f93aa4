"""The bus's ports on JetStream: thin adapters over `Publisher`, `Reader` and friends.

`Lease` and `SnapshotStore` are the lease and snapshot ports as they are; the event log
is `JetStreamLog`, which only routes each port call to the code that has always done
it (llmgw.bus.publisher, reader, attestations, deletion), so the production path is
the one it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import nats.js.errors

from llmgw.bus import attestations as attestations_
from llmgw.bus.connection import BusClient
from llmgw.bus.deletion import Deleted, delete_messages
from llmgw.bus.lease import Lease
from llmgw.bus.ports import EventLog, LeasePort, SnapshotPort
from llmgw.bus.publisher import Fence, Published, Publisher
from llmgw.bus.reader import Reader, SkipSink
from llmgw.bus.snapshots import SnapshotStore
from llmgw.core import attestation, events, subjects


class JetStreamLog:
    """The `EventLog` of the stream `llmgw-events` on connection `nc`."""

    def __init__(self, nc: BusClient, *, publisher: Publisher | None = None) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self._publisher = publisher

    @property
    def publisher(self) -> Publisher:
        """Made at the first append: a reader's log (a router's) has no key to sign with."""
        if self._publisher is None:
            self._publisher = Publisher(self.js)
        return self._publisher

    @property
    def connected(self) -> bool:
        return bool(self.nc.is_connected)

    async def append(
        self,
        event: events.Event,
        *,
        subject: str | None = None,
        fence: Fence | None = None,
        ttl_s: float | None = None,
    ) -> Published:
        return await self.publisher.publish(event, ttl_s=ttl_s, fence=fence, subject=subject)

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
    ) -> Reader:
        return Reader(
            self.nc,
            after_seq=after_seq,
            subjects_filter=subjects_filter,
            follow=follow,
            name=name,
            attestations=attestations,
            attester=attester,
            on_skip=on_skip,
        )

    async def last_seq(self, subject_filter: str) -> int:
        try:
            msg = await self.js.get_last_msg(subjects.STREAM, subject_filter, direct=True)
        except nats.js.errors.NotFoundError:
            return 0
        return int(msg.seq or 0)

    async def attestations(self, *, after_seq: int = 0) -> attestation.Attestations:
        return await attestations_.load(self.nc, after_seq=after_seq)

    async def delete(self, seqs: Iterable[int]) -> Deleted:
        return await delete_messages(self.nc, seqs)


def _conforms(log: JetStreamLog, lease: Lease, store: SnapshotStore) -> None:
    """Type-checked only: the JetStream side satisfies every port."""
    _log: EventLog = log
    _lease: LeasePort = lease
    _store: SnapshotPort = store
    del _log, _lease, _store

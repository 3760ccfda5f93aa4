"""What a router's log feed reads: the event log and its snapshots, as ports.

`LogFeed(source, ..., ports=...)` (llmgw.router.feed) folds any implementation of
llmgw.bus.ports; it gets them from an opener, an async context manager entered when the
feed starts and left when it stops. `jetstream(source)` is the production opener: it
connects as the `router` identity (reconnecting forever, also on the first connection)
and binds a read-only log and the snapshot store to that connection, closed on exit.
`given(ports)` hands over ports that someone else owns (tests: llmgw.bus.memory).

A router may only read the log, so its event log refuses to append or delete here,
before the server would; it reads exactly as the feed always did (`bus.Reader`, the
attestations after the snapshot, the snapshot store opened at the first load).
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

from llmgw import bus
from llmgw.core import events
from llmgw.pki.identity import Identity
from llmgw.router.config import LogSource

SNAPSHOT_LOAD_TIMEOUT_S = 10.0
"""How long a router waits for a snapshot before folding the whole log instead."""


@dataclass(frozen=True)
class FeedPorts:
    """The log a router folds and follows, and where the newest snapshot of it lies."""

    log: bus.EventLog
    snapshots: bus.SnapshotPort


PortsOpener = Callable[[], AbstractAsyncContextManager[FeedPorts]]
"""Entered once per feed: yields the ports, and releases what it opened on exit."""


class ReadOnlyLog(bus.JetStreamLog):
    """The `EventLog` of the stream `llmgw-events` as a router sees it: it reads and
    follows as any JetStream log, and refuses to write here, before the server would."""

    async def append(
        self,
        event: events.Event,
        *,
        subject: str | None = None,
        fence: bus.Fence | None = None,
        ttl_s: float | None = None,
    ) -> bus.Published:
        raise PermissionError(f"a router may only read the log: {events.tag_of(type(event))}")

    async def delete(self, seqs: Iterable[int]) -> bus.Deleted:
        raise PermissionError("a router may only read the log")


class StoreOnLoad:
    """The `SnapshotPort` of the snapshot store, bound at the first call: a router
    started before the control plane provisioned the store finds no snapshot (the
    error says why) and folds the whole log."""

    def __init__(self, nc: bus.BusClient) -> None:
        self.nc = nc
        self._store: bus.SnapshotStore | None = None

    async def _open(self) -> bus.SnapshotStore:
        if self._store is None:
            self._store = await bus.SnapshotStore.open(
                self.nc.jetstream(), load_timeout_s=SNAPSHOT_LOAD_TIMEOUT_S
            )
        return self._store

    async def save(self, data: bytes, seq: int) -> None:
        await (await self._open()).save(data, seq)

    async def load(self, *, at_or_before: int | None = None) -> bus.Snapshot | None:
        return await (await self._open()).load(at_or_before=at_or_before)


async def connect(
    source: LogSource, tls: ssl.SSLContext, *, buffered: bool = True
) -> bus.BusClient:
    """The router's connection: its own identity (which may only read), its keys to verify.
    Unless `buffered`, what is published while the connection is down fails at once instead
    of waiting in the client's buffer to be sent when it is back: a counter's increment the
    router took for failed would otherwise be counted after all."""
    unbuffered: dict[str, Any] = {} if buffered else {"pending_size": 0}
    return await bus.connect(
        list(source.servers),
        tls=tls,
        identity=Identity("router", source.name),
        name=f"llmgw-router-{source.name}",
        keys=source.keys(),
        **unbuffered,
    )


def jetstream(source: LogSource, *, tls: ssl.SSLContext | None = None) -> PortsOpener:
    """The production opener: a connection to `source` (TLS from its files unless `tls`
    is given ready-made), the ports bound to it, the connection closed on exit."""

    @contextlib.asynccontextmanager
    async def opened() -> AsyncIterator[FeedPorts]:
        nc = await connect(source, tls if tls is not None else source.tls_context())
        try:
            yield FeedPorts(log=ReadOnlyLog(nc), snapshots=StoreOnLoad(nc))
        finally:
            await bus.close(nc)

    return opened


def given(ports: FeedPorts) -> PortsOpener:
    """An opener of ports that someone else owns: nothing is opened or closed."""

    @contextlib.asynccontextmanager
    async def opened() -> AsyncIterator[FeedPorts]:
        yield ports

    return opened


def _conforms(log: ReadOnlyLog, store: StoreOnLoad) -> None:
    """Type-checked only: the router's JetStream side satisfies the ports it uses."""
    _log: bus.EventLog = log
    _store: bus.SnapshotPort = store
    del _log, _store

"""The router fed by the log: models and endpoints follow the control plane's decisions.

A router started with a `log` section connects to NATS as its `router` identity (which
may only read), folds the stream `llmgw-events` into a `ClusterState` exactly as the
control plane does — starting from the newest snapshot, then the tail, then following
live — and keeps its `Catalog` and `EndpointTable` equal to what that state says:

- every declared model (ModelDeclared / ModelChanged / ModelRemoved) with its aliases,
  fallbacks and deadlines: one description of a model, shared with the scheduler;
- one endpoint per replica whose engine serves (EndpointUp / EndpointDown), marked
  draining while its node drains or its shard drains, so new requests avoid it once
  another endpoint of its model is ready (`llmgw.core.routing.PREFERENCES`) while the
  streams in flight finish.

Models and endpoints from the static config are left alone. When NATS is unreachable
nothing is removed: the router keeps routing on the last known endpoints (its prober
still takes dead engines out of rotation) and the reader reconnects forever. Several
routers can follow the same log side by side. Used by `llmgw.router.app.Router`.

The feed reads through ports (llmgw.router.ports): the JetStream log and snapshot store
in production, the in-memory ones of llmgw.bus.memory in fast tests of its folding.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Callable, Mapping

import msgspec

from llmgw import bus, logs
from llmgw import tasks as tasks_
from llmgw.core import events, state, vocabulary
from llmgw.core.profile import ModelProfile
from llmgw.router import ports as ports_
from llmgw.router.config import LogSource
from llmgw.router.ports import FeedPorts, PortsOpener
from llmgw.router.table import Catalog, EndpointTable

log = logs.get("llmgw.router.feed")

# Events after which the catalog or the endpoint table may need to change. The rest
# (heartbeats above all) are folded without looking at the tables.
_RELEVANT = vocabulary.ROUTED
_KEY_EVENTS = (events.KeyCreated, events.KeyChanged, events.KeyRotated, events.KeyRevoked)
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 30.0
"""The feed's waits between tries to open and read the log, doubling while it fails."""


class Wanted(msgspec.Struct, frozen=True):
    """What the tables should hold according to the folded log. Purely computational."""

    models: dict[str, ModelProfile]
    endpoints: dict[str, tuple[str, str, bool, str, str]]
    """Endpoint id (the replica id) -> (url, model, draining, the engine's API key, node)."""


def wanted(cluster: state.ClusterState) -> Wanted:
    """Models and endpoints a router should route to, from the folded state. Pure."""
    models = {name: m.profile for name, m in cluster.models.items()}
    endpoints: dict[str, tuple[str, str, bool, str, str]] = {}
    for replica_id, ep in cluster.endpoints.items():
        replica = cluster.replicas.get(replica_id)
        draining = replica is None or replica.retired
        if replica is not None:
            for shard in replica.shards:
                node = cluster.nodes.get(shard.node)
                if shard.phase == "draining" or shard.drain_sent_at is not None:
                    draining = True
                if node is not None and node.draining:
                    draining = True
        endpoints[replica_id] = (ep.url, ep.model, draining, ep.api_key, ep.node)
    return Wanted(models=models, endpoints=endpoints)


class LogFeed:
    """Keeps one router's Catalog and EndpointTable in step with the log."""

    def __init__(
        self,
        source: LogSource,
        catalog: Catalog,
        table: EndpointTable,
        *,
        ports: FeedPorts | PortsOpener | None = None,
        tls: ssl.SSLContext | None = None,
        static_models: frozenset[str] = frozenset(),
        static_endpoints: frozenset[str] = frozenset(),
        on_keys: Callable[[Mapping[str, state.KeyState]], None] | None = None,
    ) -> None:
        """`ports` (llmgw.router.ports) are the log and snapshots to fold, or an opener of
        them; without, the feed connects to `source` itself (`tls` ready-made, or from
        the source's files) as the production wiring does. `on_keys` is told the log's
        tenant keys whenever they change (and once caught up)."""
        self.source = source
        self.catalog = catalog
        self.table = table
        if ports is None:
            ports = ports_.jetstream(source, tls=tls)
        elif isinstance(ports, FeedPorts):
            ports = ports_.given(ports)
        self._open: PortsOpener = ports
        self._static_models = static_models
        self._static_endpoints = static_endpoints
        self._on_keys = on_keys
        self.cluster = state.ClusterState()
        self.models: set[str] = set()
        """Models this feed put into the catalog."""
        self.endpoints: dict[str, tuple[str, str, str, str]] = {}
        """Endpoint ids this feed put into the table -> (url, model, API key, node)."""
        self.applied = 0
        self.rejected = 0
        self.ready = asyncio.Event()
        """Set once the log as it stood at start has been folded into the tables."""
        self._task: asyncio.Task[None] | None = None
        self._reader: bus.LogReader | None = None
        self._stop = asyncio.Event()

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="router-log-feed")
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """A feed that ends by itself leaves the router routing on the tables it has, no
        longer following the log: that must not pass unseen (`_run` retries every failure
        to open or read the log, so only a bug ends it)."""
        if self._stop.is_set() or task.cancelled():
            return
        exc = task.exception()
        log.error(
            "feed_ended",
            error=repr(exc) if exc is not None else "the log's reader ended",
            seq=self.cluster.last_seq,
            advice="routing continues on the last-known endpoints; restart the router "
            "to follow the log again",
        )

    async def close(self) -> None:
        self._stop.set()
        # Close the reader first, so that its loop ends even if a cancel is swallowed by
        # asyncio.wait_for inside nats-py (Python 3.11); then cancel, bounded.
        if self._reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._reader.close(), 5)
        if self._task is not None:
            await tasks_.stop([self._task], who="router log feed")

    async def _run(self) -> None:
        """Follow the log while the feed runs. A failure to open or read it (NATS not
        reachable yet when the router starts, a connection closed under the reader) is
        logged and retried, waiting longer each time it makes no progress, from where the
        fold stands; meanwhile the router routes on the tables it has."""
        wait = RETRY_FIRST_S
        while not self._stop.is_set():
            folded = self.cluster.last_seq
            try:
                await self._follow()
                return  # the reader ended by itself: `_ended` says so
            except Exception as exc:
                if self._stop.is_set():
                    return
                if self.cluster.last_seq > folded:
                    wait = RETRY_FIRST_S
                log.warning("feed_retry", error=str(exc) or repr(exc),
                            seq=self.cluster.last_seq, retry_in_s=wait)  # fmt: skip
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), wait)
            wait = min(wait * 2, RETRY_MAX_S)

    async def _follow(self) -> None:
        """Open the log and fold it, from the newest snapshot at first, after what is
        folded already when it starts over."""
        async with self._open() as ports:
            after = self.cluster.last_seq or await self._load_snapshot(ports.snapshots)
            reader = ports.log.reader(
                after_seq=after,
                name=f"router-{self.source.name}",
                attestations=await ports.log.attestations(after_seq=after),
            )
            self._reader = reader
            async with reader:
                caught_up = asyncio.get_running_loop().create_task(self._mark_ready(reader))
                try:
                    async for batch in reader.batches():
                        self.apply(batch)
                finally:
                    caught_up.cancel()

    async def _mark_ready(self, reader: bus.LogReader) -> None:
        await reader.caught_up.wait()
        self.sync()
        self.ready.set()
        log.info(
            "feed_caught_up",
            seq=self.cluster.last_seq,
            models=sorted(self.models),
            endpoints=len(self.endpoints),
        )

    async def _load_snapshot(self, snapshots: bus.SnapshotPort) -> int:
        """Fold from the newest snapshot when one is readable; else from the beginning."""
        try:
            snap = await snapshots.load()
        except Exception as exc:  # no store yet, or not readable: the whole log is the truth
            log.info("feed_no_snapshot", reason=str(exc) or type(exc).__name__)
            return 0
        if snap is None:
            return 0
        try:
            self.cluster = state.decode_snapshot(snap.data)
        except Exception as exc:
            log.warning("feed_snapshot_unusable", seq=snap.seq, error=str(exc))
            self.cluster = state.ClusterState()
            return 0
        log.info("feed_snapshot", seq=snap.seq)
        self.sync()
        return snap.seq

    # ----------------------------------------------------------------- folding

    def apply(self, batch: list[bus.Record]) -> None:
        """Fold a batch of records; sync the tables once if any of them matters."""
        dirty = keys = False
        for record in batch:
            reason = state.apply(self.cluster, record.event, record.seq, record.time)
            if reason is not None:
                self.rejected += 1
                continue
            self.applied += 1
            if isinstance(record.event, _RELEVANT):
                dirty = True
                keys = keys or isinstance(record.event, _KEY_EVENTS)
        if dirty:
            self.sync(keys=keys)

    def sync(self, *, keys: bool = True) -> None:
        """Make the catalog and the table (and, when `keys`, the router's keys) hold what
        the folded log says."""
        if keys and self._on_keys is not None:
            self._on_keys(self.cluster.keys)
        want = wanted(self.cluster)
        for name, profile in want.models.items():
            if name in self._static_models:
                continue
            if self.catalog.profiles.get(name) != profile:
                self.catalog.put(profile)
                log.info("model_updated", model=name, aliases=list(profile.aliases))
            self.models.add(name)
        for name in sorted(self.models - set(want.models)):
            self.catalog.remove(name)
            self.models.discard(name)
            log.info("model_removed", model=name)
        for ep_id, (url, model, draining, api_key, node) in want.endpoints.items():
            if ep_id in self._static_endpoints:
                continue
            if self.endpoints.get(ep_id) != (url, model, api_key, node):
                # A new engine is reported up only once it serves: route to it at once;
                # the prober keeps checking it like every other endpoint.
                self.table.add(ep_id, url, [model], ready=True, api_key=api_key, node=node)
                self.endpoints[ep_id] = (url, model, api_key, node)
                log.info("endpoint_up", endpoint=ep_id, url=url, model=model, keyed=bool(api_key))
            ep = self.table.by_id.get(ep_id)
            if ep is not None and ep.draining != draining:
                self.table.mark_draining(ep_id, draining)
                log.info("endpoint_draining", endpoint=ep_id, draining=draining)
        for ep_id in sorted(set(self.endpoints) - set(want.endpoints)):
            self.table.remove(ep_id)
            del self.endpoints[ep_id]
            log.info("endpoint_down", endpoint=ep_id)

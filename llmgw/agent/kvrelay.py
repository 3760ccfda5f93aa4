"""The agent's KV relay: each local engine's KV events, folded and relayed onto NATS.

vLLM, SGLang and the sim, started with `--kv-events-config` (llmgw.agent.engines.kv_events),
publish their block events on a node-local ZMQ socket (ipc://, in the agent's state
directory: nothing off the node can connect). For each such engine an `EngineRelay`
subscribes, asks the engine's replay socket for what it published before the
subscription took, folds the batches into the keys of the blocks the engine holds
(llmgw.core.kvblocks.EngineBlocks), and publishes `KvUpdate`s through a `send`
function (a `bus.KvPublisher`, which signs them on the node's own subject):

- a delta of what was stored and removed, at most every `coalesce_s` (an engine sends a
  batch per scheduler step; routers need far fewer);
- every `full_every_s`, the whole resident set (in chunks of
  `kvblocks.MAX_KEYS_PER_UPDATE`), which lets a router that starts late, or missed an
  update, be right again without asking anyone;
- when the engine stops, an empty full update: routers drop its blocks at once.

A gap in the engine's sequence numbers is filled from its replay socket; when the
replay no longer holds the missing batches, the fold can lack blocks (they are never
predicted, which costs a cache hit, not a wrong answer) and says so in `gaps`.

`KvRelays` keeps one relay per local engine that publishes events, started and
stopped as the supervisor's views of the shards change.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import secrets
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import zmq
import zmq.asyncio
from nats.aio.client import Client

from llmgw import logs
from llmgw.agent.shards import LIVE, ShardView
from llmgw.bus.kvlog import KvPublisher
from llmgw.core import kvblocks

log = logs.get("llmgw.agent.kv")

Send = Callable[[kvblocks.KvUpdate], Awaitable[None]]

COALESCE_S = 0.05
FULL_EVERY_S = 5.0
FOLD_SLICE = 4096
"""Events of one batch read and folded between two turns of the agent's loop (tens of
milliseconds)."""
SEQ_BEHIND = 100_000
"""How far below the last batch number folded a batch may come and still be one already
folded (a replay's overlap with the live stream: within the engine's replay buffer, 10,000
steps by default in vLLM); further below, the numbering is not the one folded so far."""
MAX_BATCH_BYTES = 64 * 1024 * 1024
"""The largest message taken from an engine's sockets: the batch of a million-token prompt's
blocks (their token ids included) is about 5 MB, of ten million about 50; ZMQ would
otherwise take a frame of any size into the agent's memory (an engine that sends more is
disconnected, and subscribed to again for what follows)."""
QUEUED_BATCHES = 64
"""Batches ZMQ queues for the relay's subscription (its default is 1,000, which at the
largest size would be 64 GB): beyond, it drops them, and the gap is filled from the engine's
replay socket (whose own queue keeps ZMQ's default: a replay sends many batches at once)."""
RECONNECT_S = 0.2
"""The wait before subscribing again to an engine whose connection dropped."""
_END = -1


def _bounded(sock: zmq.asyncio.Socket, queued: int = 0) -> zmq.asyncio.Socket:
    """`sock` that takes at most `MAX_BATCH_BYTES` a message (and queues `queued`, if set)."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES)
    if queued:
        sock.setsockopt(zmq.RCVHWM, queued)
    return sock


def socket_dir(state_dir: Path) -> Path:
    """Where engines' KV event sockets go: `<state_dir>/kv`, private to the agent's user;
    under the temporary directory when that path is too long for a Unix socket (about
    107 bytes with the socket's own name)."""
    kv_dir = state_dir / "kv"
    if len(str(kv_dir)) > 80:
        tag = hashlib.blake2b(str(state_dir).encode(), digest_size=6).hexdigest()
        kv_dir = Path(tempfile.gettempdir()) / f"llmgw-kv-{tag}"
    kv_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    return kv_dir


class EngineRelay:
    """One engine's KV events: subscribe, fold, relay."""

    def __init__(
        self,
        *,
        endpoint: str,
        model: str,
        events_addr: str,
        replay_addr: str,
        send: Send,
        coalesce_s: float = COALESCE_S,
        full_every_s: float = FULL_EVERY_S,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.model = model
        self.events_addr = events_addr
        self.replay_addr = replay_addr
        self._send = send
        self.coalesce_s = coalesce_s
        self.full_every_s = full_every_s
        self._ctx = context or zmq.asyncio.Context.instance()
        self.instance = secrets.token_hex(8)
        self.blocks = kvblocks.EngineBlocks()
        self.block_size = 0
        self.last_engine_seq = -1
        self.batches = 0
        self.bad_batches = 0
        self.gaps = 0
        self.renumbered = 0
        """Times a batch came far below the last number folded (`SEQ_BEHIND`)."""
        self.reconnects = 0
        """Times the engine's connection dropped and the relay subscribed again."""
        self.updates = 0
        self._stored: dict[int, None] = {}
        self._removed: dict[int, None] = {}
        self._full_due = True
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"kv-relay-{self.endpoint}"
        )

    async def stop(self, *, tell: bool = True) -> None:
        """Stop listening and (`tell`) tell routers the engine holds nothing any more."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if tell and self.block_size:
            self.blocks = kvblocks.EngineBlocks()
            with contextlib.suppress(Exception):
                await self._publish_full()

    # ------------------------------------------------------------------ the loop

    async def _run(self) -> None:
        try:
            while True:
                await self._subscribed()
                # The engine's connection dropped: it stopped, or it sent a message past
                # MAX_BATCH_BYTES, after which ZMQ does not connect again by itself.
                self.reconnects += 1
                await asyncio.sleep(RECONNECT_S)
        except asyncio.CancelledError:
            raise
        except Exception:  # the relay is best effort: routing falls back, the agent goes on
            log.exception("kv_relay_failed", endpoint=self.endpoint)

    async def _subscribed(self) -> None:
        """Relay the engine's batches through one subscription, until its connection drops."""
        sub = _bounded(self._ctx.socket(zmq.SUB), QUEUED_BATCHES)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        dropped = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sub.connect(self.events_addr)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(dropped, zmq.POLLIN)
        try:
            # Whatever the engine published before this subscription took effect.
            await self._replay(self.last_engine_seq + 1)
            next_flush = time.monotonic() + self.coalesce_s
            next_full = time.monotonic()
            while True:
                now = time.monotonic()
                timeout_ms = max(0, int((min(next_flush, next_full) - now) * 1000))
                ready = dict(await poller.poll(timeout_ms))
                if sub in ready:
                    await self._on_frames(await sub.recv_multipart())
                    continue
                if dropped in ready:
                    return
                now = time.monotonic()
                if now >= next_full or self._full_due:
                    await self._publish_full()
                    next_full = now + self.full_every_s
                    next_flush = now + self.coalesce_s
                elif now >= next_flush:
                    await self._flush()
                    next_flush = now + self.coalesce_s
        finally:
            sub.disable_monitor()
            dropped.close(0)
            sub.close(0)

    async def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.bad_batches += 1
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        if seq == 0 and self.last_engine_seq > 0:
            # The engine counts from 0 again: a new process behind the same socket.
            self._restarted()
        elif seq <= self.last_engine_seq:
            if self.last_engine_seq - seq <= SEQ_BEHIND:
                return  # already folded (from the replay)
            # Far behind the last number folded: that number was not this engine's count
            # (a corrupt or foreign batch), and holding to it would pass over every real
            # batch until the engine restarts. Start over from this batch, as on a restart.
            log.warning("kv_events_renumbered", endpoint=self.endpoint, seq=seq,
                        last=self.last_engine_seq)  # fmt: skip
            self.renumbered += 1
            self._restarted()
        if seq > self.last_engine_seq + 1:
            await self._replay(self.last_engine_seq + 1)
            if seq <= self.last_engine_seq:
                return
            if seq > self.last_engine_seq + 1:
                self.gaps += 1
                log.warning("kv_events_gap", endpoint=self.endpoint,
                            missing=seq - self.last_engine_seq - 1)  # fmt: skip
        await self._fold(seq, frames[2])

    def _restarted(self) -> None:
        self.blocks = kvblocks.EngineBlocks()
        self.instance = secrets.token_hex(8)
        self.last_engine_seq = -1
        self._stored.clear()
        self._removed.clear()
        self._full_due = True

    async def _fold(self, seq: int, payload: bytes) -> None:
        """Fold the engine's batch `seq`. A batch of many events (a long prompt's blocks) is
        read and folded `FOLD_SLICE` events at a time, letting the agent's other work run in
        between: one of 200,000 blocks takes seconds, which heartbeats must not wait for."""
        self.last_engine_seq = seq
        try:
            _, items, _ = kvblocks.read_batch(payload)
            events: list[kvblocks.EngineEvent] = []
            for i in range(0, len(items), FOLD_SLICE):
                if i:
                    await asyncio.sleep(0)
                events += kvblocks.events_of(items[i : i + FOLD_SLICE])
        except kvblocks.BadBatch as exc:
            self.bad_batches += 1
            log.warning("kv_bad_batch", endpoint=self.endpoint, seq=seq, error=str(exc))
            return
        except Exception as exc:  # a decoder bug on an engine's bytes: that batch, not the relay
            self.bad_batches += 1
            log.warning("kv_bad_batch", endpoint=self.endpoint, seq=seq, error=repr(exc))
            return
        self.batches += 1
        for ev in events:
            if isinstance(ev, kvblocks.BlockStored):
                self.block_size = ev.block_size
                break
        for i in range(0, len(events), FOLD_SLICE):
            if i:
                await asyncio.sleep(0)
            self._apply(events[i : i + FOLD_SLICE])

    def _apply(self, events: list[kvblocks.EngineEvent]) -> None:
        """Fold `events` and note what changed for the next update (the changes of
        consecutive slices add up to those of the whole batch)."""
        stored, removed, cleared = self.blocks.apply(events)
        if cleared:
            self._stored.clear()
            self._removed.clear()
            self._full_due = True
        for k in removed:
            if self._stored.pop(k, 0) == 0:
                self._removed[k] = None
        for k in stored:
            self._removed.pop(k, None)
            self._stored[k] = None

    async def _replay(self, start: int) -> None:
        """Ask the engine's replay socket for its batches from `start` and fold them."""
        if not self.replay_addr:
            return
        dealer = _bounded(self._ctx.socket(zmq.DEALER))
        dealer.connect(self.replay_addr)
        try:
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while await dealer.poll(2000):
                frames = await dealer.recv_multipart()
                if len(frames) != 3:
                    break
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq == _END:
                    break
                if seq > self.last_engine_seq:
                    await self._fold(seq, frames[2])
        finally:
            dealer.close(0)

    # ------------------------------------------------------------------ updates

    def _update(self, *, full: bool, stored: list[int], removed: list[int]) -> kvblocks.KvUpdate:
        self.updates += 1
        roots = self.blocks.roots
        return kvblocks.KvUpdate(
            endpoint=self.endpoint,
            model=self.model,
            block_size=max(self.block_size, 1),
            instance=self.instance,
            seq=self.updates,
            full=full,
            stored=stored,
            removed=removed,
            roots=[k for k in stored if k in roots],
            ts=time.time(),
        )

    async def _flush(self) -> None:
        if not (self._stored or self._removed) or not self.block_size:
            return
        stored, removed = list(self._stored), list(self._removed)
        self._stored.clear()
        self._removed.clear()
        step = kvblocks.MAX_KEYS_PER_UPDATE
        for i in range(0, max(len(stored), len(removed)), step):
            await self._send(
                self._update(full=False, stored=stored[i : i + step], removed=removed[i : i + step])
            )

    async def _publish_full(self) -> None:
        if not self.block_size:
            return  # nothing stored yet: no block size to tell, nothing to hold
        self._full_due = False
        self._stored.clear()
        self._removed.clear()
        held = list(self.blocks.held)
        step = kvblocks.MAX_KEYS_PER_UPDATE
        await self._send(self._update(full=True, stored=held[:step], removed=[]))
        for i in range(step, len(held), step):
            await self._send(self._update(full=False, stored=held[i : i + step], removed=[]))


class KvRelays:
    """One EngineRelay per local engine that publishes KV events, following the shards.

    Updates go out once `bind` gave it the node's connection; before (an agent adopting
    its engines before it reaches NATS) they are dropped, and the next full update heals.
    """

    def __init__(self, *, coalesce_s: float = COALESCE_S,
                 full_every_s: float = FULL_EVERY_S) -> None:  # fmt: skip
        self.coalesce_s = coalesce_s
        self.full_every_s = full_every_s
        self.relays: dict[tuple[str, int], EngineRelay] = {}
        self.publisher: KvPublisher | None = None
        self.dropped = 0

    def bind(self, nc: Client | None, node: str) -> None:
        """Publish on `nc` as node `node` (None: an agent on an in-memory log; nothing goes)."""
        if nc is not None:
            self.publisher = KvPublisher(nc, node)

    async def _send(self, update: kvblocks.KvUpdate) -> None:
        if self.publisher is None:
            self.dropped += 1
            return
        try:
            await self.publisher.publish(update)
        except Exception as exc:  # disconnected: the next full update heals
            self.dropped += 1
            log.debug("kv_update_dropped", endpoint=update.endpoint, error=repr(exc))

    async def observe(self, view: ShardView) -> None:
        """A shard changed: start relaying a new engine, stop relaying one that ended."""
        if not view.kv_events:
            return
        key = (view.replica_id, view.generation)
        relay = self.relays.get(key)
        if view.phase in LIVE:
            if relay is None:
                relay = EngineRelay(
                    endpoint=view.replica_id,
                    model=view.model,
                    events_addr=view.kv_events,
                    replay_addr=view.kv_replay,
                    send=self._send,
                    coalesce_s=self.coalesce_s,
                    full_every_s=self.full_every_s,
                )
                self.relays[key] = relay
                relay.start()
                log.info("kv_relay_started", endpoint=view.replica_id, events=view.kv_events)
        elif relay is not None:
            del self.relays[key]
            await relay.stop()
            log.info("kv_relay_stopped", endpoint=view.replica_id)

    async def close(self) -> None:
        """Stop relaying. Engines outlive their agent, so routers are not told they hold
        nothing: the next agent's relays send their full sets again."""
        relays, self.relays = list(self.relays.values()), {}
        for relay in relays:
            await relay.stop(tell=False)

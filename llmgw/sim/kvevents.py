"""The sim's KV event publisher: vLLM's ZMQ wire format, from the block pool's events.

What `vllm serve --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
...}'` publishes, so that the code reading it (llmgw.agent.kvrelay) reads a real engine
too: after every engine step that changed the prefix cache, one `EventBatch` (ts, events,
data_parallel_rank) of `BlockStored` / `BlockRemoved` / `AllBlocksCleared` events,
msgpack-encoded as maps tagged by `type` (msgspec's tagged structs, as vLLM's
kv_events.py defines them), sent on a PUB socket as three frames: the topic, an 8-byte
big-endian sequence number counting batches from 0, the payload. The last
`buffer_steps` batches are kept; a ROUTER socket at `replay_endpoint` answers a request
(an 8-byte start sequence) with every kept batch from that sequence on as (seq,
payload) frames, then (-1, empty) to end.

A thread does the ZMQ work (pyzmq sockets are not asyncio's); the engine loop hands it
batches through a bounded queue and never waits: a full queue drops the batch and
counts it, as an engine would rather lose an event than a step.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq

from llmgw import logs
from llmgw.sim.config import KvEventsConfig
from llmgw.sim.kvcache import RemovedEvent, StoredEvent

log = logs.get("llmgw.sim")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def wire_events(events: list[StoredEvent | RemovedEvent], block_size: int) -> list[Any]:
    """The pool's event tuples as vLLM's tagged maps."""
    out: list[Any] = []
    for ev in events:
        if ev[0] == "stored":
            _, hashes, parent, ids, salt = ev  # type: ignore[misc]
            stored: dict[str, Any] = {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": parent,
                "token_ids": ids,
                "block_size": block_size,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            }
            if salt is not None:
                # vLLM's extra keys: one entry a block, the salt in the first block's.
                stored["extra_keys"] = [[salt]] + [None] * (len(hashes) - 1)
            out.append(stored)
        else:
            out.append({"type": "BlockRemoved", "block_hashes": ev[1], "medium": "GPU"})
    return out


def encode_batch(ts: float, events: list[Any]) -> bytes:
    return msgspec.msgpack.encode({"ts": ts, "events": events, "data_parallel_rank": 0})


def _binds(endpoint: str) -> bool:
    # vLLM's rule: bind wildcard, ipc and inproc addresses, connect to anything else.
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class Publisher:
    """PUB + replay ROUTER sockets on a thread of their own."""

    def __init__(self, cfg: KvEventsConfig, block_size: int) -> None:
        self.cfg = cfg
        self.block_size = block_size
        self.dropped = 0
        self.sent = 0
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=cfg.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            if _binds(cfg.endpoint):
                self._pub.bind(cfg.endpoint)
            else:
                self._pub.connect(cfg.endpoint)
            if cfg.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(cfg.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise OSError(f"cannot open the KV event sockets: {exc}") from None
        self._topic = cfg.topic.encode()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(
        self, events: list[StoredEvent | RemovedEvent] | None, *, cleared: bool = False
    ) -> None:
        """Queue one batch (never blocks); `cleared` sends AllBlocksCleared first."""
        wire = [{"type": "AllBlocksCleared"}] if cleared else []
        if events:
            wire += wire_events(events, self.block_size)
        if not wire:
            return
        try:
            self._queue.put_nowait(encode_batch(time.time(), wire))
        except queue.Full:
            self.dropped += 1

    def close(self) -> None:
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        self._thread.join(timeout=2.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)
        self._ctx.term()

    def _run(self) -> None:
        seq = 0
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except zmq.ZMQError as exc:
                    log.warning("kv_replay_failed", error=str(exc))
            try:
                payload = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if payload is None:
                return
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError as exc:
                log.warning("kv_publish_failed", error=str(exc))
                continue
            self._buffer.append((seq, payload))
            self.sent += 1
            seq += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv_replay_bad_request", frames=len(frames))
            return
        client, _, start_b = frames
        start = int.from_bytes(start_b, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

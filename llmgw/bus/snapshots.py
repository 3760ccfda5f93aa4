"""Snapshots of folded state, so that a cold start is snapshot + tail, never the whole history.

The control plane (and `llmgw ctl replay`) saves the bytes of its folded state
together with the last stream sequence folded into it; a later start loads the
newest snapshot (or the newest at or before a sequence, for a replay to a point
in the past) and reads the log after that sequence with `Reader(after_seq=seq)`.

Folded state of a large fleet can be megabytes, more than a KV value may hold
(the server's max_payload, 1 MiB by default), so snapshots live in the JetStream
object store `llmgw-snapshots`, which chunks them. Each object is named after its
sequence, `state-<seq, 20 digits>`, and the store keeps the newest `keep` ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import re

import msgspec
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.object_store import ObjectStore

from llmgw import logs
from llmgw.bus.provisioning import SNAPSHOT_BUCKET

log = logs.get("llmgw.bus")

_NAME = re.compile(r"state-(\d{20})")


class Snapshot(msgspec.Struct, frozen=True):
    """Folded state bytes and the last stream sequence folded into them."""

    seq: int
    data: bytes


def object_name(seq: int) -> str:
    """`state-<seq>`, zero-padded so that names sort as the sequences do. Pure."""
    if seq < 0:
        raise ValueError(f"a snapshot sequence is >= 0, got {seq}")
    return f"state-{seq:020d}"


def seq_of(name: str) -> int | None:
    """The sequence a snapshot object's name encodes, or None for any other object. Pure."""
    match = _NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def choose(seqs: list[int], at_or_before: int | None) -> int | None:
    """The newest sequence, or the newest at or before `at_or_before`. Pure."""
    eligible = [s for s in seqs if at_or_before is None or s <= at_or_before]
    return max(eligible) if eligible else None


class SnapshotStore:
    """Save and load folded state in the object store `llmgw-snapshots`."""

    def __init__(self, store: ObjectStore, *, keep: int = 5, load_timeout_s: float = 60.0) -> None:
        self._store = store
        self.keep = max(1, keep)
        self.load_timeout_s = load_timeout_s

    @classmethod
    async def open(
        cls, js: JetStreamContext, *, keep: int = 5, load_timeout_s: float = 60.0
    ) -> SnapshotStore:
        """Bind to the store; `provision` creates it (the control identity may)."""
        try:
            store = await js.object_store(SNAPSHOT_BUCKET)
        except nats.js.errors.BucketNotFoundError:
            raise RuntimeError(
                f"object store {SNAPSHOT_BUCKET} does not exist: run the control plane once "
                "(it provisions the log), or call llmgw.bus.provision"
            ) from None
        return cls(store, keep=keep, load_timeout_s=load_timeout_s)

    async def seqs(self) -> list[int]:
        """Sequences of the snapshots stored, ascending."""
        try:
            infos = await self._store.list(ignore_deletes=True)
        except nats.js.errors.NotFoundError:
            return []
        found = (seq_of(info.name) for info in infos if not info.deleted)
        return sorted(s for s in found if s is not None)

    async def save(self, data: bytes, seq: int) -> None:
        """Store `data` as the state folded up to and including `seq`; prune old ones."""
        await self._store.put(object_name(seq), data)
        log.info("bus.snapshot_saved", seq=seq, bytes=len(data))
        stored = await self.seqs()
        for old in stored[: max(0, len(stored) - self.keep)]:
            with contextlib.suppress(nats.js.errors.NotFoundError):  # pruned concurrently
                await self._store.delete(object_name(old))

    async def load(self, *, at_or_before: int | None = None) -> Snapshot | None:
        """The newest readable snapshot (at or before a sequence, if given), or None.

        A snapshot that cannot be read back whole (chunks lost, digest mismatch,
        nothing arriving within load_timeout_s) is logged and passed over for the
        next older one: an older snapshot only means a longer tail to fold.
        """
        candidates = await self.seqs()
        while (seq := choose(candidates, at_or_before)) is not None:
            candidates.remove(seq)
            try:
                result = await asyncio.wait_for(
                    self._store.get(object_name(seq)), timeout=self.load_timeout_s
                )
            except (TimeoutError, nats.errors.Error) as exc:
                log.warning(
                    "bus.snapshot_unreadable", seq=seq, error=str(exc) or type(exc).__name__
                )
                continue
            return Snapshot(seq=seq, data=bytes(result.data or b""))
        return None

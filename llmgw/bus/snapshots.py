"""Snapshots of folded state, so that a cold start is snapshot + tail, never the whole history.

The control plane (and `llmgw ctl replay`) saves the bytes of its folded state
together with the last stream sequence folded into it; a later start loads the
newest snapshot (or the newest at or before a sequence, for a replay to a point
in the past) and reads the log after that sequence with `Reader(after_seq=seq)`.

Folded state of a large fleet can be megabytes, more than a KV value may hold
(the server's max_payload, 1 MiB by default), so snapshots live in the JetStream
object store `llmgw-snapshots`, which chunks them. Each object is named after its
sequence, `state-<seq, 20 digits>`, and the store keeps the newest `keep` ones.

Reads go by request only (a stream-info listing of the objects' metadata, then one
message get per chunk), never through a push consumer: no account of the fleet imports
the deliveries a push consumer would make (llmgw.pki.authorization says why). A pruned
snapshot's metadata is purged with its chunks, so the listing stays as short as `keep`.

Each object is sealed by the control plane that saved it (`seal`: a signature over
the sequence and the SHA-256 of the data, with the signer's certificate), and `load`
opens only what a control identity of the fleet's CA signed for that very sequence;
anything else (unsigned, another identity's, moved to another name, altered) is
logged as `bus.snapshot_refused` and passed over like an unreadable snapshot, so a
cold start then folds from an older snapshot or from the log itself.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import re
import time

import msgspec
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext, api
from nats.js.object_store import ObjectStore

from llmgw import logs
from llmgw.bus.keys import signer_of, verifier_of
from llmgw.bus.provisioning import SNAPSHOT_BUCKET
from llmgw.pki.signing import SignatureRefused, Signer, Verifier, snapshot_message

log = logs.get("llmgw.bus")

_NAME = re.compile(r"state-(\d{20})")
_STREAM = f"OBJ_{SNAPSHOT_BUCKET}"
_META = f"$O.{SNAPSHOT_BUCKET}.M."
_CHUNKS = f"$O.{SNAPSHOT_BUCKET}.C."
_SEALED = b"llmgw-snapshot-signed/v1\n"


class _Seal(msgspec.Struct, frozen=True):
    sig: str
    cert: str


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


def _b64(name: str) -> str:
    return base64.urlsafe_b64encode(name.encode()).decode()


def choose(seqs: list[int], at_or_before: int | None) -> int | None:
    """The newest sequence, or the newest at or before `at_or_before`. Pure."""
    eligible = [s for s in seqs if at_or_before is None or s <= at_or_before]
    return max(eligible) if eligible else None


def seal(signer: Signer, seq: int, data: bytes) -> bytes:
    """The bytes stored for `data` folded up to `seq`: a signed header, then the data."""
    header = msgspec.json.encode(_Seal(signer.sign(snapshot_message(seq, data)), signer.cert_b64))
    return _SEALED + header + b"\n" + data


def unseal(verifier: Verifier, seq: int, sealed: bytes, now: float) -> bytes:
    """The data of a sealed snapshot of `seq` signed by a control identity; else
    SignatureRefused. Pure given `now`."""
    if not sealed.startswith(_SEALED):
        raise SignatureRefused("not a signed snapshot")
    header, sep, data = sealed[len(_SEALED) :].partition(b"\n")
    if not sep:
        raise SignatureRefused("a signed snapshot without its data")
    try:
        found = msgspec.json.decode(header, type=_Seal)
    except msgspec.DecodeError:
        raise SignatureRefused("the snapshot's signature header does not decode") from None
    signer = verifier.verify(snapshot_message(seq, data), found.sig, found.cert, now)
    if signer.kind != "control":
        raise SignatureRefused(f"signed by {signer}: only a control plane writes snapshots")
    return data


class SnapshotStore:
    """Save and load folded state in the object store `llmgw-snapshots`."""

    def __init__(
        self,
        store: ObjectStore,
        js: JetStreamContext,
        *,
        keep: int = 5,
        load_timeout_s: float = 60.0,
        verifier: Verifier,
        signer: Signer | None = None,
    ) -> None:
        self._store = store
        self._js = js
        self._verifier = verifier
        self._signer = signer
        self.keep = max(1, keep)
        self.load_timeout_s = load_timeout_s

    @classmethod
    async def open(
        cls,
        js: JetStreamContext,
        *,
        keep: int = 5,
        load_timeout_s: float = 60.0,
        signer: Signer | None = None,
        verifier: Verifier | None = None,
    ) -> SnapshotStore:
        """Bind to the store; `provision` creates it (the control identity may).

        `signer` (to save) and `verifier` (to load) default to the connection's keys."""
        verifier = verifier if verifier is not None else verifier_of(js)
        if verifier is None:
            raise ValueError(
                "a SnapshotStore needs the CA's Verifier: connect with "
                "bus.connect(..., keys=...) or pass verifier="
            )
        signer = signer if signer is not None else signer_of(js)
        try:
            store = await js.object_store(SNAPSHOT_BUCKET)
        except nats.js.errors.BucketNotFoundError:
            raise RuntimeError(
                f"object store {SNAPSHOT_BUCKET} does not exist: run the control plane once "
                "(it provisions the log), or call llmgw.bus.provision"
            ) from None
        return cls(
            store, js, keep=keep, load_timeout_s=load_timeout_s, verifier=verifier, signer=signer
        )

    async def seqs(self) -> list[int]:
        """Sequences of the snapshots stored, ascending."""
        return sorted(
            s for s in (seq_of(info.name or "") for info in await self._infos()) if s is not None
        )

    async def _infos(self) -> list[api.ObjectInfo]:
        # The metadata subjects the stream holds, then each one's last message.
        info = await self._js.stream_info(_STREAM, subjects_filter=f"{_META}>")
        out = []
        for subject in sorted((info.state.subjects or {}) if info.state else {}):
            with contextlib.suppress(nats.js.errors.NotFoundError):  # pruned meanwhile
                msg = await self._js.get_last_msg(_STREAM, subject)
                try:
                    found = api.ObjectInfo.from_response(json.loads(msg.data or b"{}"))
                except (ValueError, TypeError, KeyError):
                    log.warning("snapshot_meta_unreadable", subject=subject)
                    continue
                if not found.deleted:
                    out.append(found)
        return out

    async def _read(self, name: str) -> bytes:
        """An object's bytes, chunk by chunk with message gets, its digest checked."""
        info = await self._store.get_info(name)  # a last-message get of its metadata
        if not info.nuid:
            raise nats.js.errors.NotFoundError
        subject = _CHUNKS + info.nuid
        data = bytearray()
        seq = 0
        for _ in range(info.chunks or 0):
            msg = await self._js.get_msg(_STREAM, seq=seq, subject=subject, next=True)
            data += msg.data or b""
            seq = (msg.seq or seq) + 1
        digest = (info.digest or "").partition("=")[2]
        if len(data) != (info.size or 0) or (
            base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4))
            != hashlib.sha256(data).digest()
        ):
            raise nats.js.errors.Error(f"{name}: its chunks do not match its size and digest")
        return bytes(data)

    async def save(self, data: bytes, seq: int) -> None:
        """Store `data` as the state folded up to and including `seq`; prune old ones."""
        if self._signer is None:
            raise ValueError("saving a snapshot needs a Signer (a control plane's keys)")
        await self._store.put(object_name(seq), seal(self._signer, seq, data))
        log.info("snapshot_saved", seq=seq, bytes=len(data))
        stored = await self.seqs()
        for old in stored[: max(0, len(stored) - self.keep)]:
            with contextlib.suppress(nats.js.errors.NotFoundError):  # pruned concurrently
                await self._store.delete(object_name(old))
            # The delete leaves a metadata tombstone per name, and every name is new.
            await self._js.purge_stream(_STREAM, subject=_META + _b64(object_name(old)))

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
                sealed = await asyncio.wait_for(
                    self._read(object_name(seq)), timeout=self.load_timeout_s
                )
            except (TimeoutError, nats.errors.Error) as exc:
                log.warning("snapshot_unreadable", seq=seq, error=str(exc) or type(exc).__name__)
                continue
            try:
                data = unseal(self._verifier, seq, sealed, time.time())
            except SignatureRefused as exc:
                log.warning("snapshot_refused", seq=seq, error=str(exc))
                continue
            return Snapshot(seq=seq, data=data)
        return None

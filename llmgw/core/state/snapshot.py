"""The folded state as bytes (snapshots) and as a digest (what two folds compare).

A snapshot holds the whole state, the volatile part included, so a reader resumes from it
without re-reading the log; the digest covers only the durable part, so a replay of the
log after heartbeats expired reaches the leader's digest.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from llmgw.core.state.model import ClusterState

SNAPSHOT_FORMAT = 1


class _Snapshot(msgspec.Struct, kw_only=True):
    format: int
    state: ClusterState


_digest_encoder = msgspec.msgpack.Encoder()
_snapshot_encoder = msgspec.msgpack.Encoder()
_snapshot_decoder = msgspec.msgpack.Decoder(_Snapshot)


def _canonical(struct: msgspec.Struct) -> list[Any]:
    """A struct's fields with every mapping as key-sorted pairs: independent of insertion order."""
    return [
        sorted(value.items()) if isinstance(value, dict) else value
        for value in msgspec.structs.astuple(struct)
    ]


def digest(state: ClusterState) -> str:
    """sha256 of the durable state's canonical encoding: equal iff the logs folded agree.

    The volatile part (`seen`: heartbeats) and `last_seq` are left out, so a
    replay of the log after heartbeats expired reaches the leader's digest.
    """
    durable = [
        [_canonical(state.nodes[k]) for k in sorted(state.nodes)],
        [(k, state.models[k]) for k in sorted(state.models)],
        [(k, state.replicas[k]) for k in sorted(state.replicas)],
        [(k, state.endpoints[k]) for k in sorted(state.endpoints)],
        state.epoch,
        state.leader,
    ]
    if state.quarantined:
        # Only when there is one: the digest of every log without quarantines is unchanged.
        durable.append([(k, state.quarantined[k]) for k in sorted(state.quarantined)])
    if state.keys:
        durable.append([(k, state.keys[k]) for k in sorted(state.keys)])
    return hashlib.sha256(_digest_encoder.encode(durable)).hexdigest()


def encode_snapshot(state: ClusterState) -> bytes:
    """The whole state (volatile part included) as bytes; store with `state.last_seq`."""
    return _snapshot_encoder.encode(_Snapshot(format=SNAPSHOT_FORMAT, state=state))


def decode_snapshot(data: bytes | bytearray | memoryview) -> ClusterState:
    """Inverse of encode_snapshot; raises ValueError on bytes that are not a snapshot."""
    try:
        snap = _snapshot_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"not an llmgw state snapshot: {exc}") from None
    if snap.format != SNAPSHOT_FORMAT:
        raise ValueError(
            f"snapshot format {snap.format}, this llmgw reads {SNAPSHOT_FORMAT}: "
            "fold the log from the start instead (delete the snapshot)"
        )
    return snap.state

"""Events as bytes: `encode`, and `decode` with the upcaster chain for older versions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from llmgw.core.events import BY_TAG, EVENT_TYPES, AnyEvent, Event, current_version, tag_of


class DecodeError(ValueError):
    """A message that is not a valid llmgw event of any known version."""


Upcaster = Callable[[dict[str, Any]], dict[str, Any]]

# (tag, from_version) -> function turning that version's raw mapping into the next version's.
UPCASTERS: dict[tuple[str, int], Upcaster] = {}


def upcaster(tag: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
    def register(fn: Upcaster) -> Upcaster:
        UPCASTERS[(tag, from_version)] = fn
        return fn

    return register


@upcaster("node.shard", 1)
def _shard_status_v1_to_v2(raw: dict[str, Any]) -> dict[str, Any]:
    """v1 carried the engine's output as one string `log`; v2 keeps a tail of lines."""
    out = dict(raw)
    log = out.pop("log", "")
    out["log_tail"] = [line for line in str(log or "").splitlines() if line][-50:]
    out["v"] = 2
    return out


_encoder = msgspec.json.Encoder()
_decoder: msgspec.json.Decoder[AnyEvent] = msgspec.json.Decoder(AnyEvent)
_raw_decoder = msgspec.json.Decoder(dict[str, Any])
_CURRENT: dict[str, int] = {tag: current_version(cls) for tag, cls in BY_TAG.items()}
# The same keyed by class: `decode` runs once per event of every replay, and this lookup
# is measurably cheaper than deriving the tag first (tests/bench/bench_log.py).
_CURRENT_BY_TYPE: dict[type[Event], int] = {cls: _CURRENT[tag_of(cls)] for cls in EVENT_TYPES}


def encode(event: Event) -> bytes:
    return _encoder.encode(event)


def decode(data: bytes | bytearray | memoryview) -> AnyEvent:
    """Decode one message into its current-version event, or raise DecodeError.

    Fast path: a current-version message decodes straight into its Struct. Only
    an older version, or a message that fails validation, takes the slow path
    through the raw mapping and the upcaster chain.
    """
    try:
        event = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return _decode_old(data, exc)
    if event.v == _CURRENT_BY_TYPE[type(event)]:
        return event
    return _decode_old(data, None)


def _decode_old(data: bytes | bytearray | memoryview, first: Exception | None) -> AnyEvent:
    try:
        raw = _raw_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise DecodeError(f"not a JSON object: {exc}") from None
    tag, version = raw.get("type"), raw.get("v", 1)
    if not isinstance(tag, str) or tag not in BY_TAG:
        raise DecodeError(f"unknown event type {tag!r}")
    if not isinstance(version, int) or isinstance(version, bool):
        raise DecodeError(f"{tag}: version {version!r} is not an integer")
    current = _CURRENT[tag]
    if version > current:
        raise DecodeError(
            f"{tag} v{version} is newer than this llmgw understands (v{current}): upgrade llmgw"
        )
    while version < current:
        step = UPCASTERS.get((tag, version))
        if step is None:
            raise DecodeError(f"{tag} v{version}: no upcaster to v{version + 1}")
        try:
            raw = step(raw)
        except Exception as exc:
            raise DecodeError(f"{tag} v{version}: upcasting failed: {exc}") from None
        version += 1
    try:
        result: AnyEvent = msgspec.convert(raw, AnyEvent)
    except msgspec.ValidationError as exc:
        detail = first or exc
        raise DecodeError(f"{tag} v{version}: {detail}") from None
    return result

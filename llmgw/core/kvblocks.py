"""Prompt blocks of the engines' KV caches, keyed the same way by engines' events and by routers.

An engine with prefix caching keeps the KV of whole blocks of `block_size` tokens and
finds a block again by a chained hash of its tokens and everything before it. Its own
hash is internal (vLLM's is a salted SHA-256 or a Python hash, SGLang's its own), so
llmgw keys blocks by what both sides can compute: `block_keys` chains a BLAKE2b of each
block's token ids onto its parent's key. A router computes the keys of a request's prompt
from the model's tokenizer; an agent computes the keys of what an engine stored from the
token ids its `BlockStored` events carry (llmgw.agent.kvrelay). Equal keys mean equal
whole prefixes.

`EngineBlocks` folds one engine's events (vLLM's `BlockStored` / `BlockRemoved` /
`AllBlocksCleared`, decoded by `decode_batch`, which reads both the array and the map
encodings vLLM and SGLang have used) into the set of keys it holds. `KvUpdate` is what an
agent relays onto NATS for one endpoint: the keys stored and removed since the last one,
or the whole resident set (`full`), so a router that starts late is warm from the latest
full update on. Purely computational.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from typing import Annotated, Any, TypeAlias

import msgspec

from llmgw.core.limits import Name

KEY_ROOT = 0
"""The parent key of a prompt's first block (of a prompt sent with no `cache_salt`)."""
MAX_TOKEN_ID = (1 << 64) - 1
MAX_BLOCK_SIZE = 16_384
"""The largest block size taken from an engine, in tokens. vLLM's and SGLang's are small
(16 and 1 by default, 32 to 256 for some attention kernels), but vLLM sizes a hybrid
model's attention blocks to hold as much as a mamba state's page: 528 to a little over
2,000 tokens on today's models, twice that with a smaller KV dtype. Larger is no engine's
(and the number of distinct sizes, not their size, is what costs a router:
llmgw.core.kvindex)."""
BlockSize: TypeAlias = Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCK_SIZE)]


def block_keys(
    token_ids: Sequence[int], block_size: int, *, parent: int = KEY_ROOT, limit: int = -1
) -> list[int]:
    """Chained keys of the whole blocks of `token_ids` (a trailing partial block has none),
    at most `limit` of them (-1: all). Each key covers its block and every block before it.

    Raises ValueError for a block size below 1 or a token id outside 0..2**64-1.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, not {block_size}")
    n = len(token_ids) // block_size
    if 0 <= limit < n:
        n = limit
    if n == 0:
        return []
    try:
        packed = struct.pack(f"<{n * block_size}Q", *token_ids[: n * block_size])
    except struct.error:
        raise ValueError("token ids must be integers in 0..2**64-1") from None
    step = 8 * block_size
    out: list[int] = []
    blake = hashlib.blake2b
    from_bytes = int.from_bytes
    prev = parent.to_bytes(8, "little")
    for i in range(0, n * step, step):
        prev = blake(prev + packed[i : i + step], digest_size=8).digest()
        out.append(from_bytes(prev, "little"))
    return out


def salt_root(salt: str | None) -> int:
    """The parent key of the first block of a prompt sent with `cache_salt` = `salt`.

    vLLM folds a request's salt into its first block's hash, so its blocks are shared only
    with requests of the same salt; keying them under a root of the salt's own keeps that
    true of llmgw's keys: a router keys a salted prompt from the salt it sends, an agent
    the blocks an engine stored from the salt its event reports (`BlockStored.salt`)."""
    if salt is None:
        return KEY_ROOT
    digest = hashlib.blake2b(salt.encode(), digest_size=8, person=b"llmgw-kv-salt").digest()
    return int.from_bytes(digest, "little") or 1  # never KEY_ROOT, an unsalted prompt's


# ------------------------------------------------------------------ engine events


class BlockStored(msgspec.Struct, frozen=True):
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None
    """Set (or an integer `lora_id` in older engines) for a block computed with a LoRA
    adapter: llmgw routes base models, so such blocks are not folded."""
    medium: str | None = None
    group_idx: int | None = None
    salt: str | None = None
    """The `cache_salt` of the request that stored a prompt's first block (parent None),
    as vLLM reports it in the block's `extra_keys`; None for an unsalted prompt, or an
    engine that does not report it."""


class BlockRemoved(msgspec.Struct, frozen=True):
    block_hashes: list[Any]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True):
    pass


EngineEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, frozen=True):
    ts: float
    events: list[EngineEvent]
    data_parallel_rank: int | None = None


class BadBatch(ValueError):
    """An engine's message that is not a KV event batch."""


# Field order of vLLM's array encoding (msgspec `array_like`, the tag first).
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name", "extra_keys", "group_idx")  # fmt: skip
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def _hashable(value: Any, depth: int = 0) -> Any:
    """A block hash as a dict key: an integer, bytes or a short tuple of them (nested a
    level or two at most: an engine's batch must not recurse the relay to its limit)."""
    if isinstance(value, int | bytes | str) or value is None:
        return value
    if isinstance(value, list):
        if depth >= 2:
            raise BadBatch("a block hash nests lists more than two deep")
        return tuple(_hashable(v, depth + 1) for v in value)
    raise BadBatch(f"a block hash must be an integer or bytes, not {type(value).__name__}")


def _kind(raw: Any) -> str:
    if isinstance(raw, dict):
        return str(raw.get("type"))
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        return raw[0]
    raise BadBatch("an event must be a tagged array or map")


def _fields(raw: Any, names: Sequence[str]) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    return dict(zip(names, raw[1:], strict=False))


def _event(raw: Any) -> EngineEvent | None:
    kind = _kind(raw)
    if kind == "BlockStored":
        f = _fields(raw, _STORED_FIELDS)
        raw_medium, raw_group = f.get("medium"), f.get("group_idx")
        medium = raw_medium if isinstance(raw_medium, str) else None
        group = raw_group if type(raw_group) is int else None
        if not _gpu(medium, group):
            # Not folded (`_gpu`), so not checked either: vLLM's offloading connector sends
            # CPU placeholders (no token ids, block size 0) in the same batch as GPU stores.
            return None
        ids = f.get("token_ids")
        hashes = f.get("block_hashes")
        size = f.get("block_size")
        if not isinstance(ids, list) or not isinstance(hashes, list) or type(size) is not int:
            raise BadBatch("BlockStored needs block_hashes, token_ids and block_size")
        if not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in ids):
            raise BadBatch("BlockStored token_ids must be integers in 0..2**64-1")
        if not 1 <= size <= MAX_BLOCK_SIZE:
            raise BadBatch(f"BlockStored block_size {size} is outside 1..{MAX_BLOCK_SIZE}")
        if len(ids) < size * len(hashes):
            raise BadBatch(
                f"BlockStored holds {len(ids)} token ids for {len(hashes)} blocks of {size}"
            )
        lora = f.get("lora_name")
        if lora is None and type(f.get("lora_id")) is int:
            lora = str(f["lora_id"])
        parent = _hashable(f.get("parent_block_hash"))
        return BlockStored(
            [_hashable(h) for h in hashes],
            parent,
            ids,
            size,
            lora if isinstance(lora, str) else None,
            medium,
            group,
            _salt_of(f.get("extra_keys")) if parent is None else None,
        )
    if kind == "BlockRemoved":
        f = _fields(raw, _REMOVED_FIELDS)
        hashes = f.get("block_hashes")
        if not isinstance(hashes, list):
            raise BadBatch("BlockRemoved needs block_hashes")
        medium = f.get("medium")
        group = f.get("group_idx")
        return BlockRemoved(
            [_hashable(h) for h in hashes],
            medium if isinstance(medium, str) else None,
            group if type(group) is int else None,
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None  # a kind of a newer engine: not ours to fold


def _salt_of(extra_keys: Any) -> str | None:
    """The salt among a prompt's first block's extra keys. vLLM lists them as LoRA name,
    multi-modal (identifier, offset) pairs, the salt, prompt-embedding digests (bytes): in a
    block without LoRA (a LoRA block is not folded) the last string is the salt."""
    if not isinstance(extra_keys, list) or not extra_keys:
        return None
    first = extra_keys[0]
    if not isinstance(first, list):
        return None
    strings = [k for k in first if isinstance(k, str)]
    return strings[-1] if strings else None


_MAP_FIRST = frozenset((*range(0x80, 0x90), 0xDE, 0xDF))
_ARRAY_FIRST = frozenset((*range(0x90, 0xA0), 0xDC, 0xDD))
_FRAME_MAP = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])
_FRAME_ARRAY = msgspec.msgpack.Decoder(list[msgspec.Raw])
_ANY = msgspec.msgpack.Decoder()
_SHAPE = "a batch must be an array or a map of ts, events"
_FIELDS = "a batch needs a numeric ts and a list of events"


def read_batch(payload: bytes) -> tuple[float, list[msgspec.Raw], int | None]:
    """An engine's KV event batch (msgpack, either encoding): its ts, its events still
    encoded, and its data-parallel rank; BadBatch if it is not one. Only the batch's frame
    is read: `events_of` reads the events, as many at a time as its caller likes, so that
    a batch of a million-token prompt's blocks need not be read in one go."""
    first = payload[0] if payload else None
    try:
        if first in _MAP_FIRST:
            frame = _FRAME_MAP.decode(payload)
            ts_raw, items_raw = frame.get("ts"), frame.get("events")
            rank_raw = frame.get("data_parallel_rank")
        elif first in _ARRAY_FIRST:
            parts = _FRAME_ARRAY.decode(payload)
            if len(parts) < 2:
                raise BadBatch(_SHAPE)
            ts_raw, items_raw = parts[0], parts[1]
            rank_raw = parts[2] if len(parts) > 2 else None
        else:
            _ANY.decode(payload)  # what it is not, said as msgpack's own error if it is none
            raise BadBatch(_SHAPE)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise BadBatch(f"not msgpack: {exc}") from None
    try:
        ts = None if ts_raw is None else _ANY.decode(ts_raw)
        items = None if items_raw is None else _FRAME_ARRAY.decode(items_raw)
        rank = None if rank_raw is None else _ANY.decode(rank_raw)
    except (msgspec.DecodeError, RecursionError):
        raise BadBatch(_FIELDS) from None
    if not isinstance(ts, int | float) or items is None:
        raise BadBatch(_FIELDS)
    return float(ts), items, rank if type(rank) is int else None


def events_of(items: Sequence[msgspec.Raw]) -> list[EngineEvent]:
    """The events of `items` (a batch's, from `read_batch`); BadBatch for one that is not
    an event. Kinds this version does not know, and stores it does not fold, are left out."""
    out = []
    for raw in items:
        try:
            value = _ANY.decode(raw)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise BadBatch(f"not msgpack: {exc}") from None
        event = _event(value)
        if event is not None:
            out.append(event)
    return out


def decode_batch(payload: bytes) -> EventBatch:
    """An engine's KV event batch (msgpack), in either encoding; BadBatch if it is not one.
    Events of kinds this version does not know are left out."""
    ts, items, rank = read_batch(payload)
    return EventBatch(ts, events_of(items), rank)


def _gpu(medium: str | None, group: int | None) -> bool:
    # Blocks offloaded to CPU or disk, and the second KV group of a hybrid model, do not
    # make a prompt's prefill cheaper the way the GPU prefix cache does: not folded.
    return (medium is None or medium.upper() == "GPU") and not group


MAX_HELD = 4_000_000
"""The most engine blocks one engine's fold holds: what a router keeps of one endpoint
(llmgw.core.kvindex.MAX_KEYS_PER_ENDPOINT), more than any engine's cache has."""


class EngineBlocks:
    """The keys of the blocks one engine holds, folded from its events.

    `apply` returns what changed: the keys newly held and the keys no longer held. A
    BlockStored whose parent it never saw stored (it started listening late, or missed a
    batch) cannot be keyed and is counted in `unkeyed`, and so are blocks past `MAX_HELD`:
    an engine that stores and never removes (a bug, or a lie) must not grow the agent's
    memory without bound.
    """

    def __init__(self) -> None:
        self.key_of: dict[Any, int] = {}
        """Engine hash -> key."""
        self.held: dict[int, int] = {}
        """Key -> how many engine blocks hold it (two engine hashes may share content)."""
        self.roots: set[int] = set()
        """Held keys that begin a prompt (stored with no parent): one per prefix family."""
        self.unkeyed = 0

    def __len__(self) -> int:
        return len(self.held)

    def apply(self, events: Iterable[EngineEvent]) -> tuple[list[int], list[int], bool]:
        """Fold events; (keys now held, keys no longer held, whether everything was cleared
        first). Keys are each reported once per call, in the order they changed."""
        stored: dict[int, None] = {}
        removed: dict[int, None] = {}
        cleared = False
        for ev in events:
            if isinstance(ev, BlockStored):
                if not _gpu(ev.medium, ev.group_idx) or ev.lora_name is not None:
                    continue
                parent = ev.parent_block_hash
                key = salt_root(ev.salt) if parent is None else self.key_of.get(parent)
                if key is None:
                    self.unkeyed += len(ev.block_hashes)
                    continue
                size = ev.block_size
                keys = block_keys(ev.token_ids[: size * len(ev.block_hashes)], size, parent=key)
                if parent is None and keys:
                    self.roots.add(keys[0])
                for h, k in zip(ev.block_hashes, keys, strict=True):
                    if h in self.key_of:
                        continue  # a repeated event (at-least-once delivery)
                    if len(self.key_of) >= MAX_HELD:
                        self.unkeyed += 1  # its children, parentless, are unkeyed too
                        continue
                    self.key_of[h] = k
                    n = self.held.get(k, 0)
                    self.held[k] = n + 1
                    if n == 0:
                        removed.pop(k, None)
                        stored[k] = None
            elif isinstance(ev, BlockRemoved):
                if not _gpu(ev.medium, ev.group_idx):
                    continue
                for h in ev.block_hashes:
                    if h not in self.key_of:
                        continue
                    k = self.key_of.pop(h)
                    n = self.held[k] - 1
                    if n:
                        self.held[k] = n
                    else:
                        del self.held[k]
                        self.roots.discard(k)
                        if k in stored:
                            del stored[k]  # stored and gone within this call
                        else:
                            removed[k] = None
            else:
                self.key_of.clear()
                self.held.clear()
                self.roots.clear()
                stored.clear()
                removed.clear()
                cleared = True
        return list(stored), list(removed), cleared


# ------------------------------------------------------------------ the relayed form


class KvUpdate(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """One endpoint's change of cache, as an agent relays it (msgpack on `llmgw.kv.<node>...`).

    `instance` changes whenever the engine (re)starts: a router drops what it knew of an
    older instance. `seq` counts the updates of one instance from 1, so a router notices one
    it missed and waits for the next `full` update (sent every few seconds) rather than
    trusting an index with a hole in it.

    Its names are bounded as the log's are (`llmgw.core.limits.Name`): every router keeps
    them for each endpoint it indexes, so a node must not make them megabytes long.
    """

    endpoint: Name
    model: Name
    block_size: BlockSize
    instance: Name
    seq: int
    full: bool = False
    """`stored` is everything the engine holds; anything else known of it goes."""
    stored: list[int] = []
    removed: list[int] = []
    roots: list[int] = []
    """Keys among those held that begin a prompt (one per prefix family): routers spread
    new prefixes over the engines holding fewest."""
    ts: float = 0.0
    """When the agent sent it (its clock, UNIX seconds)."""


_UPDATE_ENCODER = msgspec.msgpack.Encoder()
_UPDATE_DECODER = msgspec.msgpack.Decoder(KvUpdate)
MAX_KEYS_PER_UPDATE = 50_000
"""About 450 KB of msgpack: under NATS's default 1 MiB message limit with room to spare."""


def encode_update(update: KvUpdate) -> bytes:
    return _UPDATE_ENCODER.encode(update)


def decode_update(payload: bytes) -> KvUpdate:
    """A relayed update; ValueError with the reason if it is not a valid one."""
    try:
        u = _UPDATE_DECODER.decode(payload)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ValueError(f"not a KV update: {exc}") from None
    if u.seq < 1:
        raise ValueError("a KV update needs seq >= 1")
    if len(u.stored) + len(u.removed) + len(u.roots) > MAX_KEYS_PER_UPDATE:
        raise ValueError(f"a KV update carries at most {MAX_KEYS_PER_UPDATE} keys")
    if any(not 0 <= k < 1 << 64 for k in u.stored) or any(not 0 <= k < 1 << 64 for k in u.removed):
        raise ValueError("KV keys are 64-bit unsigned integers")
    return u

"""The KV cache of the simulated engine: fixed-size blocks with automatic prefix caching.

Modelled on vLLM's v1 block pool. Memory is `num_blocks` blocks of `block_size`
tokens. A block in use has a reference count > 0 (several requests share a
cached prefix block). A full block gets a chained hash (`tokens.block_hashes`)
and stays findable by it after its last user lets go, until the block is needed
for something else: free blocks form one LRU queue, and allocation takes the
least recently freed block, evicting its cached content. A request's blocks are
freed tail first, so the end of a prompt is evicted before its widely shared
beginning.

Usage as vLLM reports it (`vllm:kv_cache_usage_perc`) counts only blocks with a
reference: cached blocks that nobody holds are free memory.

With `record_events=True` the pool also keeps, in `events`, what an engine publishes
with `--kv-events-config` (llmgw.sim.kvevents): BlockStored when a block becomes
findable (its parent's hash and its token ids with it), BlockRemoved when a cached block
is evicted or forgotten, as tuples the publisher turns into vLLM's wire format.

Used by `llmgw.sim.engine`. Purely computational; the accounting is exact, and
`check()` verifies it (unit tests call it after every operation).
"""

from __future__ import annotations

from collections import OrderedDict


class Block:
    __slots__ = ("hash", "id", "ref")

    def __init__(self, block_id: int) -> None:
        self.id = block_id
        self.ref = 0
        self.hash: int | None = None

    def __repr__(self) -> str:
        return f"Block({self.id}, ref={self.ref}, hash={self.hash})"


StoredEvent = tuple[str, list[int], int | None, list[int], str | None]
"""("stored", block hashes, parent hash, token ids of those blocks, the `cache_salt` of a
prompt's first block)."""
RemovedEvent = tuple[str, list[int]]
"""("removed", block hashes)."""


class BlockPool:
    """All blocks, the free LRU queue and the prefix-cache index."""

    def __init__(self, num_blocks: int, *, record_events: bool = False) -> None:
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks nobody references, least recently freed first; cached ones among them
        # are still findable through `cached` until allocation evicts them.
        self.free: OrderedDict[int, Block] = OrderedDict((b.id, b) for b in self.blocks)
        self.cached: dict[int, Block] = {}
        self.evictions = 0
        self.record_events = record_events
        self.events: list[StoredEvent | RemovedEvent] = []
        """Since the publisher last took them (only with `record_events`)."""

    def _removed(self, block_hash: int) -> None:
        events = self.events
        if events and events[-1][0] == "removed":
            events[-1][1].append(block_hash)
        else:
            events.append(("removed", [block_hash]))

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def lookup(self, hashes: list[int], limit: int) -> list[Block]:
        """The cached blocks of the longest prefix of `hashes`, at most `limit` blocks."""
        hit: list[Block] = []
        cached = self.cached
        for h in hashes[:limit]:
            block = cached.get(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def cost(self, hits: list[Block], new: int) -> int:
        """Free blocks taking `hits` and allocating `new` would consume: a hit nobody
        holds leaves the free queue too."""
        return new + sum(1 for b in hits if b.ref == 0)

    def touch(self, hits: list[Block]) -> None:
        """Take a reference on cached blocks found by `lookup`."""
        free = self.free
        for b in hits:
            if b.ref == 0:
                del free[b.id]
            b.ref += 1

    def allocate(self, n: int) -> list[Block]:
        """`n` blocks, evicting cached content from the least recently freed ones.
        The caller checks `num_free` first; asking for more is a bug."""
        if n > len(self.free):
            raise RuntimeError(f"allocate({n}) with only {len(self.free)} free blocks")
        out: list[Block] = []
        free = self.free
        cached = self.cached
        for _ in range(n):
            _, b = free.popitem(last=False)
            if b.hash is not None:
                if cached.get(b.hash) is b:
                    del cached[b.hash]
                    if self.record_events:
                        self._removed(b.hash)
                b.hash = None
                self.evictions += 1
            b.ref = 1
            out.append(b)
        return out

    def release(self, blocks: list[Block]) -> None:
        """Drop one reference on each block, tail first (see the module docstring)."""
        free = self.free
        for b in reversed(blocks):
            b.ref -= 1
            if b.ref == 0:
                free[b.id] = b

    def cache(
        self,
        block: Block,
        block_hash: int,
        parent: int | None = None,
        token_ids: list[int] | None = None,
        salt: str | None = None,
    ) -> None:
        """Make a full block findable by its chained hash. If another block already
        holds the same content, this one stays uncached (vLLM does the same).
        `parent` (the hash of the block before, None for a prompt's first) and the
        block's `token_ids` are what its BlockStored event says."""
        if block.hash is None and block_hash not in self.cached:
            block.hash = block_hash
            self.cached[block_hash] = block
            if self.record_events:
                ids = token_ids or []
                events = self.events
                last = events[-1] if events else None
                # A run of blocks of one prompt is one event, as vLLM sends it.
                if last is not None and last[0] == "stored" and last[1][-1] == parent:
                    last[1].append(block_hash)
                    last[3].extend(ids)  # type: ignore[misc]
                else:
                    events.append(("stored", [block_hash], parent, list(ids), salt))

    def take_events(self) -> list[StoredEvent | RemovedEvent]:
        out, self.events = self.events, []
        return out

    def reset_cache(self) -> int:
        """Forget every cached block nobody holds; returns how many were forgotten."""
        n = 0
        for b in self.free.values():
            if b.hash is not None:
                del self.cached[b.hash]
                if self.record_events:
                    self._removed(b.hash)
                b.hash = None
                n += 1
        return n

    def check(self) -> None:
        """Raise AssertionError when the accounting is inconsistent (tests use it)."""
        for b in self.blocks:
            assert b.ref >= 0, b
            assert (b.ref == 0) == (b.id in self.free), b
            if b.hash is not None:
                assert self.cached.get(b.hash) is b, b
        for h, b in self.cached.items():
            assert b.hash == h, b
        assert len(self.free) + sum(1 for b in self.blocks if b.ref > 0) == self.num_blocks

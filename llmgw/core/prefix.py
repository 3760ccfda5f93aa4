"""The router's approximate prefix index: which endpoints recently saw which prompt prefixes.

Engines keep a prefix cache of KV blocks keyed by chained token-block hashes;
a request whose prompt starts like an earlier one is cheaper on the engine that
served the earlier one. The router cannot see tokens or engine caches, so it
approximates: it cuts the prompt *text* into fixed-size blocks of characters,
chains their hashes (block i's hash covers blocks 0..i, so equal hashes mean
equal whole prefixes), and remembers, per hash, the few endpoints that served a
prompt containing it. An LRU bound keeps memory flat; an entry that outlived
the engine's own cache only costs a slightly wrong preference.

Used by `llmgw.router` (record after dispatch, match before scoring) and by the
`prefix` scorer in `llmgw.core.routing`. Purely computational (hashlib only).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

ENDPOINTS_PER_BLOCK = 4
"""Endpoints remembered per block hash: replicas of a hot prefix beyond this are forgotten."""


def block_hashes(
    text: str, block_chars: int, max_blocks: int, *, known: Sequence[bytes] = ()
) -> list[bytes]:
    """Chained hashes of the whole `block_chars`-sized blocks of `text`, at most `max_blocks`.

    A trailing partial block is left out: engines cache whole blocks only, and a
    partial block would make two prompts that differ only in their tail look different.
    `known`: the hashes of the first blocks of `text`, computed before (of a text it begins
    with); they begin the result and are not computed again.
    """
    n = min(len(text) // block_chars, max_blocks)
    start = min(len(known), n)
    out: list[bytes] = list(known[:start])
    prev = out[-1] if out else b""
    for i in range(start, n):
        chunk = text[i * block_chars : (i + 1) * block_chars].encode("utf-8", "surrogatepass")
        prev = hashlib.blake2b(prev + chunk, digest_size=8).digest()
        out.append(prev)
    return out


class PrefixIndex:
    """Block hash -> endpoints that recently served it, bounded to `capacity` hashes (LRU)."""

    def __init__(self, *, capacity: int = 100_000) -> None:
        if capacity < 1:
            raise ValueError("prefix index capacity must be at least 1")
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, list[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """For each endpoint, how many leading blocks of `hashes` it is believed to hold.

        Because hashes are chained, an endpoint holding block i held blocks 0..i-1
        too when it was recorded; the walk still stops at the first block an
        endpoint lacks, since the LRU may have evicted an earlier one.
        """
        counts: dict[str, int] = {}
        alive: set[str] | None = None
        for depth, h in enumerate(hashes):
            holders = self._blocks.get(h)
            if not holders:
                break
            if alive is None:
                alive = set(holders)
            else:
                alive.intersection_update(holders)
                if not alive:
                    break
            for ep in alive:
                counts[ep] = depth + 1
        return counts

    def record(self, hashes: Sequence[bytes], endpoint: str) -> None:
        """Remember that `endpoint` served a prompt with these blocks (most recent first)."""
        blocks = self._blocks
        for h in hashes:
            holders = blocks.get(h)
            if holders is None:
                blocks[h] = [endpoint]
            else:
                blocks.move_to_end(h)
                if holders[0] != endpoint:
                    if endpoint in holders:
                        holders.remove(endpoint)
                    holders.insert(0, endpoint)
                    del holders[ENDPOINTS_PER_BLOCK:]
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def forget(self, endpoint: str) -> None:
        """Drop an endpoint everywhere (it went away; its cache went with it)."""
        empty = []
        for h, holders in self._blocks.items():
            if endpoint in holders:
                holders.remove(endpoint)
                if not holders:
                    empty.append(h)
        for h in empty:
            del self._blocks[h]


class ChatHashes:
    """`block_hashes` of chat prompts' text, reusing those of leading messages seen before (a
    system prompt, a conversation's earlier turns): a bounded LRU keyed by the exact role
    and content of a message and the entry of the messages before it.

    The text must be the chat's messages as `role`, a newline, `content`, a newline, one
    after another (llmgw.router.requests); the hashes of the blocks wholly within its first
    messages depend on those messages alone. Only a chat's first `max_messages` messages are
    looked up and remembered (the rest are hashed with the text's remainder), so that one
    request of thousands of tiny messages neither holds the loop for their lookups nor evicts
    what every other request shares.
    """

    def __init__(
        self, *, capacity: int = 4096, max_chars: int = 4_000_000, max_messages: int = 64
    ) -> None:
        self.capacity = capacity
        self.max_chars = max_chars
        self.max_messages = max_messages
        self._table: OrderedDict[tuple[int, str, str], tuple[int, list[bytes]]] = OrderedDict()
        self._chars = 0
        self._serial = 0
        self._shape = (0, 0)

    def __len__(self) -> int:
        return len(self._table)

    def hashes(
        self, chat: Sequence[tuple[str, str]], text: str, block_chars: int, max_blocks: int
    ) -> list[bytes]:
        """`block_hashes(text, block_chars, max_blocks)`; `chat` the messages `text` is made
        of, or empty (a prompt that is no chat: nothing is remembered)."""
        if self._shape != (block_chars, max_blocks):
            self._table.clear()  # other blocks: nothing remembered applies
            self._chars = 0
            self._shape = (block_chars, max_blocks)
        table = self._table
        known: list[bytes] = []
        parent = 0
        end = 0
        for role, content in chat[: self.max_messages]:
            end += len(role) + len(content) + 2
            n = min(end // block_chars, max_blocks)
            key = (parent, role, content)
            got = table.get(key)
            if got is None:
                # The blocks of this message's prefix of the text, from those known.
                known = block_hashes(text, block_chars, n, known=known)
                self._serial += 1
                table[key] = got = (self._serial, known)  # never changed: results are copies
                self._chars += len(role) + len(content)
            else:
                table.move_to_end(key)
                known = got[1]
            parent = got[0]
            if n >= max_blocks:
                break
        while table and (len(table) > self.capacity or self._chars > self.max_chars):
            (_, role, content), _ = table.popitem(last=False)
            self._chars -= len(role) + len(content)
        return block_hashes(text, block_chars, max_blocks, known=known)

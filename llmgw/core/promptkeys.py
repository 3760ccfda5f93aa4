"""A prompt's token ids and block keys, reusing the work done for earlier prompts that began
the same way.

A router keys every request's prompt (llmgw.core.kvblocks.block_keys over the engine's
token ids), and most prompts begin with content it has tokenized moments ago: a system
prompt, few-shot examples, a conversation's earlier turns. `SegmentCache` remembers, per
prompt prefix made of whole segments (a chat's framed messages), the segment's token ids
and the keys of the blocks that end within it, so a prompt is tokenized and keyed only
from the first segment the cache has not seen after the same predecessors.

That is only exact where tokenizing a prompt gives the tokens of its segments one after
another, which the caller guarantees (llmgw.core.simtokens.chat_parts for the sim's
tokenizer); block keys chain over everything before them, so a segment is remembered
under its whole prefix, not its content alone. Entries are keyed by the exact text of the
segment and the entry of the prefix before it, so a hit is the same computation done
before, never an approximation. Purely computational.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from llmgw.core.kvblocks import KEY_ROOT, block_keys

KEY_WEIGHT = 4
"""What a remembered block key counts against `SegmentCache.max_chars`, in characters: about
the memory of a token's text and id, as a key of block size 1 stands for one token."""
SIZES_KEPT = 2
"""Block sizes a remembered segment keeps keys for (a fleet's engines use one or two); keys
for others are computed for the prompt at hand and not kept."""


class Segment:
    """One segment of a prompt: its token ids, and the keys of the blocks that end within
    it (per block size, computed when first asked for)."""

    __slots__ = ("end", "ids", "keys", "serial", "weight")

    def __init__(self, ids: list[int], end: int, serial: int, weight: int = 0) -> None:
        self.ids = ids
        self.end = end
        """The prompt's tokens up to the end of this segment."""
        self.keys: dict[int, list[int]] = {}
        """Block size -> keys of the blocks ending after the previous segment's end and at or
        before this one's."""
        self.serial = serial
        """Names the segment and its whole prefix in the cache (0: not remembered, or no
        longer)."""
        self.weight = weight
        """What it counts against the cache's bound: its text's length, and its keys'."""


class PromptTokens:
    """A prompt's token ids (`ids`) and, per block size, its block keys (`keys`), as
    `block_keys(ids, size)` gives them."""

    __slots__ = ("_cache", "_keys", "_segments", "estimate", "ids")

    def __init__(self, segments: Sequence[Segment], cache: SegmentCache | None = None) -> None:
        self._segments = segments
        self._cache = cache
        ids: list[int] = []
        for seg in segments:
            ids.extend(seg.ids)  # a copy: the cache's lists are never handed out
        self.ids = ids
        self.estimate = len(ids)
        """The whole prompt's tokens: `len(ids)`, or more where only the prompt's beginning
        was tokenized (llmgw.router.prompts), estimated."""
        self._keys: dict[int, list[int]] = {}

    @classmethod
    def of(cls, ids: list[int]) -> PromptTokens:
        """Token ids from a tokenizer with no segments to reuse."""
        return cls([Segment(ids, len(ids), 0)])

    def keys(self, block_size: int, root: int = KEY_ROOT) -> list[int]:
        """The chained keys of the prompt's whole blocks, the first chained onto `root` (a
        salted prompt's: llmgw.core.kvblocks.salt_root); ValueError as `block_keys` raises.

        The segments remember keys from `KEY_ROOT` only: a salted prompt's are computed
        whole (its tokens still come from the segments)."""
        if root != KEY_ROOT:
            return block_keys(self.ids, block_size, parent=root)
        got = self._keys.get(block_size)
        if got is not None:
            return got
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, not {block_size}")
        ids = self.ids
        out: list[int] = []
        for seg in self._segments:
            delta = seg.keys.get(block_size)
            if delta is None:
                # The blocks before this segment's end not keyed by the segments before it
                # (`out` holds exactly those ending at or before the previous end).
                start = len(out) * block_size
                stop = seg.end // block_size * block_size
                parent = out[-1] if out else KEY_ROOT
                delta = block_keys(ids[start:stop], block_size, parent=parent)
                if seg.serial and len(seg.keys) < SIZES_KEPT and self._cache is not None:
                    seg.keys[block_size] = delta
                    self._cache.grew(seg, len(delta) * KEY_WEIGHT)
            out.extend(delta)
        self._keys[block_size] = out
        return out


class SegmentCache:
    """Bounded LRU of prompt segments, keyed by (the entry of the prefix before, the
    segment's text).

    `tokenize` must give, for any segments a caller passes in one prompt, the tokens of their
    concatenation as the concatenation of each one's tokens.

    What one prompt does to the cache is bounded too: only its first `max_parts` parts are
    looked up and remembered, the rest tokenized with the tail in one piece (exact, by the
    requirement above), so a chat of thousands of empty messages neither holds the router's
    loop for thousands of lookups nor evicts every other tenant's system prompts.
    """

    def __init__(
        self,
        tokenize: Callable[[str], list[int]],
        *,
        max_segments: int = 8192,
        max_chars: int = 4_000_000,
        max_parts: int = 64,
    ) -> None:
        if max_segments < 1 or max_chars < 1 or max_parts < 1:
            raise ValueError(
                "a segment cache holds at least one segment and one character, of a prompt's "
                "first part at least"
            )
        self._tokenize = tokenize
        self.max_segments = max_segments
        self.max_chars = max_chars
        """Bounds the text held, and so the token ids (a token is a few characters), with
        the block keys kept counted as `KEY_WEIGHT` characters each: about a million tokens,
        a few tens of MB, hundreds of system prompts."""
        self.max_parts = max_parts
        self._table: OrderedDict[tuple[int, str], Segment] = OrderedDict()
        self._weight = 0
        self._serial = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._table)

    def tokens(self, parts: Sequence[str], tail: str = "", *, cut: bool = False) -> PromptTokens:
        """The tokens of `"".join(parts) + tail`: `parts` remembered under their prefixes,
        `tail` (what follows the last part, such as a chat's generation prompt) not. `cut`:
        the text is a longer prompt's beginning, cut within `tail`, whose last token is
        then left out (a word or a run of spaces cut short is another token)."""
        if len(parts) > self.max_parts:
            tail = "".join(parts[self.max_parts :]) + tail
            parts = parts[: self.max_parts]
        table = self._table
        segments: list[Segment] = []
        parent = 0
        end = 0
        found = True
        for part in parts:
            key = (parent, part)
            seg = table.get(key) if found else None
            if seg is None:
                # Every later prefix is new too: no more lookups.
                found = False
                self.misses += 1
                ids = self._tokenize(part)
                self._serial += 1
                seg = Segment(ids, end + len(ids), self._serial, len(part))
                table[key] = seg
                self._weight += len(part)
            else:
                self.hits += 1
                table.move_to_end(key)
            segments.append(seg)
            parent = seg.serial
            end = seg.end
        if tail:
            ids = self._tokenize(tail)
            if cut:
                del ids[-1:]
            segments.append(Segment(ids, end + len(ids), 0))
        while table and (len(table) > self.max_segments or self._weight > self.max_chars):
            _, gone = table.popitem(last=False)
            self._weight -= gone.weight
            gone.serial = 0  # a prompt still holding it keeps no more keys in it
        if not segments:
            return PromptTokens.of([])
        return PromptTokens(segments, self)

    def grew(self, seg: Segment, weight: int) -> None:
        """`seg`, remembered, now keeps keys weighing `weight` more (evicted at the next
        prompt if the cache is over its bound)."""
        seg.weight += weight
        self._weight += weight

"""The fleet KV index: which endpoint holds which prompt blocks, folded from the engines' events.

Every router builds one from the `KvUpdate`s agents relay (llmgw.core.kvblocks,
llmgw.router.kvfeed). The same updates in the same order give the same index, so
routers fed by one stream agree on where every prefix is.

Per endpoint it keeps the engine instance its blocks belong to, the engine's block
size, the set of keys and whether that set is known to be complete (`synced`): an
update from a new instance, or with a sequence number that skips one, leaves the
endpoint unsynced (nothing predicted there) until the next full update says what it
holds. Per key it keeps a bit mask of the endpoints holding it, so matching a prompt
walks its keys once whatever the number of endpoints.

An endpoint's blocks are trusted only while its updates keep coming (the agent sends a
full update every few seconds) and only from the node that published them: blocks are
kept per (node, endpoint), and `match` reads, for each candidate, only what the node the
router's endpoint table names for it said. A node cannot claim another node's engine's
cache, nor drown what that node says. What a node says of an endpoint the table does not
have on it is never read, so `sweep` drops it once it is `UNLISTED_GRACE_S` old, a node
may have `MAX_UNLISTED_PER_NODE` of them at once, and a full index drops one for an
endpoint the table lists: a node cannot make every router keep blocks for ids it made
up, or for another node's engines, nor crowd other nodes' endpoints out with them.

A router keys a prompt once per block size its candidates use, so block sizes cost it
work on every request. One node's endpoints may use `MAX_BLOCK_SIZES_PER_NODE` sizes
between them (a full update bringing another is refused, naming the node), and `match`
keys a prompt for `MAX_PROMPT_BLOCK_SIZES` sizes at most, every node's most used one
before any node's next: a fleet of one engine kind keys each prompt once, and a node
cycling through block sizes cannot make a router key a prompt more than that, nor keep
another node's engines from being matched.

`RecentRoutes` is the router's own short memory of where it just sent which blocks,
which covers the moment between a request and the engine's events about it.
Purely computational: time is an argument.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence

from llmgw.core.kvblocks import KvUpdate

Listed = Callable[[str, str], bool]
"""`listed(endpoint, node)`: whether the router's endpoint table has endpoint on node."""

MAX_ENDPOINTS = 4096
"""Endpoints indexed at once: updates naming more are refused (a node inventing endpoint
ids cannot grow a router's memory without bound), but for an endpoint the table lists,
which takes the place of one it does not."""
MAX_ENDPOINTS_PER_NODE = 256
MAX_UNLISTED_PER_NODE = 64
"""Endpoints one node may have indexed that the table does not list on it. An honest node
has them only for the seconds between its engines' first updates and the router folding
their EndpointUp: at most one per GPU (engines never share one), and the largest machines
have 64. A node that makes ids up holds this many, not `MAX_ENDPOINTS_PER_NODE`."""
MAX_KEYS_PER_ENDPOINT = 4_000_000
"""About 64 GB of KV at 16 tokens of 1 KiB each: more than any engine holds."""
MAX_KEYS_PER_NODE = 2 * MAX_KEYS_PER_ENDPOINT
"""All of one node's endpoints together (sixteen engines of half a million blocks, a small
model's KV filling 80 GB): without it a node naming its 256 endpoints could make every
router hold 256 times the endpoint bound, a billion keys at about 110 bytes each."""
MAX_BLOCK_SIZES_PER_NODE = 4
"""Distinct block sizes one node's endpoints use at once: engines of one, two or three kinds
on a node (vLLM's 16, SGLang's 1, a hybrid model's large block) fit."""
MAX_PROMPT_BLOCK_SIZES = 4
"""Block sizes `match` keys one prompt for: each is a pass of hashing over the prompt."""
UNLISTED_GRACE_S = 60.0
"""How long a node's blocks are kept for an endpoint the router's endpoint table does not
have on that node. An engine's first updates may reach a router before the EndpointUp
that announces it (the KV stream and the log are read apart, and a router catching up on
the log folds it seconds late): a minute covers that with room to spare, and past it the
blocks are ones `match` never reads (ids a node made up, another node's engines)."""
SWEEP_KEYS = 250_000
"""Keys one `sweep` clears at most (tens of milliseconds of the router's event loop), or
its first endpoint's where that holds more: the rest wait for the next pass."""


class EndpointBlocks:
    """What the index knows of one endpoint's cache."""

    __slots__ = ("bit", "block_size", "endpoint", "indexed_at", "instance", "keys", "model",
                 "node", "roots", "seq", "synced", "updated_at")  # fmt: skip

    def __init__(self, endpoint: str, node: str, bit: int, indexed_at: float = 0.0) -> None:
        self.endpoint = endpoint
        self.node = node
        self.bit = bit
        self.indexed_at = indexed_at
        """When the index began holding it: `sweep` measures the grace of an endpoint the
        table lacks on its node from then."""
        self.model = ""
        self.instance = ""
        self.block_size = 0
        self.seq = 0
        self.synced = False
        self.updated_at = 0.0
        self.keys: set[int] = set()
        self.roots: set[int] = set()
        """The keys among `keys` that begin a prompt: one per prefix family it holds."""


class KvIndex:
    """Endpoint -> keys held, key -> endpoints holding it."""

    def __init__(self, *, stale_after_s: float = 15.0) -> None:
        self.stale_after_s = stale_after_s
        self.endpoints: dict[tuple[str, str], EndpointBlocks] = {}
        """(node, endpoint id) -> what that node says the endpoint holds."""
        self._node_endpoints: dict[str, set[str]] = {}
        """Node -> the endpoint ids it published for, against MAX_ENDPOINTS_PER_NODE."""
        self._node_keys: dict[str, int] = {}
        """Node -> keys its endpoints hold, against MAX_KEYS_PER_NODE."""
        self._node_sizes: dict[str, dict[int, int]] = {}
        """Node -> block size -> its endpoints using it, against MAX_BLOCK_SIZES_PER_NODE."""
        self.holders: dict[int, int] = {}
        """Key -> bit mask of the endpoints (their `bit`) that hold it."""
        self._free_bits: list[int] = []
        self._next_bit = 0
        self.applied = 0
        self.refused = 0
        self.resyncs = 0
        self.unlisted_dropped = 0
        """Endpoints dropped for the table lacking them (`sweep`, or to make room)."""

    def __len__(self) -> int:
        return len(self.holders)

    # ------------------------------------------------------------------ folding

    def apply(
        self, update: KvUpdate, node: str, now: float, listed: Listed | None = None
    ) -> str | None:
        """Fold one update published by `node`; None, or why it was refused.

        Blocks are kept per (node, endpoint): what a node says of an endpoint id is only
        ever believed for that node (`usable`), so a node naming another node's engine
        neither claims its cache nor disturbs what its real node says. `listed`: the
        router's table (None: there is none, every endpoint counts as listed)."""
        key = (node, update.endpoint)
        ep = self.endpoints.get(key)
        if ep is None:
            refused = self._admit(update.endpoint, node, listed)
            if refused is not None:
                self.refused += 1
                return refused
            ep = EndpointBlocks(update.endpoint, node, self._take_bit(), now)
            self.endpoints[key] = ep
            self._node_endpoints.setdefault(node, set()).add(update.endpoint)
            self._node_keys.setdefault(node, 0)
        ep.updated_at = now
        if update.full:
            self._clear(ep)
            ep.instance, ep.seq = update.instance, update.seq
            refused = self._use_block_size(ep, update.block_size)
            if refused is not None:
                self.refused += 1
                ep.synced = False
                return refused
            ep.model = update.model
            ep.synced = True
        elif update.instance != ep.instance or update.seq != ep.seq + 1:
            # Another engine instance, or an update missed: nothing is certain until the
            # next full update.
            if ep.synced:
                self.resyncs += 1
            self._clear(ep)
            ep.synced = False
            ep.instance = update.instance
        ep.seq = update.seq
        if not ep.synced:
            return None
        self._remove(ep, update.removed)
        refused = self._too_many(ep, len(update.stored))
        if refused is not None:
            self.refused += 1
            ep.synced = False
            self._clear(ep)
            return refused
        bit = 1 << ep.bit
        holders, keys = self.holders, ep.keys
        before = len(keys)
        for k in update.stored:
            if k not in keys:
                keys.add(k)
                holders[k] = holders.get(k, 0) | bit
        self._node_keys[node] = self._node_keys.get(node, 0) + len(keys) - before
        ep.roots.update(k for k in update.roots if k in keys)
        self.applied += 1
        return None

    def _admit(self, endpoint: str, node: str, listed: Listed | None) -> str | None:
        """Why `node` may not have `endpoint` indexed as well; None if it may."""
        mine = self._node_endpoints.get(node, set())
        if len(mine) >= MAX_ENDPOINTS_PER_NODE:
            return f"node {node} publishes for {MAX_ENDPOINTS_PER_NODE} endpoints already"
        if listed is not None and not listed(endpoint, node):
            # Counted when asked, as tables change without telling the index (256 at most).
            if sum(not listed(e, node) for e in mine) >= MAX_UNLISTED_PER_NODE:
                return (f"node {node} publishes for {MAX_UNLISTED_PER_NODE} endpoints not in the "
                        f"router's table on it already, {endpoint} would be one more (an engine's "
                        "blocks are indexed once its EndpointUp is in the log)")  # fmt: skip
        elif listed is not None and len(self.endpoints) >= MAX_ENDPOINTS:
            self._drop_one_unlisted(listed)
        if len(self.endpoints) >= MAX_ENDPOINTS:
            return f"the index holds {MAX_ENDPOINTS} endpoints already"
        return None

    def _drop_one_unlisted(self, listed: Listed) -> None:
        """Drop the oldest endpoint the table does not list, if there is one."""
        for key, ep in self.endpoints.items():
            if not listed(ep.endpoint, ep.node):
                self._drop(key)
                self.unlisted_dropped += 1
                return

    def _remove(self, ep: EndpointBlocks, removed: Sequence[int]) -> None:
        bit = 1 << ep.bit
        holders, keys, roots = self.holders, ep.keys, ep.roots
        before = len(keys)
        for k in removed:
            roots.discard(k)
            if k in keys:
                keys.discard(k)
                mask = holders[k] & ~bit
                if mask:
                    holders[k] = mask
                else:
                    del holders[k]
        self._node_keys[ep.node] = self._node_keys.get(ep.node, 0) - (before - len(keys))

    def _too_many(self, ep: EndpointBlocks, stored: int) -> str | None:
        """Why storing `stored` more keys could exceed the endpoint's or its node's bound
        (each counted as new, as the endpoint's own bound always was); None if it cannot."""
        if len(ep.keys) + stored > MAX_KEYS_PER_ENDPOINT:
            return f"endpoint {ep.endpoint} would hold over {MAX_KEYS_PER_ENDPOINT} blocks"
        if self._node_keys.get(ep.node, 0) + stored > MAX_KEYS_PER_NODE:
            return f"node {ep.node} would hold over {MAX_KEYS_PER_NODE} blocks"
        return None

    def _use_block_size(self, ep: EndpointBlocks, size: int) -> str | None:
        """Give `ep` block size `size`; why not, if its node's endpoints use as many other
        sizes as they may (it is then left with none)."""
        if size == ep.block_size:
            return None
        self._release_block_size(ep)
        sizes = self._node_sizes.setdefault(ep.node, {})
        if size not in sizes and len(sizes) >= MAX_BLOCK_SIZES_PER_NODE:
            return (
                f"node {ep.node}'s endpoints use block sizes {sorted(sizes)} already: "
                f"{ep.endpoint}'s {size} would be more than {MAX_BLOCK_SIZES_PER_NODE} "
                "(run the node's engines with fewer distinct block sizes)"
            )
        sizes[size] = sizes.get(size, 0) + 1
        ep.block_size = size
        return None

    def _release_block_size(self, ep: EndpointBlocks) -> None:
        if ep.block_size:
            sizes = self._node_sizes[ep.node]
            left = sizes[ep.block_size] - 1
            if left:
                sizes[ep.block_size] = left
            else:
                del sizes[ep.block_size]
            ep.block_size = 0

    def forget(self, endpoint: str) -> None:
        """Drop an endpoint and everything it held, whichever node spoke of it (it went
        down, or its node was lost)."""
        for key in [k for k in self.endpoints if k[1] == endpoint]:
            self._drop(key)

    def sweep(
        self,
        listed: Listed,
        now: float,
        *,
        grace_s: float = UNLISTED_GRACE_S,
        max_keys: int | None = None,
    ) -> tuple[list[tuple[str, str, int]], bool]:
        """Drop what nodes said of endpoints the router's table does not have on them
        (`listed(endpoint, node)` is false) once the index has held it over `grace_s`.

        One pass looks at each endpoint once (`MAX_ENDPOINTS` at most) and clears `max_keys`
        (`SWEEP_KEYS`) keys at most, or its first endpoint's where that holds more. Returns
        the (node, endpoint, blocks) dropped, and whether the pass got through every
        endpoint (else the next one goes on)."""
        most = SWEEP_KEYS if max_keys is None else max_keys
        dropped: list[tuple[str, str, int]] = []
        cleared = 0
        for key, ep in list(self.endpoints.items()):
            if now - ep.indexed_at <= grace_s or listed(ep.endpoint, ep.node):
                continue
            if dropped and cleared + len(ep.keys) > most:
                return dropped, False
            cleared += len(ep.keys)
            dropped.append((ep.node, ep.endpoint, len(ep.keys)))
            self._drop(key)
            self.unlisted_dropped += 1
        return dropped, True

    def _drop(self, key: tuple[str, str]) -> None:
        ep = self.endpoints.pop(key)
        self._clear(ep)
        self._release_block_size(ep)
        self._free_bits.append(ep.bit)
        mine = self._node_endpoints[ep.node]
        mine.discard(ep.endpoint)
        if not mine:
            del self._node_endpoints[ep.node]
            del self._node_keys[ep.node]
            self._node_sizes.pop(ep.node, None)

    def _clear(self, ep: EndpointBlocks) -> None:
        bit = ~(1 << ep.bit)
        holders = self.holders
        self._node_keys[ep.node] = self._node_keys.get(ep.node, 0) - len(ep.keys)
        for k in ep.keys:
            mask = holders[k] & bit
            if mask:
                holders[k] = mask
            else:
                del holders[k]
        ep.keys = set()
        ep.roots = set()

    def _take_bit(self) -> int:
        if self._free_bits:
            return self._free_bits.pop()
        self._next_bit += 1
        return self._next_bit - 1

    # ------------------------------------------------------------------ reading

    def usable(self, endpoint: str, node: str, now: float) -> EndpointBlocks | None:
        """The endpoint's blocks if they can be trusted now: synced, fresh, and published
        by the node the router knows the endpoint on."""
        ep = self.endpoints.get((node, endpoint))
        if ep is None or not ep.synced:
            return None
        if now - ep.updated_at > self.stale_after_s:
            return None
        return ep

    def roots(self, endpoint: str, node: str, now: float) -> set[int]:
        """The prefix families (keys that begin a prompt) the endpoint holds; empty when its
        blocks are not usable now."""
        ep = self.usable(endpoint, node, now)
        return set() if ep is None else ep.roots

    def match(
        self,
        keys_for: Callable[[int], Sequence[int]],
        candidates: Sequence[tuple[str, str]],
        now: float,
    ) -> tuple[dict[str, int], dict[str, int]]:
        """For each usable candidate (endpoint id, node), the leading blocks of the prompt
        it holds, and its block size. `keys_for(block_size)` gives the prompt's keys for
        one block size (endpoints of a model usually share one); it is asked for
        `MAX_PROMPT_BLOCK_SIZES` sizes at most (`keyed_sizes`), and candidates of any other
        size are left out as unusable ones are.

        Returns (endpoint -> blocks held, endpoint -> block size) for the usable ones;
        an endpoint holding none is present with 0.
        """
        depth: dict[str, int] = {}
        sizes: dict[str, int] = {}
        by_size: dict[int, list[EndpointBlocks]] = {}
        for endpoint, node in candidates:
            ep = self.usable(endpoint, node, now)
            if ep is not None:
                by_size.setdefault(ep.block_size, []).append(ep)
        holders = self.holders
        for size in keyed_sizes(by_size):
            eps = by_size[size]
            for ep in eps:
                depth[ep.endpoint] = 0
                sizes[ep.endpoint] = size
            bits = {1 << ep.bit: ep.endpoint for ep in eps}
            alive = 0
            for b in bits:
                alive |= b
            keys = keys_for(size)
            n = 0
            for k in keys:
                held = holders.get(k, 0) & alive
                gone = alive & ~held
                if gone:
                    for b, name in bits.items():
                        if gone & b:
                            depth[name] = n
                alive = held
                if not alive:
                    break
                n += 1
            for b, name in bits.items():
                if alive & b:
                    depth[name] = n
        return depth, sizes

    def holding(self, key: int) -> list[str]:
        """The endpoints that hold `key` (for explanations)."""
        mask = self.holders.get(key, 0)
        return sorted(
            f"{ep.endpoint}@{ep.node}" for ep in self.endpoints.values() if mask >> ep.bit & 1
        )


def keyed_sizes(
    by_size: Mapping[int, Sequence[EndpointBlocks]], most: int = MAX_PROMPT_BLOCK_SIZES
) -> list[int]:
    """Which of the candidates' block sizes (size -> its candidates) a prompt is keyed for,
    in order. All of them when they are `most` or fewer, those of more candidates first;
    else `most`: each node's most used size before any node's next one (so a node's many
    sizes cannot crowd out another node's), and among those the sizes of more nodes first,
    then the smaller. The same candidates give the same sizes in any order."""
    if len(by_size) <= most:
        return sorted(by_size, key=lambda s: (-len(by_size[s]), s))
    per_node: dict[str, dict[int, int]] = {}
    for size, eps in by_size.items():
        for ep in eps:
            used = per_node.setdefault(ep.node, {})
            used[size] = used.get(size, 0) + 1
    ranked = [_most_used(used) for used in per_node.values()]
    chosen: dict[int, None] = {}
    for turn in range(max(map(len, ranked))):
        votes = Counter(r[turn] for r in ranked if turn < len(r) and r[turn] not in chosen)
        for size in sorted(votes, key=lambda s: (-votes[s], s)):
            if len(chosen) >= most:
                return list(chosen)
            chosen[size] = None
    return list(chosen)


def _most_used(used: dict[int, int]) -> list[int]:
    if len(used) == 1:
        return list(used)
    return sorted(used, key=lambda s: (-used[s], s))


class RecentRoutes:
    """Where this router sent which blocks in the last `window_s`: what engines hold but
    have not reported yet (their events take a few tens of milliseconds to arrive)."""

    def __init__(self, *, window_s: float = 2.0, capacity: int = 200_000) -> None:
        self.window_s = window_s
        self.capacity = capacity
        self._by_key: OrderedDict[int, tuple[str, float]] = OrderedDict()
        self._roots: dict[str, dict[int, float]] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def record(self, keys: Sequence[int], endpoint: str, now: float) -> None:
        if keys:
            roots = self._roots.setdefault(endpoint, {})
            roots[keys[0]] = now
            if len(roots) > 4096:
                self._expire_roots(roots, now)
        table = self._by_key
        for k in keys:
            table[k] = (endpoint, now)
            table.move_to_end(k)
        while len(table) > self.capacity:
            table.popitem(last=False)

    def match(self, keys: Sequence[int], now: float) -> tuple[str, int]:
        """(endpoint, leading blocks) of the most recent route holding the prompt's first
        block, within the window; ("", 0) when there is none."""
        table = self._by_key
        first = table.get(keys[0]) if keys else None
        if first is None or now - first[1] > self.window_s:
            return "", 0
        endpoint = first[0]
        n = 0
        for k in keys:
            got = table.get(k)
            if got is None or got[0] != endpoint or now - got[1] > self.window_s:
                break
            n += 1
        return endpoint, n

    def roots(self, endpoint: str, now: float) -> set[int]:
        """The prompt starts sent to `endpoint` within the window."""
        roots = self._roots.get(endpoint)
        if not roots:
            return set()
        self._expire_roots(roots, now)
        return set(roots)

    def _expire_roots(self, roots: dict[int, float], now: float) -> None:
        for k in [k for k, t in roots.items() if now - t > self.window_s]:
            del roots[k]

    def forget(self, endpoint: str) -> None:
        for k in [k for k, (ep, _) in self._by_key.items() if ep == endpoint]:
            del self._by_key[k]
        self._roots.pop(endpoint, None)

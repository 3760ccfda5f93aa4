"""A node's share of the log: measuring what each node writes, and when to quarantine it.

JetStream has no per-publisher quota, so a node (or a stolen node certificate) may
publish on its own subjects as fast as the server accepts them. The control plane
measures instead: every instance counts the messages and bytes each node wrote on its
subjects (`llmgw.events.node.<node>.>`: registrations, shard reports, heartbeats, and
what no reader accepts, undecodable or refused), and the GPU health changes the leader
recorded from its heartbeats (llmgw.control.folding.METERED), in a sliding window of
server time. The leader turns a node over its budget into a recorded
`NodeQuarantined`, and a quarantined node whose traffic stayed under the budget for
a whole window into `NodeReleased` (llmgw.control.service); the fold
(llmgw.core.state) does the rest, the same way for every reader.

The window is kept in buckets (a sixtieth of it each), so memory per node is bounded
whatever the flood. Measurement is the shell's and need not be deterministic: only
its recorded outcome is folded. Purely computational; times are passed in.
"""

from __future__ import annotations

from collections import deque

import msgspec

from llmgw.core import state

MIB = 1024 * 1024
BUCKETS = 60


class NodeQuota(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Each node's budget of log traffic on its subjects, heartbeats included.

    The defaults are far above an honest agent's worst case: a node of 16 GPUs whose
    16 single-GPU replicas all crash-loop from the first restart (backoff 5 s doubling,
    so at most 7 failures each in 10 minutes) writes about 16 x 7 x 4 = 450 shard
    reports, 30 MiB with every failure's 256 KiB engine log tail; its heartbeats add
    window_s / heartbeat_s (120 at the agent's default 5 s, 600 at 1 s), about 2 KiB
    each; a flapping link adds one registration per reconnect. An agent beating faster
    than every 0.2 s needs a larger `max_messages`.
    """

    enabled: bool = True
    window_s: float = 600.0
    max_messages: int = 5_000
    max_bytes: int = 64 * MIB
    delete: bool = True
    """Delete a quarantined node's ignored messages from the log (no fold uses them)."""


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    """What one node wrote in the window."""

    node: str
    messages: int
    bytes: int
    since_seq: int
    """The first sequence of the window's messages."""


class _Node:
    __slots__ = ("buckets", "bytes", "messages")

    def __init__(self) -> None:
        # (bucket index, messages, bytes, first seq), oldest first.
        self.buckets: deque[list[int]] = deque()
        self.messages = 0
        self.bytes = 0


class Meter:
    """Messages and bytes per node in a sliding window of server time."""

    def __init__(self, quota: NodeQuota) -> None:
        self.quota = quota
        self._width = max(quota.window_s / BUCKETS, 1e-3)
        self._nodes: dict[str, _Node] = {}
        self.now = 0.0
        """The newest server time seen: the window ends there."""

    def advance(self, at: float) -> None:
        """The log has reached server time `at` (any record): the window ends there."""
        if at > self.now:
            self.now = at

    def observe(self, node: str, seq: int, at: float, size: int) -> None:
        """One message of `node`, stored at server time `at`, `size` bytes."""
        if at > self.now:
            self.now = at
        index = int(at // self._width)
        usage = self._nodes.get(node)
        if usage is None:
            usage = self._nodes[node] = _Node()
        buckets = usage.buckets
        if buckets and buckets[-1][0] >= index:
            bucket = buckets[-1]  # a late record counts in the newest bucket
            bucket[1] += 1
            bucket[2] += size
        else:
            buckets.append([index, 1, size, seq])
        usage.messages += 1
        usage.bytes += size

    def _expire(self, usage: _Node) -> None:
        oldest = int((self.now - self.quota.window_s) // self._width) + 1
        buckets = usage.buckets
        while buckets and buckets[0][0] < oldest:
            _, messages, size, _ = buckets.popleft()
            usage.messages -= messages
            usage.bytes -= size

    def usage(self, node: str) -> Usage:
        found = self._nodes.get(node)
        if found is None:
            return Usage(node=node, messages=0, bytes=0, since_seq=0)
        self._expire(found)
        first = found.buckets[0][3] if found.buckets else 0
        return Usage(node=node, messages=found.messages, bytes=found.bytes, since_seq=first)

    def over_budget(self, usage: Usage) -> bool:
        q = self.quota
        return usage.messages > q.max_messages or usage.bytes > q.max_bytes

    def excessive(self) -> list[Usage]:
        """Nodes over the budget now, by name; forgets nodes that wrote nothing in the window."""
        out: list[Usage] = []
        for node in sorted(self._nodes):
            usage = self.usage(node)
            if usage.messages == 0:
                del self._nodes[node]
            elif self.over_budget(usage):
                out.append(usage)
        return out

    def calm(self, node: str, quarantine: state.Quarantine) -> bool:
        """True when a quarantined node may be released: a whole window has passed since
        its quarantine and what it wrote in the last window is under the budget."""
        if self.now - quarantine.ts < self.quota.window_s:
            return False
        return not self.over_budget(self.usage(node))

    def reason(self, usage: Usage) -> str:
        q = self.quota
        return (
            f"wrote {usage.messages} messages, {usage.bytes} bytes in {q.window_s:g} s "
            f"(registrations, shard reports, heartbeats, messages no reader accepts, GPU "
            f"health changes); the budget is "
            f"{q.max_messages} messages, "
            f"{q.max_bytes} bytes"
        )

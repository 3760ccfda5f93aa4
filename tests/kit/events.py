"""Events the log tests append: one node's shard reports, distinct and easy to compare."""

from __future__ import annotations

from llmgw.core import events


def shard_report(i: int, node: str = "node-a") -> events.ShardStatus:
    """The `i`th report of node `node` (its own id, its own timestamp)."""
    return events.ShardStatus(
        id=f"{node}-shard-{i}",
        ts=1_800_000_000.0 + i,
        node=node,
        replica_id="r1",
        generation=1,
        phase="loading",
        error=f"step {i}",
    )

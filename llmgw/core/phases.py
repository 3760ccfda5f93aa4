"""A shard's phases, defined once: what an agent reports, what the fold adds, their order.

An agent reports `ShardPhase` in ShardStatus and in a registration's running shards; the
fold's `Phase` adds "placed", the phase of a shard the leader placed and no agent has
reported yet. `RANK` is their forward order: a status may skip ahead (an agent can
coalesce starting and loading) but never go back within one generation: "loading" after
"serving" is a stale or forged report.
"""

from __future__ import annotations

import typing
from typing import Literal

ShardPhase = Literal["starting", "loading", "serving", "draining", "stopped", "failed"]
"""What an agent reports."""
Phase = Literal["placed", ShardPhase]
"""What the folded state holds."""

SHARD_PHASES: tuple[ShardPhase, ...] = typing.get_args(ShardPhase)
PHASES: tuple[Phase, ...] = typing.get_args(Phase)

RANK: dict[str, int] = {
    "placed": 0,
    "starting": 1,
    "loading": 2,
    "serving": 3,
    "draining": 4,
    "stopped": 5,
    "failed": 5,
}
TERMINAL: frozenset[ShardPhase] = frozenset({"stopped", "failed"})
"""A generation that reached one of these does not run again."""
RUNNING: frozenset[ShardPhase] = frozenset({"starting", "loading", "serving", "draining"})
"""A process exists (or is being started) for the shard."""

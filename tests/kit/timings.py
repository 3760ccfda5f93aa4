"""The control plane's timings in tests: seconds where production has tens of seconds.

`FAST` is for tests whose agents are in-process stand-ins (`control_kit.SimAgent`):
a "shard" stops the moment it is told to. `FAST_FLEET` is for fleets of real processes
(`fleet_kit.Fleet`): each engine is an `llmgw sim` subprocess that drains its streams and
exits on a signal, and a busy machine takes seconds to start one, so drains, stop grace
and the grace given to a model change are longer; failure detection is the same.
"""

from __future__ import annotations

import msgspec

from llmgw.core.reconcile import ReconcileConfig

FAST = ReconcileConfig(
    unreachable_after_s=2.0,
    lost_after_s=4.0,
    restart_backoff_s=0.5,
    restart_backoff_max_s=2.0,
    shard_drain_s=0.5,
    stop_grace_s=1.0,
    change_grace_s=10.0,
)

FAST_FLEET = msgspec.structs.replace(FAST, shard_drain_s=1.0, stop_grace_s=2.0, change_grace_s=30.0)

HEARTBEAT_S = 0.5
"""How often test agents heartbeat: several per `unreachable_after_s`."""

"""Stopping an engine: SIGTERM to its whole process group, SIGKILL after a grace.

Engines fork workers that hold GPU memory and outlive a signal sent only to the
leader, so it is the group that must be gone. Used by `llmgw.agent.supervisor`.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time

from llmgw import logs, processes

log = logs.get("llmgw.agent.supervisor")


async def terminate(
    pgid: int, proc: asyncio.subprocess.Process | None, grace_s: float, replica_id: str
) -> None:
    """Signal the group `pgid` and return once none of it is left (or SIGKILL did not
    empty it within 10 s). `proc`, the leader when this agent spawned it, is reaped."""
    if pgid <= 0:
        return
    if not processes.group_members(pgid):
        return
    processes.signal_group(pgid, signal.SIGTERM)
    if not await _group_gone(pgid, proc, grace_s):
        log.warning("engine_ignored_sigterm", replica_id=replica_id, grace_s=grace_s)
        processes.signal_group(pgid, signal.SIGKILL)
        await _group_gone(pgid, proc, 10.0)


async def _group_gone(pgid: int, proc: asyncio.subprocess.Process | None, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(proc.wait()), 0.02)
        if not processes.group_members(pgid):
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)

"""Stopping a service's background tasks, boundedly.

Every long-running service (control plane, agent, router feed) runs loops as asyncio
tasks and stops them on SIGTERM. Cancellation alone is not enough on Python 3.11:
`asyncio.wait_for`, which nats-py uses for its requests, can swallow a cancel that
arrives just as its inner future completes, and the loop then carries on. Services
therefore also end their loops by a flag or by closing their reader, and wait for
them here with a bound, so a stuck task is logged instead of keeping a process alive.
The opposite case is here too: work that must run to its end whoever stops waiting for it
(`uncancelled`).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any

from structlog.typing import FilteringBoundLogger

from llmgw import logs

log = logs.get("llmgw.tasks")


async def stop(tasks: Iterable[asyncio.Task[Any]], *, timeout_s: float = 5.0, who: str) -> None:
    """Cancel `tasks` and wait for them, at most twice `timeout_s`; never raises."""
    pending = {t for t in tasks if not t.done()}
    for attempt in range(2):
        if not pending:
            break
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=timeout_s)
        for task in pending:
            log.warning("slow_to_stop", who=who, task=task.get_name(), attempt=attempt + 1)
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: its failure was handled where it happened


async def retrying(
    attempt: Callable[[], Awaitable[None]],
    *,
    stopped: Callable[[], bool],
    wake: asyncio.Event | None,
    what: str,
    logger: FilteringBoundLogger,
) -> None:
    """Run `attempt` again and again until `stopped()`: a background feed that must outlive
    its failures (no server yet, no stream yet, a lost connection). After each attempt it
    waits 1 s, doubling after failures in a row up to 30 s; an attempt that ran a minute
    starts the wait over. `wake`, when set, cuts a wait short (the feed is closing)."""
    wait = 1.0
    while not stopped():
        began = time.monotonic()
        failure = ""
        try:
            await attempt()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            failure = str(exc) or type(exc).__name__
        wait = 1.0 if time.monotonic() - began > 60.0 else wait
        if failure:  # said after the reset: the wait it names is the one that follows
            logger.warning(f"{what}_failed", error=failure, retry_in_s=wait)
        if wake is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), wait)
        else:
            await asyncio.sleep(wait)
        wait = min(wait * 2, 30.0)


_UNCANCELLED: set[asyncio.Task[Any]] = set()
"""Tasks of `uncancelled` under way: the loop keeps only weak references to tasks."""


async def uncancelled(work: Coroutine[Any, Any, None]) -> None:
    """Await `work`, which runs to its end even when the task awaiting it is cancelled: for
    a change that takes effect on a server whatever happens here, and whose answer must
    be recorded. Its error, when nobody awaits it any more, is dropped."""
    task = asyncio.ensure_future(work)
    _UNCANCELLED.add(task)
    task.add_done_callback(_retrieved)
    await asyncio.shield(task)


def _retrieved(task: asyncio.Task[Any]) -> None:
    _UNCANCELLED.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: no "never retrieved" warning at exit


def until_stopped(loop: asyncio.AbstractEventLoop, stop: asyncio.Event, who: str) -> None:
    """A daemon's signals: SIGTERM and SIGINT set `stop`; SIGHUP, which `systemctl reload`
    and habit send a daemon and which would end the process by default, is logged and
    otherwise ignored (`who` has nothing to reload: its settings apply at start)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(
        signal.SIGHUP,
        lambda: log.warning(
            "hangup_ignored",
            who=who,
            detail=f"the {who} reads its settings at start: restart it to apply a change",
        ),
    )

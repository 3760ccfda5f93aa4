"""Request deadlines on one loop timer per process.

`asyncio.timeout_at` gives every `async with` its own loop timer, and every
`reschedule` cancels that timer and makes another. The router keeps several
deadlines per request (response headers, first token, then the idle gap after
every chunk, all under the total), thousands of requests are in flight, and
almost no deadline ever fires, so those timers were a tenth of the router's
CPU. Here a deadline is a number on a `Deadline` that a `Watchdog` watches: one
loop timer is armed for the earliest deadline, and moving a deadline later (a
stream's idle deadline, at every chunk) is an attribute write.

The semantics are `asyncio.timeout_at`'s: when the deadline passes, the task is
cancelled, and the `async with` block exits with TimeoutError; a cancellation
from elsewhere stays a CancelledError. The watchdog looks at its deadlines at
most every `min_interval` seconds, so a deadline fires up to that much late and
a burst of expiring deadlines (an engine that stalls under load) costs one
scan per interval, not one per deadline.
"""

from __future__ import annotations

import asyncio
import math
from types import TracebackType

_CREATED, _ENTERED, _EXPIRING, _EXPIRED, _EXITED = range(5)


class Watchdog:
    """Every deadline of one event loop, on one timer."""

    __slots__ = ("_active", "_handle", "_loop", "_next_at", "min_interval")

    def __init__(self, min_interval: float = 0.005) -> None:
        self.min_interval = min_interval
        self._active: set[Deadline] = set()
        self._handle: asyncio.TimerHandle | None = None
        self._next_at = math.inf
        self._loop: asyncio.AbstractEventLoop | None = None

    def at(self, when: float) -> Deadline:
        """A deadline at `when` (the loop's clock), to use as `async with`."""
        return Deadline(self, when)

    def __len__(self) -> int:
        return len(self._active)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._next_at = math.inf

    def _watch(self, d: Deadline) -> None:
        self._active.add(d)
        if d.when < self._next_at:
            self._arm(d.when)

    def _arm(self, when: float) -> None:
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        if self._handle is not None:
            self._handle.cancel()
        self._next_at = when
        self._handle = loop.call_at(when, self._tick)

    def _tick(self) -> None:
        self._handle = None
        self._next_at = math.inf
        assert self._loop is not None
        now = self._loop.time()
        due: list[Deadline] = []
        earliest = math.inf
        for d in self._active:
            if d.when <= now:
                due.append(d)
            elif d.when < earliest:
                earliest = d.when
        for d in due:
            self._active.discard(d)
            d._expire()
        if earliest < math.inf:
            # Never sooner than min_interval: many deadlines close together expire in one scan.
            self._arm(max(earliest, now + self.min_interval))


class Deadline:
    """One deadline, entered once with `async with`; `reschedule` moves it."""

    __slots__ = ("_cancelling", "_dog", "_state", "_task", "when")

    def __init__(self, dog: Watchdog, when: float) -> None:
        self._dog = dog
        self.when = when
        self._state = _CREATED
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0

    def reschedule(self, when: float) -> None:
        """Move the deadline (earlier or later) while inside the block."""
        if self._state != _ENTERED:
            raise RuntimeError("a deadline can only be moved inside its block, before it fired")
        self.when = when
        if when < self._dog._next_at:
            self._dog._arm(when)

    def expired(self) -> bool:
        return self._state in (_EXPIRING, _EXPIRED)

    async def __aenter__(self) -> Deadline:
        if self._state != _CREATED:
            raise RuntimeError("a deadline can only be entered once")
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a deadline must be used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._state = _ENTERED
        self._dog._watch(self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._state == _EXPIRING:
            self._state = _EXPIRED
            assert self._task is not None
            if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                # No other cancellation is pending: this one was ours.
                raise TimeoutError from exc
        else:
            self._state = _EXITED
            self._dog._active.discard(self)
        self._task = None

    def _expire(self) -> None:
        assert self._task is not None
        self._state = _EXPIRING
        self._task.cancel()

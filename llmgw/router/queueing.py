"""Requests that wait in the router, fairly, while every endpoint of their model is full.

A model whose profile bounds its endpoints (`ModelProfile.queue`: this router's requests
in flight per endpoint, or the engine's own waiting count) has its requests wait here
rather than pile onto engines that cannot take them, in a fair queue per model
(llmgw.core.fairqueue: the key's priority class, then the keys of a class in turn). A
request leaves when an endpoint has room: when one of the model's requests ends, and at
least every `PUMP_S` (an engine's queue drains, an endpoint comes up). Requests that
arrive while others wait queue behind them. The wait counts against the model's total
deadline and `max_wait_s` (a 504 past either), the queue holds `max_queued` (a 503 with
Retry-After beyond), and its depth is in the router's load reports (the autoscaler's
`waiting` signal) and metrics.

Ranking sees only endpoints with room (`with_room`), so a request let out of the queue
goes to one that can take it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from llmgw.core import routing
from llmgw.core.fairqueue import FairQueue
from llmgw.core.profile import ModelProfile, Queueing
from llmgw.core.tenancy import PRIORITIES
from llmgw.router.auth import Principal
from llmgw.router.errors import Refusal
from llmgw.router.metrics import Metrics

PUMP_S = 0.05
RETRY_AFTER_S = 2
BIG = 1 << 30


def slots(ep: routing.EndpointState, q: Queueing) -> int:
    """Requests `ep` can take now under `q`'s bounds (BIG: no bound)."""
    if not ep.ready:
        return 0
    if q.max_engine_waiting and ep.queue_depth >= q.max_engine_waiting:
        return 0
    if q.max_inflight_per_endpoint:
        return max(0, q.max_inflight_per_endpoint - ep.inflight)
    return BIG


class _Model:
    """One model's waiting requests."""

    __slots__ = ("profile", "pump", "queue", "reserved")

    def __init__(self, profile: ModelProfile) -> None:
        self.profile = profile
        self.queue: FairQueue[asyncio.Future[None]] = FairQueue(PRIORITIES)
        self.reserved = 0
        """Requests let out of the queue that have not reached their endpoint yet."""
        self.pump: asyncio.Task[None] | None = None


class Queues:
    """Every queued model of one router process."""

    def __init__(
        self, endpoints: Callable[[str], Sequence[routing.EndpointState]], metrics: Metrics
    ) -> None:
        """`endpoints(model)`: the table's."""
        self._endpoints = endpoints
        self._metrics = metrics
        self._models: dict[str, _Model] = {}
        self.waiting: dict[str, int] = {}
        """Model -> requests waiting now (the load reports' and the metrics')."""

    def with_room(self, profile: ModelProfile, eps: Sequence[routing.EndpointState]) -> (
        Sequence[routing.EndpointState]
    ):  # fmt: skip
        """The endpoints a request of `profile` may be sent to now."""
        q = profile.queue
        if not q.capped:
            return eps
        return [ep for ep in eps if slots(ep, q) > 0]

    def _free(self, m: _Model) -> int:
        q = m.profile.queue
        eps = self._endpoints(m.profile.name)
        return sum(min(slots(ep, q), BIG) for ep in eps) - m.reserved

    def _model(self, profile: ModelProfile) -> _Model:
        m = self._models.get(profile.name)
        if m is None:
            m = self._models[profile.name] = _Model(profile)
        m.profile = profile  # a changed profile's bounds apply from now
        return m

    def needed(self, profile: ModelProfile) -> bool:
        """True when a request of `profile` must wait: others wait, or no endpoint has room
        (while it has ready endpoints: with none, the attempt planner answers)."""
        if not profile.queue.capped:
            return False
        m = self._model(profile)
        if len(m.queue):
            return True
        if not any(ep.ready for ep in self._endpoints(profile.name)):
            return False
        return self._free(m) <= 0

    async def wait(
        self, profile: ModelProfile, principal: Principal | None, deadline: float
    ) -> Refusal | None:
        """Wait for room (None, with a slot reserved until `sent`), or the refusal."""
        q = profile.queue
        m = self._model(profile)
        name = profile.name
        if len(m.queue) >= q.max_queued:
            self._told(name, 0.0, "full")
            return Refusal(
                503, f"the model {name!r} is at capacity and {q.max_queued} requests already"
                " wait for it here: retry shortly", "server_error", "queue_full",
                retry_after=RETRY_AFTER_S,
            )  # fmt: skip
        cls = principal.settings.priority if principal is not None else "normal"
        tenant = principal.name if principal is not None else ""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        m.queue.push(cls, tenant, fut)
        self._depth(name, +1)
        if m.pump is None or m.pump.done():
            m.pump = loop.create_task(self._pump(m))
        began = time.monotonic()
        until = min(deadline, began + q.max_wait_s)
        try:
            async with asyncio.timeout_at(loop.time() + until - began):
                await fut
        except TimeoutError:
            if m.queue.remove(cls, tenant, fut):
                self._told(name, time.monotonic() - began, "deadline")
                return Refusal(
                    504, f"the request waited {time.monotonic() - began:.1f} s for a free"
                    f" endpoint of {name!r} and its deadline passed: retry later",
                    "server_error", "queue_timeout",
                )  # fmt: skip
            # Let out just as its deadline came: it goes.
        except asyncio.CancelledError:
            if not m.queue.remove(cls, tenant, fut) and fut.done() and not fut.cancelled():
                m.reserved -= 1  # let out just as its client went away
                self.release(name)
            self._told(name, time.monotonic() - began, "gone")
            raise
        finally:
            self._depth(name, -1)
        # Its caller goes on to its endpoint without yielding to the loop (ranking among
        # `with_room`, then the attempt's in-flight count), so the reservation ends here.
        m.reserved -= 1
        self._told(name, time.monotonic() - began, "sent")
        return None

    def _depth(self, model: str, change: int) -> None:
        n = self.waiting.get(model, 0) + change
        if n:
            self.waiting[model] = n
        else:
            self.waiting.pop(model, None)
        self._metrics.queued(model, n)

    def release(self, model: str) -> None:
        """Room may have come free for `model`: let out as many as fit, in fair order."""
        m = self._models.get(model)
        if m is None or not len(m.queue):
            return
        free = self._free(m)
        while free > 0 and len(m.queue):
            fut = m.queue.pop()
            if fut is None:
                break
            if fut.done():
                continue
            fut.set_result(None)
            m.reserved += 1
            free -= 1

    async def _pump(self, m: _Model) -> None:
        """While requests wait: look for room regularly (engines' queues drain without any
        request of ours ending; endpoints come up)."""
        while len(m.queue):
            self.release(m.profile.name)
            await asyncio.sleep(PUMP_S)

    def _told(self, model: str, seconds: float, outcome: str) -> None:
        self._metrics.queue_waited(model, seconds, outcome)

"""Holding requests for a model scaled to zero while a replica starts.

An autoscaled model (`ModelProfile.autoscale`) may have no endpoint at all: at zero
replicas, or while its first ones start. Its requests then wait here rather than fail:
at most `hold_requests` of them per model in this router process, each at most
`hold_s`, until an endpoint of the model is ready. Those waiting are counted in the
router's load report (llmgw.router.signals), which is what brings the model back from
zero. Beyond the bound, or past the deadline, the request gets a 503 with `Retry-After`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from llmgw.core import routing
from llmgw.core.profile import ModelProfile
from llmgw.router.errors import Refusal

POLL_S = 0.05
RETRY_AFTER_S = 5


class Holds:
    """Requests waiting for a model's first endpoint, per model."""

    def __init__(self, endpoints: Callable[[str], Sequence[routing.EndpointState]]) -> None:
        self._endpoints = endpoints
        self.waiting: dict[str, int] = {}
        """Model -> requests waiting now."""

    def needed(self, profile: ModelProfile) -> bool:
        """True when requests for `profile` must wait: autoscaled, with no endpoint at all
        (at zero, or its first replica starting). A model whose endpoints are there but
        failing is answered as before: holding would only delay the error."""
        return profile.autoscale is not None and not self._endpoints(profile.name)

    def _ready(self, profile: ModelProfile) -> bool:
        return any(ep.ready for ep in self._endpoints(profile.name))

    async def wait(self, profile: ModelProfile) -> Refusal | None:
        """Until an endpoint of the model is ready (None), or a 503 to answer with."""
        spec = profile.autoscale
        assert spec is not None
        name = profile.name
        if self.waiting.get(name, 0) >= spec.hold_requests:
            return Refusal(
                503,
                f"the model {name!r} is starting and {spec.hold_requests} requests already "
                "wait for it: retry shortly",
                "server_error", "model_starting", retry_after=RETRY_AFTER_S,
            )  # fmt: skip
        self.waiting[name] = self.waiting.get(name, 0) + 1
        deadline = time.monotonic() + spec.hold_s
        try:
            while not self._ready(profile):
                if time.monotonic() >= deadline:
                    return Refusal(
                        503,
                        f"the model {name!r} had no replica ready within {spec.hold_s:g} s: "
                        "retry shortly",
                        "server_error", "model_starting", retry_after=RETRY_AFTER_S,
                    )  # fmt: skip
                await asyncio.sleep(POLL_S)
            return None
        finally:
            self.waiting[name] -= 1
            if not self.waiting[name]:
                del self.waiting[name]

"""The simulated engine's fault plan: what `/sim/faults` set, and how many requests it
still hits. Tests of routers and clients use it to make an engine stall, fail or die.
Used by `llmgw.sim.server`.
"""

from __future__ import annotations

import msgspec

from llmgw.sim.config import Faults


class InvalidPlan(ValueError):
    """A fault plan `/sim/faults` refuses; the message says why."""


class FaultPlan:
    """The active faults, and how many requests they still hit (None: every one)."""

    def __init__(self, faults: Faults) -> None:
        self.faults = faults
        self.left = faults.count

    def take(self) -> Faults | None:
        """The faults for the next request, counting it; None when none are active."""
        f = self.faults
        if not f.active:
            return None
        if self.left is not None:
            self.left -= 1
            if self.left <= 0:
                self.clear()
        return f

    def set(self, raw: bytes) -> Faults:
        """Replace the plan with the JSON body `raw` (empty: no faults); InvalidPlan if bad."""
        try:
            plan = msgspec.json.decode(raw or b"{}", type=Faults)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise InvalidPlan(str(exc)) from None
        problem = plan.problem()
        if problem:
            raise InvalidPlan(problem)
        self.faults = plan
        self.left = plan.count
        return plan

    def clear(self) -> None:
        self.faults = Faults()
        self.left = None

    def json(self) -> bytes:
        """What `GET /sim/faults` answers: the plan, its remaining count, and whether it is on."""
        body = msgspec.to_builtins(self.faults)
        body["count"] = self.left
        body["active"] = self.faults.active
        return msgspec.json.encode(body)

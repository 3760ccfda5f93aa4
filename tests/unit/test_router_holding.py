"""Holding requests for an autoscaled model at zero replicas (llmgw.router.holding)."""

from __future__ import annotations

import asyncio

from llmgw.core import routing
from llmgw.core.autoscale import Autoscale
from llmgw.core.profile import ModelProfile
from llmgw.router.holding import Holds

SCALED = ModelProfile(name="m", engine="sim", autoscale=Autoscale(
    min=0, max=2, running_per_replica=1, hold_requests=2, hold_s=0.5))  # fmt: skip
FIXED = ModelProfile(name="f", engine="sim")


def endpoint(ready: bool) -> routing.EndpointState:
    return routing.EndpointState(id="e", url="http://e", models=frozenset({"m"}), ready=ready)


async def test_requests_wait_for_the_first_endpoint_within_their_bound() -> None:
    table: dict[str, list[routing.EndpointState]] = {}
    holds = Holds(lambda model: table.get(model, []))
    assert not holds.needed(FIXED)  # not autoscaled: answered as ever
    assert holds.needed(SCALED)
    first = asyncio.create_task(holds.wait(SCALED))
    second = asyncio.create_task(holds.wait(SCALED))
    await asyncio.sleep(0.01)
    assert holds.waiting == {"m": 2}
    # A third beyond hold_requests: 503 at once, with Retry-After.
    third = await holds.wait(SCALED)
    assert third is not None
    assert third.status == 503
    assert third.retry_after > 0
    assert "2 requests already wait" in third.message
    # An endpoint that is not ready yet keeps them waiting; a ready one lets them go.
    table["m"] = [endpoint(ready=False)]
    assert not holds.needed(SCALED)  # a new request is not held: endpoints are there
    await asyncio.sleep(0.1)
    assert not first.done()
    table["m"][0].ready = True
    assert await first is None
    assert await second is None
    assert holds.waiting == {}


async def test_a_request_held_past_its_deadline_gets_a_503_with_retry_after() -> None:
    holds = Holds(lambda model: [])
    refused = await asyncio.wait_for(holds.wait(SCALED), 30)  # hold_s is 0.5 s
    assert refused is not None
    assert refused.status == 503
    assert refused.code == "model_starting"
    assert "no replica ready within 0.5 s" in refused.message
    assert holds.waiting == {}

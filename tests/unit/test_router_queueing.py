"""The router's wait for room (llmgw.router.queueing), on a real event loop and endpoint
table: who is let out, in what order, and that every slot let out comes back, so the
queue drains. The router's HTTP path over it is tests/integration/test_router_queueing.py.
"""

from __future__ import annotations

import asyncio
import time

from llmgw.core.profile import ModelProfile, Queueing
from llmgw.core.tenancy import KeySettings
from llmgw.router import auth, queueing
from llmgw.router.errors import Refusal
from llmgw.router.metrics import Metrics
from llmgw.router.table import EndpointTable

DEADLINE_S = 10.0
"""Generous: a loaded machine may be slow; each wait normally ends in milliseconds."""


def key(name: str, priority: str = "normal") -> auth.Principal:
    return auth.Principal(KeySettings(name=name, priority=priority), auth.digest(name), 0.0)  # type: ignore[arg-type]


def setup(**bounds: float) -> tuple[EndpointTable, queueing.Queues, ModelProfile]:
    table = EndpointTable()
    table.add("e", "http://127.0.0.1:1", ["m"], ready=True)
    queues = queueing.Queues(table.for_model, Metrics())
    return table, queues, ModelProfile(name="m", queue=Queueing(**bounds))  # type: ignore[arg-type]


async def until(check: object, what: str) -> None:
    end = time.monotonic() + DEADLINE_S
    while not check():  # type: ignore[operator]
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def test_slots_count_only_ready_endpoints_below_their_bounds() -> None:
    table, _, _ = setup()
    ep = table.by_id["e"]
    q = Queueing(max_inflight_per_endpoint=2, max_engine_waiting=3)
    assert queueing.slots(ep, q) == 2
    ep.inflight = 5  # more than the bound (a lowered bound): no room, never negative room
    assert queueing.slots(ep, q) == 0
    ep.inflight, ep.queue_depth = 0, 3.0
    assert queueing.slots(ep, q) == 0
    ep.queue_depth = 2.9
    assert queueing.slots(ep, q) == 2
    ep.ready = False
    assert queueing.slots(ep, q) == 0


async def test_keys_take_turns_and_every_slot_comes_back_so_the_queue_drains() -> None:
    table, queues, profile = setup(max_inflight_per_endpoint=1)
    ep = table.by_id["e"]
    assert not queues.needed(profile)
    ep.inflight = 1  # a request in flight fills the endpoint
    assert queues.needed(profile)
    order: list[str] = []

    async def request(tag: str, who: auth.Principal) -> None:
        assert await queues.wait(profile, who, time.monotonic() + 60) is None
        order.append(tag)
        ep.inflight += 1  # as the attempt does, before yielding to the loop

    noisy, quiet = key("noisy"), key("quiet")
    tasks = [asyncio.create_task(request(f"n{i}", noisy)) for i in range(3)]
    await until(lambda: queues.waiting.get("m") == 3, "three waiting")
    tasks.append(asyncio.create_task(request("q0", quiet)))
    await until(lambda: queues.waiting.get("m") == 4, "four waiting")
    # A newcomer waits behind them, even when a slot is free at that moment.
    ep.inflight = 0
    assert queues.needed(profile)
    for done in range(1, 5):
        queues.release("m")
        await until(lambda: len(order) == done, f"request {done} let out")  # noqa: B023
        assert ep.inflight == 1, "one slot, one request let out"
        ep.inflight -= 1  # it ended
    await asyncio.gather(*tasks)
    assert order == ["n0", "q0", "n1", "n2"]
    assert queues.waiting == {}
    assert not queues.needed(profile)


async def test_a_request_let_out_as_its_client_goes_passes_its_slot_on() -> None:
    table, queues, profile = setup(max_inflight_per_endpoint=1, max_wait_s=DEADLINE_S)
    ep = table.by_id["e"]
    ep.inflight = 1
    first = asyncio.create_task(queues.wait(profile, key("a"), time.monotonic() + 60))
    await until(lambda: queues.waiting.get("m") == 1, "the first waiting")
    second = asyncio.create_task(queues.wait(profile, key("b"), time.monotonic() + 60))
    await until(lambda: queues.waiting.get("m") == 2, "the second waiting")
    ep.inflight = 0
    queues.release("m")
    first.cancel()  # its client went away before it reached its endpoint
    assert await asyncio.wait_for(second, DEADLINE_S * 2) is None


async def test_an_engine_queue_that_drains_lets_requests_out_again_and_again() -> None:
    table, queues, profile = setup(max_engine_waiting=1, max_wait_s=DEADLINE_S)
    ep = table.by_id["e"]
    for _ in range(2):  # the second time after the first wait's pump ended
        ep.queue_depth = 1.0
        assert queues.needed(profile)
        waiter = asyncio.create_task(queues.wait(profile, None, time.monotonic() + 60))
        await until(lambda: queues.waiting.get("m") == 1, "one waiting")
        ep.queue_depth = 0.0  # no request of this router ends: only the pump sees it
        assert await asyncio.wait_for(waiter, DEADLINE_S * 2) is None
        pump = queues._models["m"].pump
        assert pump is not None
        await asyncio.wait_for(pump, DEADLINE_S)  # it ends with nothing waiting


async def test_no_ready_endpoint_is_no_wait_and_a_full_queue_or_a_long_wait_is_refused() -> None:
    table, queues, profile = setup(max_inflight_per_endpoint=1, max_queued=1, max_wait_s=0.05)
    ep = table.by_id["e"]
    ep.ready = False
    assert not queues.needed(profile), "with no endpoint up the planner answers at once"
    ep.ready, ep.inflight = True, 1
    waiter = asyncio.create_task(queues.wait(profile, None, time.monotonic() + 60))
    await until(lambda: queues.waiting.get("m") == 1, "one waiting")
    full = await queues.wait(profile, None, time.monotonic() + 60)
    assert isinstance(full, Refusal)
    assert full.status == 503
    assert full.retry_after
    late = await asyncio.wait_for(waiter, DEADLINE_S)  # max_wait_s, not the far deadline
    assert isinstance(late, Refusal)
    assert late.status == 504
    assert queues.waiting == {}


def test_ranking_sees_only_the_endpoints_with_room() -> None:
    table, queues, profile = setup(max_inflight_per_endpoint=1)
    table.add("f", "http://127.0.0.1:2", ["m"], ready=True)
    table.by_id["e"].inflight = 1
    assert [ep.id for ep in queues.with_room(profile, table.for_model("m"))] == ["f"]
    unbounded = ModelProfile(name="m")
    assert [ep.id for ep in queues.with_room(unbounded, table.for_model("m"))] == ["e", "f"]


async def test_a_waiter_cancelled_just_before_room_comes_is_skipped_not_a_crash() -> None:
    """Its future is cancelled at once, its own clean-up runs a loop step later: a release
    in between finds it still queued, and must let the next request out instead."""
    table, queues, profile = setup(max_inflight_per_endpoint=1, max_wait_s=DEADLINE_S)
    ep = table.by_id["e"]
    ep.inflight = 1
    gone = asyncio.create_task(queues.wait(profile, key("a"), time.monotonic() + 60))
    await until(lambda: queues.waiting.get("m") == 1, "the first waiting")
    nxt = asyncio.create_task(queues.wait(profile, key("a"), time.monotonic() + 60))
    await until(lambda: queues.waiting.get("m") == 2, "the second waiting")
    gone.cancel()
    ep.inflight = 0
    queues.release("m")
    assert await asyncio.wait_for(nxt, DEADLINE_S * 2) is None
    assert gone.cancelled()


async def test_a_slot_let_out_is_held_until_its_request_reaches_the_endpoint() -> None:
    """Two releases before the request let out runs (two requests ending at once) let out
    one request for one free slot, not two onto an endpoint bounded to one."""
    table, queues, profile = setup(max_inflight_per_endpoint=1, max_wait_s=DEADLINE_S)
    ep = table.by_id["e"]
    ep.inflight = 1
    sent: list[int] = []

    async def request(n: int) -> None:
        assert await queues.wait(profile, None, time.monotonic() + 60) is None
        sent.append(n)
        ep.inflight += 1  # as the attempt does, before yielding to the loop

    waiters = []
    for n in range(2):
        waiters.append(asyncio.create_task(request(n)))
        await until(lambda: queues.waiting.get("m") == n + 1, "waiting")  # noqa: B023
    ep.inflight = 0
    queues.release("m")
    queues.release("m")
    await until(lambda: len(sent) == 1, "one let out")
    await asyncio.sleep(queueing.PUMP_S * 3)  # the pump's releases too
    assert sent == [0]
    assert ep.inflight == 1
    assert queues.waiting.get("m") == 1
    for w in waiters:
        w.cancel()


async def test_a_higher_class_key_goes_before_every_lower_one_waiting() -> None:
    table, queues, profile = setup(max_inflight_per_endpoint=1, max_wait_s=DEADLINE_S)
    ep = table.by_id["e"]
    ep.inflight = 1
    order: list[str] = []

    async def request(who: auth.Principal) -> None:
        assert await queues.wait(profile, who, time.monotonic() + 60) is None
        order.append(who.name)

    tasks = []
    for n, who in enumerate((key("bulk", "low"), key("bulk2", "low"), key("vip", "high"))):
        tasks.append(asyncio.create_task(request(who)))
        await until(lambda: queues.waiting.get("m") == n + 1, "waiting")  # noqa: B023
    ep.inflight = 0
    queues.release("m")
    await until(lambda: len(order) == 1, "one let out")
    assert order == ["vip"]
    for t in tasks:
        t.cancel()


async def test_a_request_deadline_sooner_than_max_wait_ends_its_wait() -> None:
    table, queues, profile = setup(max_inflight_per_endpoint=1, max_wait_s=DEADLINE_S * 6)
    table.by_id["e"].inflight = 1
    began = time.monotonic()
    late = await asyncio.wait_for(queues.wait(profile, None, began + 0.1), DEADLINE_S)
    assert isinstance(late, Refusal)
    assert (late.status, late.code) == (504, "queue_timeout")
    assert time.monotonic() - began < DEADLINE_S
    assert queues.waiting == {}


async def test_a_changed_profiles_bounds_apply_to_the_requests_waiting() -> None:
    """A raised bound (a new catalog) lets out a request waiting under the old one."""
    table, queues, profile = setup(max_inflight_per_endpoint=1, max_wait_s=DEADLINE_S)
    table.by_id["e"].inflight = 1
    assert queues.needed(profile)
    waiter = asyncio.create_task(queues.wait(profile, None, time.monotonic() + 60))
    await until(lambda: queues.waiting.get("m") == 1, "one waiting")
    raised = ModelProfile(
        name="m", queue=Queueing(max_inflight_per_endpoint=2, max_wait_s=DEADLINE_S)
    )
    queues.needed(raised)
    queues.release("m")
    assert await asyncio.wait_for(waiter, DEADLINE_S * 2) is None


async def test_the_metrics_show_the_depth_and_how_each_wait_ended() -> None:
    table, queues, profile = setup(max_inflight_per_endpoint=1, max_queued=1, max_wait_s=0.05)
    metrics = queues._metrics
    table.by_id["e"].inflight = 1
    waiter = asyncio.create_task(queues.wait(profile, None, time.monotonic() + 60))
    await until(lambda: queues.waiting.get("m") == 1, "one waiting")
    assert metrics.queue_depth.values[("m",)] == 1.0
    assert isinstance(await queues.wait(profile, None, time.monotonic() + 60), Refusal)
    assert isinstance(await asyncio.wait_for(waiter, DEADLINE_S), Refusal)
    assert metrics.queue_depth.values[("m",)] == 0.0
    assert {labels[1] for labels in metrics.queue_wait.values} == {"full", "deadline"}

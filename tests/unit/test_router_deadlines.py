"""Deadlines on one timer behave as asyncio.timeout_at does, on uvloop and on asyncio."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.router.deadlines import Watchdog

LOOPS = pytest.mark.parametrize("loop_factory", [uvloop.new_event_loop, asyncio.new_event_loop])


def run(
    loop_factory: Callable[[], asyncio.AbstractEventLoop], coro: Coroutine[Any, Any, Any]
) -> Any:
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(coro)


@LOOPS
def test_a_passed_deadline_raises_timeout_error(loop_factory: Any) -> None:
    async def main() -> float:
        dog = Watchdog()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        d = dog.at(t0 + 0.05)

        async def overrun() -> None:
            async with d:
                await asyncio.sleep(10)

        with pytest.raises(TimeoutError):
            await overrun()
        assert d.expired()
        assert len(dog) == 0
        return loop.time() - t0

    took = run(loop_factory, main())
    assert 0.04 <= took < 1.0


@LOOPS
def test_a_block_that_ends_in_time_is_untouched(loop_factory: Any) -> None:
    async def main() -> None:
        dog = Watchdog()
        loop = asyncio.get_running_loop()
        async with dog.at(loop.time() + 0.05) as d:
            await asyncio.sleep(0.01)
        assert not d.expired()
        assert len(dog) == 0
        await asyncio.sleep(0.1)  # the armed timer fires with nothing to do
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]

    run(loop_factory, main())


@LOOPS
def test_reschedule_later_and_earlier(loop_factory: Any) -> None:
    async def main() -> tuple[float, float]:
        dog = Watchdog()
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def moved_later() -> None:
            async with dog.at(t0 + 0.05) as d:
                await asyncio.sleep(0.02)
                d.reschedule(loop.time() + 0.2)  # moved later: must not fire at 0.05
                await asyncio.sleep(10)

        async def moved_earlier() -> None:
            async with dog.at(t1 + 30) as d:
                d.reschedule(t1 + 0.03)  # moved earlier: the timer is re-armed
                await asyncio.sleep(10)

        with pytest.raises(TimeoutError):
            await moved_later()
        later = loop.time() - t0
        t1 = loop.time()
        with pytest.raises(TimeoutError):
            await moved_earlier()
        return later, loop.time() - t1

    later, earlier = run(loop_factory, main())
    assert 0.2 <= later < 1.0
    assert 0.02 <= earlier < 1.0


@LOOPS
def test_a_deadline_already_past_fires_at_the_first_wait(loop_factory: Any) -> None:
    async def main() -> None:
        dog = Watchdog()
        loop = asyncio.get_running_loop()

        async def late() -> None:
            async with dog.at(loop.time() - 1):
                await asyncio.sleep(1)

        with pytest.raises(TimeoutError):
            await late()

    run(loop_factory, main())


@LOOPS
def test_a_cancel_from_elsewhere_stays_a_cancel(loop_factory: Any) -> None:
    async def main() -> None:
        dog = Watchdog()
        loop = asyncio.get_running_loop()

        async def guarded() -> None:
            async with dog.at(loop.time() + 30):
                await asyncio.sleep(10)

        task = asyncio.ensure_future(guarded())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(dog) == 0

    run(loop_factory, main())


@LOOPS
def test_nested_deadlines_each_raise_in_their_own_block(loop_factory: Any) -> None:
    async def main() -> list[str]:
        dog = Watchdog()
        loop = asyncio.get_running_loop()
        seen = []

        async def nested() -> None:
            async with dog.at(loop.time() + 0.15):
                try:
                    async with dog.at(loop.time() + 0.03):
                        await asyncio.sleep(10)
                except TimeoutError:
                    seen.append("inner")
                await asyncio.sleep(10)

        with pytest.raises(TimeoutError):
            await nested()
        seen.append("outer")
        return seen

    assert run(loop_factory, main()) == ["inner", "outer"]


def test_moving_a_deadline_outside_its_block_is_refused() -> None:
    dog = Watchdog()
    with pytest.raises(RuntimeError):
        dog.at(1.0).reschedule(2.0)


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.booleans()), min_size=1, max_size=30))
def test_many_deadlines_fire_in_time_and_only_those_due(plan: list[tuple[int, bool]]) -> None:
    """A task that overruns its deadline (`ms` from the start) is cut close to it; one
    that ends at `ms`, a second before its deadline, never is."""

    async def main() -> list[tuple[bool, bool, float]]:
        dog = Watchdog()
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def one(ms: int, late: bool) -> tuple[bool, bool, float]:
            end = t0 + ms / 1000
            when = end if late else end + 1.0
            try:
                async with dog.at(when):
                    await asyncio.sleep(10.0 if late else max(end - loop.time(), 0))
            except TimeoutError:
                return late, True, loop.time() - when
            return late, False, 0.0

        results = await asyncio.gather(*(one(ms, late) for ms, late in plan))
        assert len(dog) == 0
        return results

    for late, fired, lateness in run(uvloop.new_event_loop, main()):
        assert fired == late
        if fired:
            assert -0.002 <= lateness < 0.5

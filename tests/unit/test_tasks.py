"""Stopping and retrying background work (llmgw.tasks): a task that swallows a cancel is
cancelled again, one that never ends is given up on, boundedly; a failing feed retries
after 1 s doubling to 30 s, and one that ran a minute starts over at 1 s; work run
`uncancelled` ends even when whoever awaited it was cancelled."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from llmgw import tasks


async def _swallows_cancels(times: int, entered: asyncio.Event) -> None:
    swallowed = 0
    entered.set()
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            swallowed += 1
            if swallowed > times:
                raise


async def test_a_task_that_swallows_one_cancel_is_cancelled_again() -> None:
    entered = asyncio.Event()
    plain = asyncio.create_task(asyncio.sleep(3600))
    stubborn = asyncio.create_task(_swallows_cancels(1, entered))
    await entered.wait()
    try:
        await tasks.stop([plain, stubborn], timeout_s=0.2, who="test")
        assert plain.cancelled()
        assert stubborn.cancelled()
    finally:
        await _ended(plain, stubborn)


async def _ended(*running: asyncio.Task[None]) -> None:
    """Cancelled until done, whatever `stop` did: none outlives its test."""
    for task in running:
        while not task.done():
            task.cancel()
            await asyncio.wait([task], timeout=1.0)


async def test_a_task_that_never_stops_is_given_up_on_within_twice_the_bound() -> None:
    entered = asyncio.Event()
    stuck = asyncio.create_task(_swallows_cancels(2, entered))
    await entered.wait()
    began = time.monotonic()
    try:
        await tasks.stop([stuck], timeout_s=0.2, who="test")
        assert time.monotonic() - began < 5.0
        assert not stuck.done()
    finally:
        await _ended(stuck)
    assert stuck.cancelled()


async def test_stopping_a_task_that_failed_retrieves_its_error_and_raises_nothing() -> None:
    async def fails() -> None:
        raise RuntimeError("handled where it happened")

    failed = asyncio.create_task(fails())
    await asyncio.wait([failed])
    await tasks.stop([failed], timeout_s=0.2, who="test")
    assert isinstance(failed.exception(), RuntimeError)


class _Said:
    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.lines.append({"event": event, **fields})


async def test_retries_wait_one_second_doubling_to_thirty() -> None:
    said = _Said()
    wake = asyncio.Event()
    wake.set()  # every wait is cut short: the waits are read from the log

    async def fails() -> None:
        raise ConnectionError("no server yet")

    await tasks.retrying(
        fails, stopped=lambda: len(said.lines) >= 8, wake=wake, what="feed", logger=said
    )
    assert [line["retry_in_s"] for line in said.lines] == [1, 2, 4, 8, 16, 30, 30, 30]
    assert {line["event"] for line in said.lines} == {"feed_failed"}
    assert said.lines[0]["error"] == "no server yet"


async def test_an_attempt_that_ran_a_minute_retries_after_one_second_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    said = _Said()
    wake = asyncio.Event()
    wake.set()
    clock = [1000.0]
    # the module's clock only: the event loop keeps its own
    monkeypatch.setattr(tasks, "time", SimpleNamespace(monotonic=lambda: clock[0]))

    async def fails() -> None:
        if len(said.lines) == 3:
            clock[0] += 61.0  # this one served a minute before its connection was lost
        raise ConnectionError("")

    await tasks.retrying(
        fails, stopped=lambda: len(said.lines) >= 6, wake=wake, what="feed", logger=said
    )
    assert [line["retry_in_s"] for line in said.lines] == [1, 2, 4, 1, 2, 4]
    assert said.lines[0]["error"] == "ConnectionError"


async def test_uncancelled_work_ends_when_its_awaiter_is_cancelled() -> None:
    release = asyncio.Event()
    ended: list[str] = []

    async def change() -> None:
        await release.wait()
        ended.append("recorded")

    awaiter = asyncio.create_task(tasks.uncancelled(change()))
    await asyncio.sleep(0)
    awaiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await awaiter
    assert len(tasks._UNCANCELLED) == 1  # held: the loop keeps only a weak reference
    (work,) = tasks._UNCANCELLED
    release.set()
    await asyncio.wait([work], timeout=30)
    assert ended == ["recorded"]
    assert not tasks._UNCANCELLED  # let go once it ended

"""`bus.close`: a shutdown goes on whatever state the connection is in."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from llmgw import bus


class _Connection:
    def __init__(self, fails_with: BaseException | None = None, hangs: bool = False) -> None:
        self.fails_with = fails_with
        self.hangs = hangs
        self.closes = 0
        self.is_closed = False

    async def close(self) -> None:
        self.closes += 1
        if self.hangs:
            await asyncio.Event().wait()
        if self.fails_with is not None:
            raise self.fails_with
        self.is_closed = True


@pytest.mark.parametrize(
    "failure",
    [
        # What nats-py raised when the server went away while it reconnected over TLS.
        AttributeError("'NoneType' object has no attribute '_write_appdata'"),
        ConnectionResetError("reset"),
        RuntimeError("anything else"),
    ],
)
async def test_a_close_that_fails_does_not_raise(failure: BaseException) -> None:
    nc: Any = _Connection(fails_with=failure)
    await bus.close(nc)
    assert nc.closes == 1


async def test_a_close_that_hangs_ends_at_its_timeout() -> None:
    nc: Any = _Connection(hangs=True)
    await bus.close(nc, timeout_s=0.05)
    assert nc.closes == 1


async def test_a_closed_connection_is_left_alone() -> None:
    nc: Any = _Connection()
    await bus.close(nc)
    await bus.close(nc)
    assert nc.closes == 1


async def test_a_cancelled_shutdown_still_propagates_the_cancellation() -> None:
    nc: Any = _Connection(hangs=True)
    task = asyncio.create_task(bus.close(nc, timeout_s=30))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

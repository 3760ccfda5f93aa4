"""An aiohttp application served on 127.0.0.1 in the test's own event loop."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web


@contextlib.asynccontextmanager
async def served(app: web.Application, shutdown_timeout: float = 60.0) -> AsyncIterator[str]:
    """`app` on a free port of 127.0.0.1 until the block ends: its base URL."""
    runner = web.AppRunner(app, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()

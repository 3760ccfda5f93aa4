"""An aiohttp application served on 127.0.0.1 from a thread and event loop of its own,
for tests whose client side blocks (httpx, a router subprocess): canned engines and the
OTLP receiver.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ThreadedApp:
    """`app` served until `stop()`; `url` is its base URL."""

    def __init__(self, app: web.Application) -> None:
        self.url = ""
        self.loop = asyncio.new_event_loop()
        # No access log: its lines, written from this thread, could outlive the test
        # capturing the output ("I/O operation on closed file").
        self.runner = web.AppRunner(app, access_log=None)
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        if not started.wait(30):
            raise RuntimeError(f"{type(self).__name__} did not start")

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        started.set()
        self.loop.run_forever()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def engine_app(chat: Handler) -> web.Application:
    """An engine as a router sees it: `chat` for chat completions, an empty /health."""

    async def health(_: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    return app

"""The console's token in a real browser (Debian's Chromium, headless): the page opened at
the address `llmgw console` prints keeps the token to itself. A browser sends a host's
cookies to every port of that host, so a token kept in a cookie would reach any server on
127.0.0.1 the operator's browser opens (another user's, on another port), and that user
could then read the fleet and drain its nodes as the console's operator."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from llmgw.cli import console as console_cli
from llmgw.core import state
from llmgw.ctl.console import server
from tests.kit.browser import chromium

pytestmark = pytest.mark.slow

TOKEN = "t0ken-of-the-console"


class _QuietFleet:
    """A fold that is still reading the log and never folds a batch."""

    def __init__(self) -> None:
        self.state = state.ClusterState()
        self.recent: list[dict[str, Any]] = []
        self.ready = asyncio.Event()

    async def watch(self) -> AsyncIterator[list[dict[str, Any]]]:
        await asyncio.Event().wait()
        yield []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def _serve(app: web.Application, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, shutdown_timeout=1)  # the page's stream stays open
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def test_the_token_reaches_no_other_port_of_the_host() -> None:
    console_port, other_port = _free_port(), _free_port()
    hosts = console_cli._hosts("127.0.0.1", console_port)
    app = server.build_app(_QuietFleet(), hosts, TOKEN)  # type: ignore[arg-type]
    heard: list[str] = []

    async def other(request: web.Request) -> web.Response:
        heard.append(f"{request.headers.get('Cookie')} {request.headers.get('Authorization')}")
        return web.Response(text="<p>another user's page</p>", content_type="text/html")

    elsewhere = web.Application()
    elsewhere.router.add_get("/", other)
    runners = [await _serve(app, console_port), await _serve(elsewhere, other_port)]
    printed = console_cli.opening_address(f"http://127.0.0.1:{console_port}", TOKEN)

    def browse() -> tuple[str, Any]:
        with chromium() as d:
            d.get(printed)
            shown = d.current_url
            # The page's own requests carry the token: the event list answers.
            answer = d.execute_async_script(
                "const done = arguments[0];"
                "api('/api/events').then((rows) => done(rows.length), (e) => done(e.message));"
            )
            d.get(f"http://127.0.0.1:{other_port}/")
            return shown, answer

    try:
        shown, answer = await asyncio.to_thread(browse)
    finally:
        for runner in runners:
            await runner.cleanup()
    assert TOKEN not in shown, "the token stays in the address bar (and the history)"
    assert answer == 0, answer
    assert heard, "the other port's page was not opened"
    assert all(TOKEN not in h for h in heard), heard

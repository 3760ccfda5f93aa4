"""The console's token on loopback: a request whose credentials are not the token is a 401,
whatever bytes its `Authorization` or `Cookie` header holds (aiohttp hands non-UTF-8
bytes over as surrogates), never a 500 with a traceback in the console's log."""

from __future__ import annotations

import asyncio
import types

import pytest
from aiohttp.test_utils import TestServer

from llmgw.core import state
from llmgw.ctl.console import server

TOKEN = "t0ken"


async def _exchange(port: int, head: bytes) -> bytes:
    """Send a raw request head, return the response's status line and headers."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        await writer.drain()
        return await reader.readuntil(b"\r\n\r\n")
    finally:
        writer.close()


@pytest.mark.parametrize(
    "credentials",
    [
        b"Authorization: Bearer \xff\xfe",
        b"Authorization: Bearer t0ken\xc3",
        b"Cookie: llmgw_console=\xff\xfe",
        b"Cookie: llmgw_console=t0ken\x80",
    ],
)
async def test_credentials_that_are_not_utf8_are_refused_with_401(credentials: bytes) -> None:
    live = types.SimpleNamespace(state=state.ClusterState(), recent=[])
    app = server.build_app(live, set(), TOKEN)  # type: ignore[arg-type]
    site = TestServer(app)
    await site.start_server()
    try:
        port = site.port
        assert port is not None
        answer = await _exchange(
            port, b"GET /api/events HTTP/1.1\r\nHost: 127.0.0.1\r\n" + credentials + b"\r\n\r\n"
        )
        assert answer.startswith(b"HTTP/1.1 401"), answer
        ok = await _exchange(
            port, b"GET /api/events HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t0ken\r\n\r\n"
        )
        assert ok.startswith(b"HTTP/1.1 200"), ok
    finally:
        await site.close()

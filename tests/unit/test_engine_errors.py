"""What the router takes of an engine's error (llmgw.router.errors, llmgw.router.apis): at
most `ENGINE_SAID_READ` bytes of a 5xx read to quote it, and an engine's 4xx text relayed
cut to size, however much the engine sends."""

from __future__ import annotations

import asyncio
import json

from llmgw.router import apis, errors
from llmgw.router.upstream import Pool, Response, _Conn
from tests.unit.test_router_upstream import FakeTransport, chunked


def test_a_5xx_is_read_only_as_far_as_its_quote_needs() -> None:
    """An engine whose 500 goes on for 64 KiB, a KiB at a time: the router reads a bounded
    part of it (the rest goes with the connection), not all it is sent."""

    async def run() -> tuple[errors.Retry, int]:
        conn = _Conn(asyncio.get_running_loop())
        conn.connection_made(FakeTransport())  # type: ignore[arg-type]
        conn.expecting = True
        conn.data_received(b"HTTP/1.1 500 Oops\r\nTransfer-Encoding: chunked\r\n\r\n")
        body = chunked([b"x" * 1024] * 64)

        async def send() -> None:  # a segment per turn of the loop, as a socket would
            for at in range(0, len(body), 1024):
                conn.data_received(body[at : at + 1024])
                await asyncio.sleep(0)

        sending = asyncio.ensure_future(send())
        retry = await errors.status_retry(Response(conn, Pool()), "")
        await sending
        return retry, sum(len(c) for c in conn._chunks)

    retry, unread = asyncio.run(run())
    assert retry.status == 502
    assert 64 * 1024 - unread <= 2 * errors.ENGINE_SAID_READ  # what was read


def test_an_engines_4xx_text_is_relayed_cut_to_size() -> None:
    said = apis.engine_answer("chat", 400, b"no " * 100_000, "")
    message = json.loads(said)["error"]["message"]
    assert message.startswith("no no")
    assert len(message) <= 2000

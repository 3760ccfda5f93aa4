"""The shared connection handler (llmgw.http_server) is built only on the aiohttp it was
written for: for the router's low-level servers and for the other listeners' applications
alike; on another aiohttp, each gets aiohttp's own, and the log says why."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
from collections.abc import AsyncIterator

import pytest
import structlog
from aiohttp import http_exceptions, web

from llmgw import http_server, listeners, logs
from llmgw.router import protocol

RULES = http_server.Rules(5.0, logs.get("llmgw.test"))


async def _handler(request: web.BaseRequest) -> web.StreamResponse:
    return web.Response(text="ok")


async def _app_server(runner: web.AppRunner) -> web.Server:
    await runner.setup()
    assert runner.server is not None
    return runner.server


async def test_the_installed_aiohttp_gets_the_handler() -> None:
    assert http_server.SUPPORTED, "pyproject pins aiohttp to the versions the handler knows"
    srv = protocol.server(_handler, head_timeout_s=5.0, client_max_size=1024)
    assert isinstance(srv, http_server.Server)
    assert isinstance(srv(), http_server.Handler)
    runner = http_server.app_runner(web.Application(), rules=RULES, handler_cancellation=True)
    try:
        app_srv = await _app_server(runner)
        assert isinstance(app_srv, http_server.Server)
        assert app_srv.handler_cancellation  # aiohttp's arguments reach the server
        assert isinstance(app_srv(), http_server.Handler)
        # Bodies are never inflated, not even the rest of a refused one that aiohttp drains.
        for made in (srv, app_srv):
            assert made._kwargs["auto_decompress"] is False
    finally:
        await runner.cleanup()


async def test_another_aiohttp_gets_its_own_server_and_the_log_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(http_server, "SUPPORTED", False)
    with structlog.testing.capture_logs() as logged:
        srv = protocol.server(_handler, head_timeout_s=5.0, client_max_size=1024)
        runner = http_server.app_runner(web.Application(), rules=RULES)
    assert type(srv) is web.Server
    assert not isinstance(srv(), http_server.Handler)
    try:
        app_srv = await _app_server(runner)
        assert type(app_srv) is web.Server
        assert not isinstance(app_srv(), http_server.Handler)
    finally:
        await runner.cleanup()
    lines = [e for e in logged if e["event"] == "request_handler_stock"]
    assert len(lines) == 2  # one per listener
    assert all("head" in line["reason"] for line in lines)


Served = tuple[int, list[bytes]]
"""A listener's port, and the bodies its handler has read."""


@contextlib.asynccontextmanager
async def _serving(
    kind: str, supported: bool, monkeypatch: pytest.MonkeyPatch, rules: http_server.Rules = RULES
) -> AsyncIterator[Served]:
    """A listener on 127.0.0.1, a low-level server's or an Application's, with llmgw's
    handler (`supported`) or aiohttp's own, whose handler answers 200 with what it read."""
    monkeypatch.setattr(http_server, "SUPPORTED", supported)
    read: list[bytes] = []

    async def echo(request: web.BaseRequest) -> web.StreamResponse:
        read.append(await request.read())
        return web.Response(text="ok")

    if kind == "server":
        runner: web.BaseRunner = web.ServerRunner(
            http_server.server(echo, rules=rules, client_max_size=1 << 20)
        )
    else:
        app = web.Application()
        app.router.add_route("*", "/", echo)
        runner = http_server.app_runner(app, rules=rules)
    await runner.setup()
    sock = listeners.bind("127.0.0.1", 0, setting="port")
    try:
        await http_server.start_site(runner, sock, rules=rules)
        yield sock.getsockname()[1], read
    finally:
        await runner.cleanup()


async def _ask(port: int, method: str, headers: list[str], body: bytes) -> tuple[int, bytes]:
    """The status and body of the answer to one request (Connection: close)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    lines = [f"{method} / HTTP/1.1", "Host: 127.0.0.1", *headers, "Connection: close"]
    if body:
        lines.append(f"Content-Length: {len(body)}")
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
    answer = await reader.read()
    writer.close()
    head, _, content = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), content


LISTENERS = pytest.mark.parametrize(
    ("kind", "supported"), [("server", True), ("server", False), ("app", True), ("app", False)]
)


@LISTENERS
@pytest.mark.parametrize(
    ("codings", "refused"),
    [
        ([], False),
        (["identity"], False),
        ([" Identity "], False),
        ([""], False),
        (["identity,"], False),
        (["gzip"], True),
        (["GZIP"], True),
        (["br"], True),
        (["identity, deflate"], True),
        (["identity", "gzip"], True),
        (["x-anything"], True),
    ],
)
async def test_a_body_under_any_coding_but_identity_gets_415_before_the_handler(
    kind: str, supported: bool, codings: list[str], refused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On every listener, llmgw's connection handler or aiohttp's own: a body is taken as
    sent, and one with a content coding is answered 415 in the listener's error shape,
    its handler never called."""
    gzipped = gzip.compress(b'{"a": 1}')
    async with _serving(kind, supported, monkeypatch) as (port, read):
        headers = [f"Content-Encoding: {c}" for c in codings]
        status, body = await _ask(port, "POST", headers, gzipped)
    if refused:
        assert status == 415
        assert json.loads(body) == {"error": http_server.COMPRESSED}
        assert read == []
    else:
        assert status == 200
        assert read == [gzipped]


@LISTENERS
async def test_a_content_coding_without_a_body_is_served(
    kind: str, supported: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with _serving(kind, supported, monkeypatch) as (port, read):
        status, _ = await _ask(port, "GET", ["Content-Encoding: gzip"], b"")
    assert status == 200
    assert read == [b""]


@pytest.mark.parametrize(
    "head",
    [b"GET / HTTP/1.1\r\nOrigin: https://a.example\rX-Injected: 1\r\nHost: h",
     b"GET / HTTP/1.1\r\nOrigin: https://a.example\r\rSet-Cookie: s=1\r\nHost: h"],
)  # fmt: skip
def test_an_origin_holding_a_bare_cr_is_no_origin(head: bytes) -> None:
    # A late head's 408 repeats headers chosen by its Origin: a CR inside the value must
    # never reach them, where it would end a header line the client wrote.
    assert http_server.sent_origin(head) is None
    fine = head.replace(b"\rX-Injected: 1", b"").replace(b"\r\rSet-Cookie: s=1", b"")
    assert http_server.sent_origin(fine) == "https://a.example"
    tabbed = b"GET / HTTP/1.1\r\nOrigin:\t https://a.example \t\r\nHost: h"
    assert http_server.sent_origin(tabbed) == "https://a.example"


@pytest.mark.parametrize(
    "exc",
    [http_exceptions.BadStatusLine("GET sk-secret"), http_exceptions.InvalidURLError("sk-secret"),
     http_exceptions.BadHttpMessage("sk-secret"), http_exceptions.BadHttpMethod("sk-secret"),
     http_exceptions.InvalidHeader(b"sk-secret")],
)  # fmt: skip
def test_a_parser_message_without_its_fixed_reason_is_never_repeated(
    exc: http_exceptions.BadHttpMessage,
) -> None:
    # Only a reason the parser writes before the bytes it quotes is said; a message that is
    # all quote (a request line, a URL) is not, however short.
    said, kind = http_server.bad_http_message(exc)
    assert "sk-secret" not in said
    assert kind in ("not_http", "invalid_header")


@pytest.mark.parametrize("kind", ["server", "app"])
async def test_a_body_that_arrives_slower_than_the_head_deadline_is_served(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The head deadline is the head's: once a head is whole, the body's pieces that follow
    while its handler reads them are no head, however long they take."""
    rules = http_server.Rules(0.3, logs.get("llmgw.test"))
    body = b'{"a": 1, "b": 2}'
    async with _serving(kind, True, monkeypatch, rules) as (port, read):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        head = f"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: {len(body)}\r\n"
        writer.write(f"{head}Connection: close\r\n\r\n".encode() + body[:4])
        await writer.drain()
        for piece in (body[4:8], body[8:]):
            await asyncio.sleep(3 * rules.head_timeout_s)  # past the deadline, on purpose
            writer.write(piece)
            await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 60)
        writer.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    assert read == [body]


@pytest.mark.parametrize("kind", ["server", "app"])
async def test_a_late_heads_408_is_followed_by_the_end_of_the_stream_at_once(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a 408 the listener still reads (and drops) what comes for a while before it
    closes, but ends its side of the stream at once: the client sees the whole answer and
    its end, not a wait for the close."""
    monkeypatch.setattr(http_server, "_LINGER_S", 120.0)
    rules = http_server.Rules(0.3, logs.get("llmgw.test"))
    async with _serving(kind, True, monkeypatch, rules) as (port, read):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: h\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 60)
        writer.write(b"X-Late: 1\r\n")  # read and dropped, no reset
        await writer.drain()
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b"\r\nconnection: close" in head.lower()
    assert json.loads(body)["error"]
    assert read == []


@pytest.mark.parametrize("kind", ["server", "app"])
async def test_a_malformed_request_is_answered_400_and_its_connection_closed(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing after a request the parser gave up on is read as another request: the 400
    closes the connection."""
    async with _serving(kind, True, monkeypatch) as (port, read):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        bad = b"GET / HTTP/1.1\r\nHost: h\r\nX-Key: sk-secret\x01value\r\n\r\n"
        writer.write(bad + b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 60)
        writer.close()
    head = answer.partition(b"\r\n\r\n")[0]
    assert head.startswith((b"HTTP/1.1 400", b"HTTP/1.0 400")), answer[:300]
    assert b"sk-secret" not in answer
    assert answer.count(b"HTTP/1.") == 1
    assert read == []

"""The router's pool of engine connections (llmgw.router.upstream.Pool) over real local
sockets: a kept-alive connection carries the next request to the same engine and never a
request (with its engine's key) to another; the idle connections kept per engine are
bounded; what a malformed answer quotes through the pool is without the key presented;
a base URL's credentials never reach the engine's Host header; a connection that may
not carry another request (the engine closes it, sent bytes unasked, failed, or the
request was given up) is never pooled or sent the request again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest

from llmgw.core.redaction import FRAGMENT, KEY_MARK
from llmgw.router import http1
from llmgw.router.upstream import Pool, UpstreamError, _Conn, parse_base, request_head
from tests.harness import wait_for

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


@dataclass
class Engine:
    """A local engine: the Authorization of each request, by the connection it came on."""

    answer: Callable[[bytes], bytes] = lambda _head: OK
    heads: list[tuple[int, bytes]] = field(default_factory=list)
    connections: int = 0
    serving: list[tuple[asyncio.Task[None], asyncio.StreamWriter]] = field(default_factory=list)
    key: tuple[str, int, bool] = ("127.0.0.1", 0, False)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        task = asyncio.current_task()
        assert task is not None
        self.serving.append((task, writer))  # type: ignore[arg-type]
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                self.heads.append((number, head))
                writer.write(self.answer(head))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def authorizations(self) -> list[bytes]:
        return [h.split(b"Authorization: ")[1].split(b"\r\n")[0] for _, h in self.heads]


@asynccontextmanager
async def engine(answer: Callable[[bytes], bytes] = lambda _head: OK) -> AsyncIterator[Engine]:
    e = Engine(answer)
    server = await asyncio.start_server(e.serve, "127.0.0.1", 0)
    e.key = ("127.0.0.1", server.sockets[0].getsockname()[1], False)
    try:
        yield e
    finally:
        server.close()
        for _, writer in e.serving:  # its connections end: every handler returns
            writer.close()
        await asyncio.gather(*(task for task, _ in e.serving), return_exceptions=True)


async def ask(pool: Pool, e: Engine, engine_key: str) -> bytes:
    """One request to `e` presenting `engine_key`; its body, the connection given back."""
    head = request_head("/v1/x", "h", 2, [("Authorization", f"Bearer {engine_key}")])
    response = await pool.request(e.key, head, b"{}", connect_timeout=5.0, engine_key=engine_key)
    body = await response.read()
    response.close()
    return body


def test_a_kept_alive_connection_serves_its_own_engine_only() -> None:
    async def run() -> tuple[Engine, Engine]:
        pool = Pool()
        async with engine() as a, engine() as b:
            assert await ask(pool, a, "key-of-a") == b"ok"
            assert await ask(pool, a, "key-of-a") == b"ok"
            assert await ask(pool, b, "key-of-b") == b"ok"
            assert await ask(pool, a, "key-of-a") == b"ok"
        pool.close()
        return a, b

    a, b = asyncio.run(run())
    assert a.connections == 1  # kept alive: one connection for its three requests
    assert a.authorizations() == [b"Bearer key-of-a"] * 3
    assert b.authorizations() == [b"Bearer key-of-b"]


def test_the_idle_connections_kept_per_engine_are_bounded() -> None:
    async def run() -> int:
        pool = Pool(max_idle_per_host=1)
        async with engine() as a:
            await asyncio.gather(ask(pool, a, "k"), ask(pool, a, "k"), ask(pool, a, "k"))
            kept = len(pool._idle[a.key])  # the pool's own list: what it holds open
        pool.close()
        return kept

    assert asyncio.run(run()) == 1


def echoed_authorization(head: bytes) -> bytes:
    """An answer whose header block echoes the request's Authorization, its colon lost."""
    line = next(x for x in head.split(b"\r\n") if x.startswith(b"Authorization: "))
    return b"HTTP/1.1 200 OK\r\n" + line.replace(b": ", b" ", 1) + b"\r\n\r\n"


def test_a_malformed_answer_through_the_pool_quotes_no_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An engine echoes the request's Authorization in a header line the parser cannot
    frame: the error the router gets (the attempt's message, the log) has the key it
    presented out. (The Python parser quotes the line; llhttp quotes nothing.)"""
    monkeypatch.setattr(_Conn, "parser_class", http1.PyParser)
    key = "sk-engine-0123456789abcdef0123456789"

    async def run() -> str:
        pool = Pool()
        async with engine(echoed_authorization) as a:
            try:
                await ask(pool, a, key)
            except UpstreamError as exc:
                return str(exc)
            finally:
                pool.close()
        raise AssertionError("a malformed answer was taken")

    said = asyncio.run(run())
    assert "malformed" in said
    assert KEY_MARK in said
    assert key[:FRAGMENT] not in said


def test_a_base_urls_credentials_stay_out_of_the_host_header() -> None:
    key, host, prefix = parse_base("http://user:secret@engine.example:8000/v1-prefix")
    assert key == ("engine.example", 8000, False)
    assert host == "engine.example:8000"
    assert prefix == "/v1-prefix"


def test_an_answer_that_closes_the_connection_is_not_pooled() -> None:
    """An engine that says Connection: close but leaves the socket open: the router does
    not send its next request on that connection (the engine may close it under it)."""
    closing = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"

    async def run() -> Engine:
        pool = Pool()
        async with engine(lambda _head: closing) as a:
            assert await ask(pool, a, "k") == b"ok"
            assert await ask(pool, a, "k") == b"ok"
        pool.close()
        return a

    assert asyncio.run(run()).connections == 2


def test_an_answer_sent_to_an_idle_connection_never_answers_the_next_request() -> None:
    """An engine writes a whole response on a pooled connection that carries no request:
    the router drops that connection, and its next request gets its own answer, not the
    one that was waiting."""
    smuggled = b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nsmuggled"

    async def run() -> tuple[bytes, Engine]:
        pool = Pool()
        async with engine() as a:
            assert await ask(pool, a, "k") == b"ok"
            (conn,) = pool._idle[a.key]
            _, writer = a.serving[0]
            writer.write(smuggled)
            await wait_for(lambda: conn.closed, 10, "the router drops the connection")
            second = await ask(pool, a, "k")
        pool.close()
        return second, a

    second, a = asyncio.run(run())
    assert second == b"ok"
    assert a.connections == 2


MALFORMED = b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n"


@pytest.mark.parametrize("kept_alive", [False, True], ids=["fresh", "kept alive"])
def test_a_connection_that_answered_malformed_bytes_is_not_sent_the_request_again(
    kept_alive: bool,
) -> None:
    """Only a kept-alive connection the engine closed before any byte of the answer is
    retried: a new one that fails, or any that answered bytes that frame nothing, means
    the engine had the request, and a second send would run it twice."""
    answers = iter([OK, MALFORMED, OK] if kept_alive else [MALFORMED, OK])

    async def run() -> Engine:
        pool = Pool()
        async with engine(lambda _head: next(answers)) as a:
            if kept_alive:
                assert await ask(pool, a, "k") == b"ok"  # its connection is kept
            with pytest.raises(UpstreamError, match="malformed"):
                await ask(pool, a, "k")
        pool.close()
        return a

    a = asyncio.run(run())
    assert len(a.heads) == 1 + kept_alive
    assert a.connections == 1


def test_a_request_cancelled_before_its_answer_closes_its_connection() -> None:
    """The caller gives up (the client left, a deadline) while the engine is still working
    on the request: the connection is closed, so the engine sees the client go and frees
    the request, and it never returns to the pool."""

    async def run() -> tuple[Pool, Engine]:
        pool = Pool()
        async with engine(lambda _head: b"") as a:  # an engine that never answers
            task = asyncio.ensure_future(ask(pool, a, "k"))
            await wait_for(lambda: bool(a.heads), 10, "the engine gets the request")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            async with asyncio.timeout(10):  # the engine's read ends: the router closed it
                await asyncio.gather(*(t for t, _ in a.serving))
        pool.close()
        return pool, a

    pool, a = asyncio.run(run())
    assert not any(pool._idle.values())
    assert a.connections == 1


def test_closing_a_response_twice_pools_its_connection_once() -> None:
    """A second close is a no-op: it neither pools the connection again nor closes it
    under the pool, and the next request is carried on it."""

    async def run() -> tuple[int, Engine]:
        pool = Pool()
        async with engine() as a:
            head = request_head("/v1/x", "h", 2, [("Authorization", "Bearer k")])
            response = await pool.request(a.key, head, b"{}", connect_timeout=5.0)
            assert await response.read() == b"ok"
            response.close()
            response.close()
            kept = len(pool._idle[a.key])
            assert await ask(pool, a, "k") == b"ok"
        pool.close()
        return kept, a

    kept, a = asyncio.run(run())
    assert kept == 1
    assert a.connections == 1


def test_a_response_closed_before_its_end_closes_its_connection() -> None:
    """The relay stops reading a stream midway (the client left): the engine sees its
    connection close, so it stops generating, and the connection is not pooled."""
    partial = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"

    async def run() -> tuple[Pool, Engine]:
        pool = Pool()
        async with engine(lambda _head: partial) as a:
            head = request_head("/v1/x", "h", 2, [("Authorization", "Bearer k")])
            response = await pool.request(a.key, head, b"{}", connect_timeout=5.0)
            async with asyncio.timeout(10):
                assert await response.read_any() == b"hello"
            response.close()
            async with asyncio.timeout(10):  # the engine's read ends: the router closed it
                await asyncio.gather(*(t for t, _ in a.serving))
        pool.close()
        return pool, a

    pool, _ = asyncio.run(run())
    assert not any(pool._idle.values())


def test_closing_the_pool_closes_its_idle_connections() -> None:
    async def run() -> _Conn:
        pool = Pool()
        async with engine() as a:
            assert await ask(pool, a, "k") == b"ok"
            (conn,) = pool._idle[a.key]
            pool.close()
            async with asyncio.timeout(10):  # the engine's read ends: the router closed it
                await asyncio.gather(*(t for t, _ in a.serving))
        return conn

    assert asyncio.run(run()).closed

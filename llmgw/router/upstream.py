"""A small HTTP/1.1 client for the router's hot path: engines, keep-alive, streamed bodies.

The router sends one kind of request — a POST of a JSON body — and relays the
answer, often a chunked SSE stream. A general client (aiohttp's) spends more
Python per request on features the router never uses (cookies, redirects, URL
objects, payload registries, tracing) than the router spends routing, so this
module does just the needed part on asyncio protocols: a per-host pool of
kept-alive connections, the request written in one send, and the response framed
by the sans-I/O parser of `llmgw.router.http1` (head, then the body decoded from
Content-Length, chunked or until close) into bytes the relay reads as they arrive.
TCP_NODELAY is set on every connection.

A response that ends early raises `UpstreamError`; closing a response that is
not complete aborts its connection, so the engine sees the client leave and
frees the request's KV blocks. Used by `llmgw.router.dispatch`; health and metrics
probes use aiohttp (not hot).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Callable
from typing import cast

from llmgw.core import redaction
from llmgw.router import http1

MAX_HEAD = http1.MAX_HEAD
HIGH_WATER = 1024 * 1024
"""Body bytes buffered before reading from the engine pauses (a slow client)."""


class UpstreamError(Exception):
    """The connection to the engine failed or the response was malformed or cut."""


class ConnectError(UpstreamError):
    """No connection could be opened."""


class ConnectTimeout(UpstreamError):
    """Opening a connection took longer than the connect deadline."""


class _Conn(asyncio.Protocol):
    """One connection; carries one response at a time, framed by `http1.ResponseParser`."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_error",
        "_headers_waiter",
        "_keep_alive",
        "_parser",
        "_paused",
        "_waiter",
        "closed",
        "content_type",
        "done",
        "engine_key",
        "expecting",
        "heard",
        "key",
        "loop",
        "sink",
        "status",
        "transport",
    )  # fmt: skip

    parser_class: type[http1.PyParser | http1.LlhttpParser] = http1.ResponseParser
    """The framing; a benchmark swaps it to compare the implementations."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.expecting = False
        self.key: tuple[str, int, bool] = ("", 0, False)
        self.engine_key = ""
        """The key the request now carried presents: what the engine wrote is quoted
        without it."""
        self._parser = self.parser_class(max_head=MAX_HEAD)
        self._reset()

    def _reset(self) -> None:
        self.sink: Callable[[bytes], None] | None = None
        """Takes body bytes as they arrive, in the protocol callback, instead of `read_any`."""
        self.status = 0
        self.heard = False
        """Bytes of an answer to this request came (framed or not): the engine has it."""
        self.content_type = ""
        self.done = False
        self._headers_waiter: asyncio.Future[None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._error: BaseException | None = None
        self._parser.reset()
        self._keep_alive = True
        self._paused = False

    # ------------------------------------------------------------------ protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):  # not TCP (a Unix socket): nothing to do
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.done:
            try:
                self._parser.feed_eof()
            except http1.ProtocolError:
                self._fail(UpstreamError(f"engine closed the connection: {exc!r}" if exc else
                                         "engine closed the connection"))  # fmt: skip
            else:
                self.done = True  # a body delimited by the close is complete now
        self._wake()

    def data_received(self, data: bytes) -> None:
        if self.done:
            # Bytes after a complete response: nothing was asked; never relay them.
            self._keep_alive = False
            self._abort()
            return
        if not self.status and not self.expecting:
            # Bytes on an idle kept-alive connection answer nothing we asked: the
            # connection can no longer be trusted to frame the next response.
            self._abort()
            return
        self.heard = True
        try:
            events = self._parser.feed(data)
        except http1.ProtocolError as exc:
            # The parser quotes what it could not frame: the engine's bytes, which may
            # echo the request's Authorization header.
            quoted = redaction.without_key(str(exc), self.engine_key)
            self._fail(UpstreamError(f"engine sent a malformed response: {quoted}"))
            self._abort()
            return
        # At most a head, the body bytes of this read, and the end, in that order.
        for ev in events:
            if type(ev) is bytes:
                if type(events[-1]) is http1.End:
                    # Complete before the last bytes are pushed: a sink sees that they are
                    # the last (and can end its own response with them).
                    self.done = True
                self._push(ev)
            elif type(ev) is http1.Head:
                self.status = ev.status
                self.content_type = ev.content_type
                self._keep_alive = ev.keep_alive
            else:
                self._keep_alive = cast(http1.End, ev).keep_alive
                self.done = True
        self._wake()

    def eof_received(self) -> bool | None:
        return None

    # ------------------------------------------------------------------ the body

    def _push(self, data: bytes) -> None:
        if not data:
            return
        if self.sink is not None and not self._chunks:
            self.sink(data)
            return
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def _fail(self, exc: BaseException) -> None:
        if self._error is None and not self.done:
            self._error = exc
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if (
            w is not None
            and not w.done()
            and (
                # While a sink takes the body, its reader waits only for the end (or a failure).
                self.sink is None or self.done or self._chunks or self._error is not None
            )
        ):
            w.set_result(None)
        h = self._headers_waiter
        if h is not None and not h.done() and (self.status >= 200 or self._error is not None
                                                or self.closed):  # fmt: skip
            h.set_result(None)

    def _abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    # ------------------------------------------------------------------ the caller's side

    async def wait_head(self) -> None:
        while self.status < 200:
            if self._error is not None:
                raise self._error
            if self.closed:
                raise UpstreamError("engine closed the connection before answering")
            fut = self.loop.create_future()
            self._headers_waiter = fut
            try:
                await fut
            finally:
                self._headers_waiter = None

    def take_pending(self) -> bytes:
        """The body bytes received and not yet read (b"" if none), without waiting."""
        chunks = self._chunks
        if not chunks:
            return b""
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        self._buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    async def read_any(self) -> bytes:
        """Body bytes received so far (waiting for some); b"" once the body is complete."""
        while True:
            if self._chunks:
                return self.take_pending()
            if self.done:
                return b""
            if self._error is not None:
                raise self._error
            await self._park()

    async def wait_end(self) -> None:
        """Wait while a sink takes the body: until it is complete, or the sink is gone and
        bytes wait for `read_any` (raises what broke the body)."""
        while self.sink is not None and not self.done and not self._chunks:
            if self._error is not None:
                raise self._error
            await self._park()
        if self._error is not None and not self._chunks:
            raise self._error

    async def _park(self) -> None:
        """Wait for `_wake` (body bytes, its end, a failure, or the sink gone)."""
        fut = self.loop.create_future()
        self._waiter = fut
        try:
            await fut
        finally:
            self._waiter = None

    def at_eof(self) -> bool:
        return self.done and not self._chunks

    @property
    def reusable(self) -> bool:
        return self.done and self._keep_alive and not self.closed and self._error is None


class Response:
    """An engine's answer: status, content type and the body as it arrives."""

    __slots__ = ("_conn", "_pool", "_released", "status")

    def __init__(self, conn: _Conn, pool: Pool) -> None:
        self._conn = conn
        self._pool = pool
        self._released = False
        self.status = conn.status

    @property
    def content_type(self) -> str:
        return self._conn.content_type

    async def read_any(self) -> bytes:
        return await self._conn.read_any()

    def take_pending(self) -> bytes:
        """Body bytes that came before a sink was set (b"" if none): the sink's to take."""
        return self._conn.take_pending()

    def relay_to(self, sink: Callable[[bytes], None] | None) -> None:
        """Hand body bytes to `sink` as they arrive (None: back to `read_any`).

        The sink runs in the connection's data callback: it must not raise or block. It
        may call `relay_to(None)` itself (a slow client), after which bytes wait for
        `read_any` again."""
        self._conn.sink = sink
        if sink is None:
            self._conn._wake()

    async def wait_end(self) -> None:
        await self._conn.wait_end()

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body (or its first `limit` bytes; the rest is dropped with the connection)."""
        parts: list[bytes] = []
        size = 0
        while True:
            data = await self._conn.read_any()
            if not data:
                break
            parts.append(data)
            size += len(data)
            if limit is not None and size >= limit:
                break
        return b"".join(parts)

    def at_eof(self) -> bool:
        """The body is complete and every byte of it was read (or given to the sink)."""
        return self._conn.at_eof()

    def close(self) -> None:
        """Give the connection back when the body is complete, else abort it."""
        if self._released:
            return
        self._released = True
        conn = self._conn
        if conn.reusable:
            self._pool._give_back(conn)
        else:
            conn._abort()


class Pool:
    """Kept-alive connections per (host, port, tls)."""

    def __init__(self, *, max_idle_per_host: int = 1024) -> None:
        self.max_idle = max_idle_per_host
        self._idle: dict[tuple[str, int, bool], list[_Conn]] = {}
        self._ssl: ssl.SSLContext | None = None

    def close(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                c._abort()
        self._idle.clear()

    def _give_back(self, conn: _Conn) -> None:
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) >= self.max_idle:
            conn._abort()
            return
        conn._reset()
        conn.expecting = False
        idle.append(conn)

    async def _connect(self, key: tuple[str, int, bool], within: float) -> _Conn:
        loop = asyncio.get_running_loop()
        host, port, tls = key
        if tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            async with asyncio.timeout(within):
                _, conn = await loop.create_connection(
                    lambda: _Conn(loop), host, port, ssl=self._ssl if tls else None
                )
        except TimeoutError:
            raise ConnectTimeout(
                f"engine at {host}:{port} did not accept a connection within {within} s"
            ) from None
        except OSError as exc:
            raise ConnectError(f"cannot connect to the engine at {host}:{port}: {exc}") from None
        conn.key = key
        return conn

    async def request(
        self,
        key: tuple[str, int, bool],
        head: bytes,
        body: bytes,
        *,
        connect_timeout: float,
        engine_key: str = "",
    ) -> Response:
        """Send one request and wait for the response head.

        A kept-alive connection the engine closed meanwhile fails before any byte of the
        answer; the request is then sent once more on a fresh connection. One that
        answered anything, even bytes that frame nothing, had the request: sent again, it
        would run twice. `engine_key`,
        the key `head` presents, is taken out of the errors that quote the engine's bytes.
        """
        idle = self._idle.get(key)
        conn: _Conn | None = None
        while idle:
            c = idle.pop()
            if not c.closed and c.transport is not None and not c.transport.is_closing():
                conn = c
                break
        for attempt in (0, 1):
            fresh = conn is None
            if conn is None:
                conn = await self._connect(key, connect_timeout)
            assert conn.transport is not None
            conn.engine_key = engine_key
            conn.expecting = True
            conn.transport.write(head + body)
            try:
                await conn.wait_head()
            except UpstreamError:
                conn._abort()
                if fresh or attempt == 1 or conn.heard:
                    raise
                conn = None  # a stale kept-alive connection: once more, on a new one
                continue
            except BaseException:
                conn._abort()
                raise
            return Response(conn, self)
        raise AssertionError("unreachable")  # pragma: no cover


def request_head(path: str, host_header: str, length: int, extra: list[tuple[str, str]]) -> bytes:
    """The request line and headers of a JSON POST, ready to send."""
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {host_header}",
        "Content-Type: application/json",
        f"Content-Length: {length}",
    ]
    lines.extend(f"{k}: {v}" for k, v in extra)
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def parse_base(url: str) -> tuple[tuple[str, int, bool], str, str]:
    """(host, port, tls), Host header and path prefix of an engine's base URL."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    tls = parts.scheme == "https"
    host = parts.hostname or "127.0.0.1"
    port = parts.port or (443 if tls else 80)
    host_header = parts.netloc.rpartition("@")[2]
    return (host, port, tls), host_header, parts.path.rstrip("/")

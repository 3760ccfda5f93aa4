"""The router's engine connection (llmgw.router.upstream), fed arbitrary segmentations."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.redaction import FRAGMENT, KEY_MARK
from llmgw.router import http1
from llmgw.router.upstream import (
    HIGH_WATER,
    Pool,
    Response,
    UpstreamError,
    _Conn,
    parse_base,
    request_head,
)


@pytest.fixture(
    scope="module",
    autouse=True,
    params=[http1.LlhttpParser, http1.PyParser],
    ids=["llhttp", "python"],
)
def parser_class(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test here runs on the parser the router uses and on its fallback."""
    old = _Conn.parser_class
    _Conn.parser_class = request.param
    yield
    _Conn.parser_class = old


class FakeTransport:
    def __init__(self) -> None:
        self.aborted = False
        self.paused = False

    def abort(self) -> None:
        self.aborted = True

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def is_closing(self) -> bool:
        return self.aborted

    def get_extra_info(self, name: str) -> None:
        return None


LOOP = asyncio.new_event_loop()  # futures need a loop; parsing never runs it


def conn() -> _Conn:
    c = _Conn(LOOP)
    c.connection_made(FakeTransport())  # type: ignore[arg-type]
    c.expecting = True
    return c


def feed(c: _Conn, data: bytes, cuts: list[int]) -> bytes:
    """Feed `data` split at `cuts`, collecting the decoded body."""
    out = b""
    points = sorted({min(x, len(data)) for x in cuts} | {0, len(data)})
    for a, b in itertools.pairwise(points):
        c.data_received(data[a:b])
        out += b"".join(c._chunks)
        c._chunks = []
    return out


def chunked(parts: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts if p) + b"0\r\n\r\n"


@given(
    parts=st.lists(st.binary(max_size=40), max_size=8),
    cuts=st.lists(st.integers(0, 600), max_size=12),
    interim=st.booleans(),
)
def test_chunked_bodies_decode_whatever_the_segmentation(
    parts: list[bytes], cuts: list[int], interim: bool
) -> None:
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    if interim:
        head = b"HTTP/1.1 100 Continue\r\n\r\n" + head
    c = conn()
    body = feed(c, head + chunked(parts), cuts)
    assert c.status == 200
    assert c.content_type == "text/event-stream"
    assert body == b"".join(parts)
    assert c.done
    assert c.reusable


@given(body=st.binary(max_size=200), cuts=st.lists(st.integers(0, 300), max_size=8))
def test_content_length_bodies(body: bytes, cuts: list[int]) -> None:
    c = conn()
    data = b"HTTP/1.1 429 Too Many\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    assert feed(c, data, cuts) == body
    assert c.status == 429
    assert c.done


@given(
    parts=st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=8),
    cuts=st.lists(st.integers(0, 600), max_size=12),
    framing=st.sampled_from(["chunked", "content-length"]),
)
def test_a_sink_gets_every_byte_and_knows_the_last(
    parts: list[bytes], cuts: list[int], framing: str
) -> None:
    """The relay's sink takes body bytes in the data callback, and ends its own response
    with the last ones when the body's end came in the same read: then the body must
    already read as complete when the sink gets them."""
    body = b"".join(parts)
    if framing == "chunked":
        data = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(parts)
    else:
        data = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    c = conn()
    got: list[tuple[bytes, bool]] = []
    c.sink = lambda b: got.append((b, c.at_eof()))
    points = sorted({min(x, len(data)) for x in cuts} | {0, len(data)})
    for a, b in itertools.pairwise(points):
        before = len(got)
        c.data_received(data[a:b])
        if c.done:
            if len(got) > before:  # the last bytes and the end came in this read
                assert got[-1][1]
            break
    assert c.done
    assert not c._chunks  # nothing left for read_any
    assert b"".join(b for b, _ in got) == body
    assert not any(end for _, end in got[:-1])


def test_close_delimited_body_and_connection_close() -> None:
    c = conn()
    assert feed(c, b"HTTP/1.0 200 OK\r\n\r\nabc", []) == b"abc"
    assert not c.done
    c.connection_lost(None)
    assert c.done
    assert not c.reusable


def test_a_cut_stream_is_an_error_not_an_end() -> None:
    c = conn()
    feed(c, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel", [])
    c.connection_lost(ConnectionResetError())
    assert not c.done
    assert isinstance(c._error, UpstreamError)


def test_malformed_heads_fail_cleanly() -> None:
    for data in (b"garbage\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
                 b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"):  # fmt: skip
        c = conn()
        c.data_received(data)
        assert c._error is not None
        assert c.transport.aborted  # type: ignore[union-attr]


KEY = b"eK3y-Zq4_8xR2pL0vT9mW1nB6cY5dF7gH3jK0sA2uQ"
CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(
    "data",
    [
        b"Bearer " + KEY + b" 200 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nAuthorization Bearer " + KEY + b"\r\n\r\n",
        CHUNKED + b"Bearer " + KEY + b"\r\n",  # quoted 40 bytes long: the key cut short
        CHUNKED + b"2\r\nok\r\n0\r\nAuthorization Bearer " + KEY + b"\r\n\r\n",
    ],
    ids=["status line", "header line", "chunk size", "trailer"],
)
def test_what_a_malformed_answer_quotes_is_without_the_engines_key(data: bytes) -> None:
    """The Python parser quotes the line it could not frame; an engine that echoes the
    request's Authorization header there would show its key to the client (the error is
    the attempt's message) and the log. Before: the key, or its first 33 characters."""
    c = conn()
    c.engine_key = KEY.decode()
    c.data_received(data)
    said = str(c._error)
    assert said.startswith("engine sent a malformed response")
    assert KEY[:FRAGMENT].decode() not in said
    if "line b'" in said:  # the Python parser's (llhttp quotes nothing)
        assert KEY_MARK in said


def test_request_head_and_base_parsing() -> None:
    key, host, prefix = parse_base("https://engine.example:8443/prefix/")
    assert key == ("engine.example", 8443, True)
    assert host == "engine.example:8443"
    assert prefix == "/prefix"
    assert parse_base("http://10.0.0.1")[0] == ("10.0.0.1", 80, False)
    assert parse_base("https://engine.example")[0] == ("engine.example", 443, True)
    head = request_head("/v1/chat/completions", "h:1", 12, [("X-Request-Id", "r1")])
    assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\nHost: h:1\r\n")
    assert b"Content-Length: 12\r\n" in head
    assert b"\r\nContent-Type: application/json\r\n" in head
    assert head.endswith(b"X-Request-Id: r1\r\n\r\n")


def test_bytes_on_an_idle_connection_abort_it() -> None:
    c = conn()
    c.expecting = False
    c.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    assert c.closed
    assert c.status == 0


def test_bytes_after_a_complete_response_are_not_relayed() -> None:
    c = conn()
    body = feed(c, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", [])
    c.data_received(b"HTTP/1.1 200 OK\r\n\r\nsmuggled")
    assert body == b"ok"
    assert c._chunks == []
    assert not c.reusable


def test_extra_bytes_in_the_last_segment_make_the_connection_unusable() -> None:
    c = conn()
    c.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA")
    assert c._chunks == [b"ok"]
    assert not c.reusable
    c2 = conn()
    c2.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\nX")
    assert c2._chunks == [b"ok"]
    assert c2.done
    assert not c2.reusable


def test_reading_from_the_engine_pauses_while_a_megabyte_waits_unread() -> None:
    """A client slower than its engine: past `HIGH_WATER` bytes received and not read, the
    connection stops reading (the engine's writes back up, not the router's memory), and
    reads again once they are taken, counting afresh."""
    c = conn()
    piece = b"x" * (HIGH_WATER // 2 + 1)
    c.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (4 * len(piece)))
    transport = c.transport
    assert isinstance(transport, FakeTransport)
    c.data_received(piece)
    assert not transport.paused
    c.data_received(piece)
    assert transport.paused
    assert c.take_pending() == piece * 2
    assert not transport.paused
    c.data_received(piece)
    assert not transport.paused  # what was taken no longer counts
    c.data_received(piece)
    assert transport.paused
    assert c.take_pending() == piece * 2
    assert c.done


def test_bytes_waiting_when_a_sink_is_set_stay_ahead_of_later_ones() -> None:
    """Body bytes that came before the relay set its sink wait for it to take them
    (`take_pending`); bytes after them join them, so the stream keeps its order."""
    c = conn()
    c.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
    got: list[bytes] = []
    c.sink = got.append
    c.data_received(b"6\r\nsecond\r\n")
    assert got == []
    assert c.take_pending() == b"firstsecond"
    c.data_received(b"5\r\nthird\r\n0\r\n\r\n")
    assert got == [b"third"]


@pytest.mark.parametrize("sink", [True, False], ids=["sink", "read_any"])
def test_a_stream_cut_while_waited_on_raises_in_its_reader(sink: bool) -> None:
    """The engine's connection drops mid-body while the relay waits (for the end while a
    sink takes the body, or for bytes): the wait ends with the error, never hangs."""

    async def run() -> BaseException | None:
        c = _Conn(asyncio.get_running_loop())
        c.connection_made(FakeTransport())  # type: ignore[arg-type]
        c.expecting = True
        c.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        if sink:
            c.sink = lambda _data: None
        c.data_received(b"5\r\nhello\r\n")
        if not sink:
            assert await c.read_any() == b"hello"
        waiting = asyncio.ensure_future(c.wait_end() if sink else c.read_any())
        await asyncio.sleep(0)
        c.connection_lost(ConnectionResetError())
        async with asyncio.timeout(10):
            try:
                await waiting
            except UpstreamError as exc:
                return exc
        return None

    assert isinstance(asyncio.run(run()), UpstreamError)


def test_waiting_for_the_end_of_a_failed_body_raises_its_error() -> None:
    """The body failed before the relay waits for its end (no sink, nothing unread)."""

    async def run() -> None:
        c = _Conn(asyncio.get_running_loop())
        c.connection_made(FakeTransport())  # type: ignore[arg-type]
        c.expecting = True
        c.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\npart")
        assert c.take_pending() == b"part"
        c.connection_lost(None)
        with pytest.raises(UpstreamError):
            async with asyncio.timeout(10):
                await c.wait_end()

    asyncio.run(run())


def test_a_read_up_to_a_limit_returns_once_it_has_that_much() -> None:
    """`read(limit)` with `limit` bytes in hand returns them, without waiting for more of a
    body that is not complete (the engine may send the rest slowly, or never)."""

    async def run() -> bytes:
        c = _Conn(asyncio.get_running_loop())
        c.connection_made(FakeTransport())  # type: ignore[arg-type]
        c.expecting = True
        c.data_received(b"HTTP/1.1 500 Oops\r\nContent-Length: 100\r\n\r\nabcd")
        async with asyncio.timeout(10):
            return await Response(c, Pool()).read(4)

    assert asyncio.run(run()) == b"abcd"


def test_a_body_ended_by_the_close_wakes_its_reader_at_the_close() -> None:
    async def run() -> bytes:
        c = _Conn(asyncio.get_running_loop())
        c.connection_made(FakeTransport())  # type: ignore[arg-type]
        c.expecting = True
        c.data_received(b"HTTP/1.0 200 OK\r\n\r\nabc")
        assert await c.read_any() == b"abc"
        waiting = asyncio.ensure_future(c.read_any())
        await asyncio.sleep(0)
        c.connection_lost(None)
        async with asyncio.timeout(10):
            return await waiting

    assert asyncio.run(run()) == b""


def test_a_response_is_at_its_end_only_once_every_byte_was_read() -> None:
    c = conn()
    c.data_received(b"HTTP/1.1 429 Too Many\r\nContent-Length: 2\r\n\r\nno")
    response = Response(c, Pool())
    assert response.status == 429
    assert not response.at_eof()  # complete, but "no" is still unread
    assert response.take_pending() == b"no"
    assert response.at_eof()

"""llmgw.bus.natspy's FrameParser against nats-py's own parser: the same protocol streams,
cut at the same random points, must give the same deliveries, pings, pongs and infos in
the same order, and the same errors on what is not NATS."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nats.errors import ProtocolError
from nats.protocol.parser import Parser

from llmgw.bus.natspy import FrameParser

FAST_SIDS = (1, 3)


class Recorder:
    """What a client sees of its parser: deliveries (fast or not), pings, pongs, infos."""

    def __init__(self) -> None:
        self.seen: list[tuple[Any, ...]] = []
        self.stats = {"in_msgs": 0, "in_bytes": 0}
        self._fast = {sid: self._handler(sid) for sid in FAST_SIDS}

    def _handler(self, sid: int) -> Any:
        def handle(subject: bytes, reply: bytes, data: bytes, headers: bytes) -> None:
            if data == b"boom":
                raise RuntimeError("a handler bug")
            self.seen.append(("msg", sid, subject, reply, data, headers))

        return handle

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
    ) -> None:
        # What BusClient._process_msg does for the stock parser's deliveries.
        handler = self._fast.get(sid)
        if handler is not None:
            self.stats["in_msgs"] += 1
            self.stats["in_bytes"] += len(data)
            with contextlib.suppress(RuntimeError):
                handler(subject, reply, data, headers or b"")
            return
        self.seen.append(("msg", sid, subject, reply, data, headers or b""))

    async def _process_ping(self) -> None:
        self.seen.append(("ping",))

    async def _process_pong(self) -> None:
        self.seen.append(("pong",))

    async def _process_info(self, info: dict[str, Any]) -> None:
        self.seen.append(("info", info))

    async def _process_err(self, err: str) -> None:
        self.seen.append(("err", err))


token = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789.$_-", min_size=1, max_size=12)
body = st.binary(max_size=60).map(lambda b: b.replace(b"boom", b"b00m"))


@st.composite
def frame(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["msg", "hmsg", "hmsg", "ping", "pong", "ok", "info", "boom"]))
    if kind == "ping":
        return b"PING\r\n"
    if kind == "pong":
        return b"PONG\r\n"
    if kind == "ok":
        return b"+OK\r\n"
    if kind == "info":
        return b'INFO {"server_id":"x","max_payload":1048576}\r\n'
    subject = draw(token).encode()
    sid = draw(st.integers(min_value=1, max_value=4))
    reply = draw(st.one_of(st.just(""), token)).encode()
    payload = b"boom" if kind == "boom" else draw(body)
    reply_part = b" " + reply if reply else b""
    if kind == "msg":
        return b"MSG %s %d%s %d\r\n%s\r\n" % (subject, sid, reply_part, len(payload), payload)
    # The server sends HMSG only with a header block, at least its status line (nats-py's
    # own pattern misreads an HMSG without one: its `\s+` runs across the line's end).
    lines = b""
    if draw(st.booleans()):
        lines = b"".join(b"%s: %s\r\n" % (draw(token).encode(), draw(token).encode()) for _ in "ab")
    headers = b"NATS/1.0\r\n" + lines + b"\r\n"
    total = len(headers) + len(payload)
    return b"HMSG %s %d%s %d %d\r\n%s%s\r\n" % (
        subject,
        sid,
        reply_part,
        len(headers),
        total,
        headers,
        payload,
    )


def feed(parser_type: type[Parser], stream: bytes, cuts: list[int]) -> tuple[list[Any], str]:
    nc = Recorder()
    parser = parser_type(nc)
    points = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    error = ""

    async def run() -> None:
        for a, b in itertools.pairwise(points):
            await parser.parse(stream[a:b])

    try:
        asyncio.run(run())
    except ProtocolError as exc:
        error = type(exc).__name__
    return nc.seen, error


@settings(max_examples=300, deadline=None)
@given(frames=st.lists(frame(), max_size=25), cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_frames_parse_as_nats_py_parses_them(frames: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(frames)
    assert feed(FrameParser, stream, cuts) == feed(Parser, stream, cuts)


@settings(max_examples=200, deadline=None)
@given(
    frames=st.lists(frame(), max_size=6),
    junk=st.binary(min_size=1, max_size=40),
    cuts=st.lists(st.integers(0, 10_000), max_size=6),
)
def test_garbage_after_frames_is_what_nats_py_makes_of_it(
    frames: list[bytes], junk: bytes, cuts: list[int]
) -> None:
    stream = b"".join(frames) + junk + b"\r\n"
    assert feed(FrameParser, stream, cuts) == feed(Parser, stream, cuts)


def test_a_handler_that_raises_costs_only_its_message() -> None:
    stream = b"MSG a 1 4\r\nboom\r\nMSG b 1 2\r\nok\r\n"
    seen, error = feed(FrameParser, stream, [])
    assert error == ""
    assert seen == [("msg", 1, b"b", b"", b"ok", b"")]


def test_a_frame_cut_anywhere_is_delivered_once() -> None:
    frame_ = b"HMSG sub 1 rep 12 15\r\nNATS/1.0\r\n\r\nabc\r\n"
    for cut in range(1, len(frame_)):
        seen, _ = feed(FrameParser, frame_ * 2, [cut, len(frame_) + cut])
        assert seen == [("msg", 1, b"sub", b"rep", b"abc", b"NATS/1.0\r\n\r\n")] * 2, cut


@pytest.mark.parametrize("bad", [b"MSG a x 3\r\nabc\r\n", b"HMSG a 1 9 3\r\nabc\r\n"])
def test_malformed_frames_are_protocol_errors_as_before(bad: bytes) -> None:
    assert feed(FrameParser, bad, []) == feed(Parser, bad, [])

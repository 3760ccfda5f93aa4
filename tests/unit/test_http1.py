"""The sans-I/O HTTP/1.1 response parser (llmgw.router.http1), both implementations.

Every property runs against llhttp's (`LlhttpParser`, the one the router uses) and the
plain-Python fallback (`PyParser`): a valid response split into any sequence of reads
gives the same events; anything else fails with `ProtocolError` and nothing else.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.router import http1
from llmgw.router.http1 import End, Head, LlhttpParser, ProtocolError, PyParser

Parser = type[PyParser] | type[LlhttpParser]
IMPLS = pytest.mark.parametrize("impl", [PyParser, LlhttpParser], ids=["python", "llhttp"])

TOKEN = st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-", min_size=1,
                max_size=12)  # fmt: skip
VALUE = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=20).map(str.encode)
FRAMED = {b"content-length", b"transfer-encoding", b"connection", b"content-type"}


@dataclass
class Spec:
    """A response, its bytes, and the events the parser must give for them."""

    data: bytes
    head: Head
    body: bytes
    keep_alive: bool
    close_delimited: bool
    head_request: bool


@st.composite
def responses(draw: st.DrawFn) -> Spec:
    framing = draw(st.sampled_from(["length", "chunked", "close", "bodiless", "head"]))
    if framing == "bodiless":
        status = draw(st.sampled_from([204, 304]))
    else:
        status = draw(st.sampled_from([200, 201, 400, 404, 429, 500, 503]))
    http11 = draw(st.booleans())
    connection = draw(st.sampled_from([None, b"close", b"keep-alive", b"Keep-Alive", b"Close",
                                       b"TE, close", b"keep-alive, Upgrade"]))  # fmt: skip
    reason = draw(st.sampled_from([b"", b"OK", b"Too Many Requests", b"x"]))
    headers: list[tuple[bytes, bytes]] = [
        (name.encode(), value)
        for name, value in draw(st.lists(st.tuples(TOKEN, VALUE), max_size=4))
        if name.lower().encode() not in FRAMED
    ]
    content_type = draw(st.sampled_from([None, b"text/event-stream", b"application/json"]))
    if content_type is not None:
        params = draw(st.sampled_from([b"", b"; charset=utf-8"]))
        headers.insert(draw(st.integers(0, len(headers))), (b"Content-Type", content_type + params))
    if connection is not None:
        headers.insert(draw(st.integers(0, len(headers))), (b"Connection", connection))
    body = b"" if framing == "bodiless" else draw(st.binary(max_size=300))
    payload = body
    if framing in ("length", "head"):
        headers.append((draw(st.sampled_from([b"Content-Length", b"content-length"])),
                        b"%d" % len(body)))  # fmt: skip
        if framing == "head":
            payload = b""
    elif framing == "chunked":
        headers.append((b"Transfer-Encoding", b"chunked"))
        payload = draw(chunked_encodings(body))
    tokens = (connection or b"").lower().replace(b" ", b"").split(b",")
    if http11:
        keep_alive = b"close" not in tokens
    else:
        keep_alive = b"keep-alive" in tokens and b"close" not in tokens
    if framing == "close":
        keep_alive = False
    interim = b"".join(
        draw(st.lists(st.sampled_from([b"HTTP/1.1 100 Continue\r\n\r\n",
                                       b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"]),
                      max_size=2))
    )  # fmt: skip
    status_line = b"HTTP/1.%d %d" % (http11, status) + (b" " + reason if reason else b"")
    head_bytes = status_line + b"\r\n" + b"".join(b"%s: %s\r\n" % h for h in headers) + b"\r\n"
    head = Head(status, reason, headers, keep_alive,
                (content_type or b"").decode())  # fmt: skip
    return Spec(interim + head_bytes + payload, head, body, keep_alive, framing == "close",
                framing == "head")  # fmt: skip


@st.composite
def chunked_encodings(draw: st.DrawFn, body: bytes) -> bytes:
    """`body` as chunks of any sizes, with chunk extensions and trailers now and then."""
    cuts = sorted(set(draw(st.lists(st.integers(0, len(body)), max_size=6))))
    out = []
    for a, b in itertools.pairwise([0, *cuts, len(body)]):
        if a == b:
            continue
        ext = draw(st.sampled_from([b"", b";x", b";name=value", b';q="quoted"']))
        size = draw(st.sampled_from([b"%x", b"%X", b"0%x"])) % (b - a)
        out.append(size + ext + b"\r\n" + body[a:b] + b"\r\n")
    out.append(b"0" + draw(st.sampled_from([b"", b";last"])) + b"\r\n")
    for name, value in draw(st.lists(st.tuples(TOKEN, VALUE), max_size=2)):
        out.append(b"%s: %s\r\n" % (name.encode(), value))
    out.append(b"\r\n")
    return b"".join(out)


def splits(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(x, len(data)) for x in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


def run(p: PyParser | LlhttpParser, reads: list[bytes]) -> list[http1.Event]:
    """Feed `reads`, checking what each feed may give: a head, one body bytes, an end."""
    events: list[http1.Event] = []
    for r in reads:
        got = p.feed(r)
        kinds = [type(e) for e in got]
        assert kinds in ([], [Head], [bytes], [End], [Head, bytes], [Head, End], [bytes, End],
                         [Head, bytes, End])  # fmt: skip
        assert all(e for e in got if type(e) is bytes)  # never an empty body event
        events.extend(got)
    return events


def merged(events: list[http1.Event]) -> list[http1.Event]:
    """Events with the body bytes joined: the same whatever the reads."""
    out: list[http1.Event] = []
    for e in events:
        if type(e) is bytes and out and type(out[-1]) is bytes:
            out[-1] = out[-1] + e
        else:
            out.append(e)
    return out


def expected(spec: Spec) -> list[http1.Event]:
    return (
        [spec.head]
        + ([spec.body] if spec.body and not spec.head_request else [])
        + [End(spec.keep_alive)]
    )


@IMPLS
@settings(max_examples=300)
@given(spec=responses(), cuts=st.lists(st.integers(0, 2000), max_size=16))
def test_any_split_of_a_valid_response_gives_the_same_events(
    impl: Parser, spec: Spec, cuts: list[int]
) -> None:
    p = impl(head_request=spec.head_request)
    events = run(p, splits(spec.data, cuts))
    if spec.close_delimited:
        assert not p.ended
        events += p.feed_eof()
    assert merged(events) == expected(spec)
    assert p.ended


@IMPLS
@given(spec=responses(), cuts=st.lists(st.integers(0, 2000), max_size=8))
def test_a_response_cut_short_is_an_error_at_the_close(
    impl: Parser, spec: Spec, cuts: list[int]
) -> None:
    if spec.close_delimited:
        return  # any prefix of its body is a whole body
    cut = spec.data[: len(spec.data) - 1]
    p = impl(head_request=spec.head_request)
    run(p, splits(cut, cuts))
    assert not p.ended
    with pytest.raises(ProtocolError):
        p.feed_eof()


@IMPLS
@given(body=st.binary(max_size=2000), sizes=st.lists(st.integers(1, 300), max_size=20),
       cuts=st.lists(st.integers(0, 4000), max_size=12))  # fmt: skip
def test_chunked_round_trip(impl: Parser, body: bytes, sizes: list[int], cuts: list[int]) -> None:
    frames, pos = [], 0
    for size in itertools.cycle(sizes or [len(body) or 1]):
        if pos >= len(body):
            break
        part = body[pos : pos + size]
        frames.append(b"%x\r\n%s\r\n" % (len(part), part))
        pos += size
    data = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"".join(frames)
    data += b"0\r\n\r\n"
    events = run(impl(), splits(data, cuts))
    assert b"".join(e for e in events if type(e) is bytes) == body
    assert events[-1] == End(True)


@IMPLS
@given(data=st.binary(max_size=400), cuts=st.lists(st.integers(0, 500), max_size=8),
       head_request=st.booleans())  # fmt: skip
def test_arbitrary_bytes_fail_only_with_the_parsers_error(
    impl: Parser, data: bytes, cuts: list[int], head_request: bool
) -> None:
    check_garbage(impl, data, cuts, head_request)


@IMPLS
@given(spec=responses(), edits=st.lists(st.tuples(st.integers(0, 2000), st.binary(max_size=3),
                                                  st.integers(0, 3)), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 2000), max_size=8))  # fmt: skip
def test_damaged_responses_fail_only_with_the_parsers_error(
    impl: Parser, spec: Spec, edits: list[tuple[int, bytes, int]], cuts: list[int]
) -> None:
    data = spec.data
    for at, insert, drop in edits:
        at = min(at, len(data))
        data = data[:at] + insert + data[at + drop :]
    check_garbage(impl, data, cuts, spec.head_request)


def check_garbage(impl: Parser, data: bytes, cuts: list[int], head_request: bool) -> None:
    p = impl(head_request=head_request, max_head=256)
    try:
        events = run(p, splits(data, cuts))
        if not p.ended:
            events += p.feed_eof()
    except ProtocolError:
        return
    # Whatever was accepted is one well-formed sequence: a head first, an end last.
    assert type(events[0]) is Head
    assert type(events[-1]) is End
    assert not any(type(e) is Head for e in events[1:])
    with pytest.raises(ProtocolError):
        p.feed(b"x")  # nothing is taken after the end


@IMPLS
@given(specs=st.lists(responses(), min_size=2, max_size=4),
       cuts=st.lists(st.integers(0, 2000), max_size=8))  # fmt: skip
def test_keep_alive_reuse_starts_each_response_afresh(
    impl: Parser, specs: list[Spec], cuts: list[int]
) -> None:
    p = impl()
    for i, spec in enumerate(specs):
        p.reset(head_request=spec.head_request)
        if i % 2:
            # The previous one may have been abandoned anywhere: cut it, or garble it.
            p.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\npart")
            p.reset(head_request=spec.head_request)
        events = run(p, splits(spec.data, cuts))
        if spec.close_delimited:
            events += p.feed_eof()
        assert merged(events) == expected(spec)


@IMPLS
@given(spec=responses(), extra=st.binary(min_size=1, max_size=40), cut=st.integers(0, 2000))
def test_bytes_after_the_end_in_the_same_read_are_dropped_and_bar_reuse(
    impl: Parser, spec: Spec, extra: bytes, cut: int
) -> None:
    if spec.close_delimited:
        return  # its body takes every byte
    if impl is LlhttpParser and not extra.strip(b"\r\n"):
        return  # llhttp skips CR and LF between messages (see LlhttpParser)
    body = spec.body if not spec.head_request else b""
    # In the read of the whole response, and in the last of two (the head and the body's
    # end each in a read of its own, as a streamed answer's are).
    k = cut % len(spec.data)
    for reads in ([spec.data + extra], [spec.data[:k], spec.data[k:] + extra]):
        p = impl(head_request=spec.head_request)
        try:
            events = run(p, reads)
        except ProtocolError:
            pytest.fail("bytes after a complete response must not make it an error")
        assert merged(events) == [spec.head] + ([body] if body else []) + [End(False)]


@IMPLS
def test_the_head_size_limit(impl: Parser) -> None:
    head = b"HTTP/1.1 200 OK\r\n" + b"X-Pad: %s\r\n" % (b"a" * 200)
    p = impl(max_head=150)
    with pytest.raises(ProtocolError, match="too large"):
        run(p, [head[i : i + 10] for i in range(0, len(head), 10)])
    # Within the limit, the same head is fine.
    p = impl(max_head=len(head) + 40)
    assert run(p, [head, b"Content-Length: 0\r\n\r\n"]) == [
        Head(200, b"OK", [(b"X-Pad", b"a" * 200), (b"Content-Length", b"0")], True),
        End(True),
    ]
    assert http1.MAX_HEAD == 64 * 1024


@IMPLS
@pytest.mark.parametrize(
    "data",
    [
        b"garbage\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\r\n",  # no size
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n;ext\r\n",
        # A negative size once sent the hand-written parser back over its input for ever.
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-6\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nokXX",
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n",
        # A space around a header's name: a proxy may read "Content-Length : 2" as the
        # length, another skip it, and the two frame the body apart.
        b"HTTP/1.1 200 OK\r\nContent-Length : 2\r\n\r\nab",
        b"HTTP/1.1 200 OK\r\n Content-Length: 2\r\n\r\nab",
        # A status under 100 is no status: not an interim head to skip.
        b"HTTP/1.1 099 X\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 000 X\r\nContent-Length: 0\r\n\r\n",
        # Two lengths: either could frame the body, and the bytes past the shorter one be
        # taken for the next response on the connection.
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\ncontent-length: 2\r\n\r\nab",
        # A Transfer-Encoding, even an empty one, beside a length: the same ambiguity.
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: \r\nContent-Length: 2\r\n\r\nab",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nContent-Length: 2\r\n\r\nab",
        # Status lines of no HTTP/1.x answer: another version, another protocol, a code
        # of more or fewer than three digits.
        b"HTTP/2.0 200 OK\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/0.9 200 OK\r\nContent-Length: 0\r\n\r\n",
        b"ICY 200 OK\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 20 OK\r\nContent-Length: 0\r\n\r\n",
        # A CR or LF alone inside a header line: a reader that ends lines there sees a
        # Content-Length another does not, and the two frame the body apart.
        b"HTTP/1.1 200 OK\r\nX-A: a\nContent-Length: 2\r\n\r\nab",
        b"HTTP/1.1 200 OK\r\nX-A: a\rContent-Length: 2\r\n\r\nab",
        b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\nContent-Length: 0\r\n\r\n",
        # A header name that is no token.
        b"HTTP/1.1 200 OK\r\nContent Length: 2\r\n\r\nab",
        b"HTTP/1.1 200 OK\r\nContent-Length\x00: 2\r\n\r\nab",
        # An interim head's lines are held to the same rules as the final one's.
        b"HTTP/1.1 103 Early Hints\r\nLink </a>\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
    ],
)
def test_malformed_responses(impl: Parser, data: bytes) -> None:
    with pytest.raises(ProtocolError):
        impl().feed(data)


def test_the_router_uses_llhttp() -> None:
    assert http1.ResponseParser is LlhttpParser


@IMPLS
def test_the_last_transfer_coding_frames_the_body(impl: Parser) -> None:
    """Chunked framing only when chunked is the last coding (RFC 9112 6.3): before it, the
    body is decoded as chunks; after it, or alone another coding, it runs to the close."""
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: %s\r\n\r\n"
    chunks = b"2\r\nab\r\n0\r\n\r\n"
    p = impl()
    assert merged(run(p, [head % b"gzip, chunked", chunks]))[1:] == [b"ab", End(True)]
    for coding in (b"chunked, gzip", b"gzip"):
        p = impl()
        assert merged(run(p, [head % coding, chunks]))[1:] == [chunks]
        assert p.feed_eof() == [End(False)]


@pytest.mark.parametrize("line", [b"1" * 5000, b"1;" + b"x" * 5000, b"0" * 5000])
def test_an_endless_chunk_size_line_is_an_error_not_a_buffer(line: bytes) -> None:
    """An engine that sends a chunk-size line with no end (a digit, an extension, at a
    time) is cut off after a few kilobytes by the Python parser, which holds the line until
    its CRLF, not buffered for as long as it keeps sending. (llhttp parses the line as it
    comes and holds none of it.)"""
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    with pytest.raises(ProtocolError):
        run(PyParser(), [head, *[line[i : i + 1000] for i in range(0, len(line), 1000)]])


def test_trailers_that_never_end_are_an_error_not_a_buffer() -> None:
    """The same for the trailers after the last chunk: past `max_head`, an error."""
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n"
    p = PyParser(max_head=500)
    with pytest.raises(ProtocolError, match="trailers"):
        run(p, [head, *[b"X-Pad: " + b"a" * 100] * 10])


@IMPLS
def test_a_chunk_size_past_64_bits_is_refused(impl: Parser) -> None:
    with pytest.raises(ProtocolError):
        impl().feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1" * 17 + b"\r\n")


@IMPLS
@pytest.mark.parametrize("extra", [b"HTTP/1.1 200 OK\r\n", b"XYZ"])
def test_bytes_after_an_end_read_apart_from_the_head_bar_reuse(impl: Parser, extra: bytes) -> None:
    """A streamed answer's head and end come in reads of their own: bytes after the end
    in its read answer nothing asked, and the connection must not carry another request."""
    p = impl()
    assert run(p, [b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\n", b"abcd" + extra])[1:] == [
        b"abcd",
        End(False),
    ]
    # The same when the read that ends the body holds none of it: a chunked stream's last
    # chunk, alone in its read.
    p = impl()
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    reads = [head + b"4\r\nabcd\r\n", b"0\r\n\r\n" + extra]
    assert run(p, reads)[1:] == [b"abcd", End(False)]


@IMPLS
def test_a_read_that_ends_at_a_chunk_size_line_gives_no_empty_body(impl: Parser) -> None:
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    events = run(impl(), [head, b"2\r\n", b"ok\r\n3\r\n", b"abc\r\n0\r\n\r\n"])
    assert events[1:] == [b"ok", b"abc", End(True)]


@IMPLS
def test_the_media_type_is_given_without_blanks_or_parameters(impl: Parser) -> None:
    data = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream ; charset=utf-8\r\n\r\n"
    head = impl().feed(data)[0]
    assert isinstance(head, Head)
    assert head.content_type == "text/event-stream"


@IMPLS
def test_an_interim_heads_content_type_is_not_the_answers(impl: Parser) -> None:
    """A 103 Early Hints may name a Content-Type (of what it hints at): the answer that
    follows without one has none, and is not taken for a stream."""
    data = (b"HTTP/1.1 103 Early Hints\r\nContent-Type: text/event-stream\r\n\r\n"
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")  # fmt: skip
    events = run(impl(), [data])
    assert events == [Head(200, b"OK", [(b"Content-Length", b"2")], True, ""), b"{}", End(True)]


@IMPLS
def test_a_header_value_is_given_without_the_blanks_around_it(impl: Parser) -> None:
    data = b"HTTP/1.1 200 OK\r\nX-A:  v \t \r\nContent-Type: text/event-stream \r\n\r\n"
    head = impl().feed(data)[0]
    assert isinstance(head, Head)
    assert head.headers == [(b"X-A", b"v"), (b"Content-Type", b"text/event-stream")]
    assert head.content_type == "text/event-stream"

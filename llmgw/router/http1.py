"""HTTP/1.1 response framing, sans-I/O: bytes in, events out.

The router's engine client (`llmgw.router.upstream`) feeds what a socket read returns to
`ResponseParser.feed` and gets back at most three events, in this order: a `Head`
(status, reason, headers, keep-alive) once the final head is in, the body bytes decoded
from that read as one `bytes` object (Content-Length, chunked, or until the close), and
`End` once the body is complete. Interim 1xx heads are skipped; trailers are read and
dropped. One read gives one body `bytes`, so the relay makes one write per read.

Malformed input raises `ProtocolError` (and nothing else) once the parser has read the
part it cannot frame; no input makes a parser loop, and a head still incomplete after
`MAX_HEAD` bytes is an error too (so are over-long chunk-size and trailer lines). Bytes
after the end in the same read are dropped and make `End.keep_alive` false: they answer
nothing asked, so the connection can no longer frame a response.
`reset` readies the parser for the next response on a kept-alive connection.

Two implementations share this interface: `LlhttpParser` on httptools (Node's llhttp),
which `ResponseParser` names, and `PyParser`, plain Python. llhttp frames a streamed
answer several times faster (`python -m tests.bench.bench_http1`; figures in README.md);
the Python one is the fallback where httptools is not installed (no wheel for the
platform) and the reference the property tests hold llhttp to. Both live in this one
module, a little over the project's 500 lines, because they share the events and the
framing rules (`_body_mode`, `_keep_alive`).
"""
# long module: two parsers of one interface, sharing its events and framing rules

from __future__ import annotations

import re
from typing import Final

import msgspec

MAX_HEAD: Final = 64 * 1024
"""The most bytes a response may take to complete its head (interim heads included)."""


class ProtocolError(Exception):
    """The engine's response is not valid HTTP/1.1 (or breaks a limit)."""


class Head(msgspec.Struct):
    """A response's final head (never an interim 1xx)."""

    status: int
    reason: bytes
    headers: list[tuple[bytes, bytes]]
    """(name, value) as received, in order; names keep their case."""
    keep_alive: bool
    """What the version and Connection header ask; false for a body that ends at the close."""
    content_type: str = ""
    """The media type of the last Content-Type, as sent, parameters dropped ("" if none)."""


class End(msgspec.Struct):
    """The response is complete."""

    keep_alive: bool
    """The connection may carry the next request: the head allowed it and no byte came
    after the end."""


Event = Head | bytes | End


def _media_type(value: bytes) -> str:
    return value.split(b";")[0].strip().decode("latin-1")


def _keep_alive(http11: bool, headers: list[tuple[bytes, bytes]]) -> bool:
    """What the version and the Connection header ask for."""
    keep_alive = http11
    for name, value in headers:
        if name.lower() == b"connection":
            tokens = value.lower().replace(b" ", b"").split(b",")
            if b"close" in tokens:
                keep_alive = False
            elif b"keep-alive" in tokens:
                keep_alive = True
    return keep_alive


_HEAD, _LENGTH, _CHUNKED, _CLOSE, _DONE = range(5)
_HEX: Final = frozenset(b"0123456789abcdefABCDEF")
_TOKEN: Final = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
"""A header name (RFC 9110 section 5.1): no blank, colon or control character in it."""
_CONTROL: Final = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]|\r(?!\n)|(?<!\r)\n")
"""What no head may hold (RFC 9110 section 5.5): a control character but the tab, a CR
or LF alone. A reader that ended a line at a bare LF would frame the body apart."""


def _body_mode(
    status: int, headers: list[tuple[bytes, bytes]], head_request: bool
) -> tuple[int, int]:
    """(mode, Content-Length) of the body a final head announces; raises on bad framing.

    As RFC 9112 section 6.3 has it for a response: none after HEAD, 204 or 304;
    Transfer-Encoding ending in chunked: chunked; any other Transfer-Encoding: until the
    close; else Content-Length; else until the close. Content-Length beside
    Transfer-Encoding, or given twice, is refused (either could frame the body)."""
    length = -1
    coding = b""
    for name, value in headers:
        n = name.lower()
        if n == b"content-length":
            v = value.strip()
            if not v.isdigit() or length >= 0:
                raise ProtocolError("malformed or repeated Content-Length")
            length = int(v)
        elif n == b"transfer-encoding":
            coding = value.lower().rpartition(b",")[2].strip() or b"?"
    if head_request or status in (204, 304):
        return _DONE, 0
    if coding:
        if length >= 0:
            raise ProtocolError("Content-Length beside Transfer-Encoding")
        return (_CHUNKED if coding == b"chunked" else _CLOSE), 0
    if length > 0:
        return _LENGTH, length
    if length == 0:
        return _DONE, 0
    return _CLOSE, 0


class PyParser:
    """The framing in plain Python (see the module docstring)."""

    __slots__ = (
        "_buf",
        "_chunk_left",
        "_head_bytes",
        "_head_request",
        "_keep_alive",
        "_left",
        "_mode",
        "_trailer",
        "max_head",
    )  # fmt: skip

    def __init__(self, *, head_request: bool = False, max_head: int = MAX_HEAD) -> None:
        self.max_head = max_head
        self.reset(head_request=head_request)

    def reset(self, *, head_request: bool = False) -> None:
        """Ready for the next response (`head_request`: it answers a HEAD, so has no body)."""
        self._head_request = head_request
        self._mode = _HEAD
        self._buf = b""
        self._head_bytes = 0
        self._left = 0
        self._chunk_left = -1  # -1: a size line comes next
        self._trailer = False
        self._keep_alive = True

    @property
    def ended(self) -> bool:
        return self._mode == _DONE

    def feed(self, data: bytes) -> list[Event]:
        mode = self._mode
        if mode == _DONE:
            raise ProtocolError("bytes after the end of the response")
        events: list[Event] = []
        if mode == _HEAD:
            data = self._feed_head(data, events)
            if self._mode == _HEAD:
                return events
        if self._mode == _DONE:
            if data:
                self._keep_alive = False
            events.append(End(self._keep_alive))
            return events
        if data:
            if self._mode == _LENGTH:
                self._feed_length(data, events)
            elif self._mode == _CHUNKED:
                self._feed_chunked(data, events)
            else:
                events.append(data)
        return events

    def feed_eof(self) -> list[Event]:
        """The connection closed: the end of a close-delimited body, else an error."""
        if self._mode == _CLOSE:
            self._mode = _DONE
            return [End(False)]
        raise ProtocolError("the connection closed before the end of the response")

    def _feed_head(self, data: bytes, events: list[Event]) -> bytes:
        buf = self._buf + data if self._buf else data
        self._head_bytes += len(data)
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if self._head_bytes > self.max_head:
                    raise ProtocolError("the response head is too large")
                self._buf = buf
                return b""
            head, buf = buf[:end], buf[end + 4 :]
            bad = _CONTROL.search(head)
            if bad is not None:
                raise ProtocolError(f"a control character in the head at byte {bad.start()}")
            lines = head.split(b"\r\n")
            version, _, rest = lines[0].partition(b" ")
            code, _, reason = rest.partition(b" ")
            if version not in (b"HTTP/1.1", b"HTTP/1.0") or len(code) != 3 or not code.isdigit():
                raise ProtocolError(f"malformed status line {lines[0][:80]!r}")
            status = int(code)
            if status < 100:
                raise ProtocolError(f"malformed status line {lines[0][:80]!r}")
            if status == 101:
                raise ProtocolError("the engine switched protocols unasked")
            headers: list[tuple[bytes, bytes]] = []
            content_type = ""
            for line in lines[1:]:
                name, colon, value = line.partition(b":")
                if not colon or _TOKEN.fullmatch(name) is None:
                    raise ProtocolError(f"malformed header line {line[:80]!r}")
                value = value.strip(b" \t")
                headers.append((name, value))
                if len(name) == 12 and name.lower() == b"content-type":
                    content_type = _media_type(value)
            if status < 200:
                continue  # interim (100 Continue, 103 Early Hints): the real head follows
            mode, self._left = _body_mode(status, headers, self._head_request)
            self._keep_alive = _keep_alive(version == b"HTTP/1.1", headers) and mode != _CLOSE
            events.append(Head(status, reason, headers, self._keep_alive, content_type))
            self._mode = mode
            self._buf = b""
            return buf

    def _feed_length(self, data: bytes, events: list[Event]) -> None:
        if len(data) >= self._left:
            if len(data) > self._left:
                self._keep_alive = False  # bytes beyond the body
            events.append(data[: self._left] if len(data) > self._left else data)
            self._left = 0
            self._mode = _DONE
            events.append(End(self._keep_alive))
        else:
            self._left -= len(data)
            events.append(data)

    def _feed_chunked(self, data: bytes, events: list[Event]) -> None:
        buf = self._buf + data if self._buf else data
        pos = 0
        n = len(buf)
        out: list[bytes] = []
        left = self._chunk_left  # -1: a size line comes next; 0: the CRLF after a chunk
        while pos < n:
            if left < 0:
                if self._trailer:
                    pos = self._feed_trailers(buf, pos, out, events)
                    if self._mode == _DONE:
                        return
                    break
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if n - pos > 4096:
                        raise ProtocolError("malformed chunk size line")
                    break
                line = buf[pos:end]
                semi = line.find(b";")
                size_hex = line if semi < 0 else line[:semi]
                if not size_hex or len(size_hex) > 16 or not _HEX.issuperset(size_hex):
                    raise ProtocolError(f"malformed chunk size {line[:40]!r}")
                left = int(size_hex, 16)
                pos = end + 2
                if left == 0:
                    self._trailer = True
                    left = -1
                    continue
                if pos == n:
                    break
            if left > 0:
                end = pos + left
                if end > n:
                    out.append(buf[pos:])
                    left = end - n
                    pos = n
                    break
                out.append(buf[pos:end])
                pos = end
                left = 0
            if n - pos < 2:
                break  # wait for the CRLF after the chunk
            if buf[pos : pos + 2] != b"\r\n":
                raise ProtocolError("a chunk does not end with CRLF")
            pos += 2
            left = -1
        self._chunk_left = left
        self._buf = buf[pos:] if pos < n else b""
        if out:
            events.append(out[0] if len(out) == 1 else b"".join(out))

    def _feed_trailers(self, buf: bytes, pos: int, out: list[bytes], events: list[Event]) -> int:
        """After the last chunk: optional trailers, then an empty line (the end)."""
        n = len(buf)
        while True:
            end = buf.find(b"\r\n", pos)
            if end < 0:
                if n - pos > self.max_head:
                    raise ProtocolError("the trailers are too large")
                return pos
            line = buf[pos:end]
            pos = end + 2
            if not line:
                break
            if b":" not in line:
                raise ProtocolError(f"malformed trailer line {line[:80]!r}")
        if out:
            events.append(out[0] if len(out) == 1 else b"".join(out))
        self._buf = b""
        self._mode = _DONE
        events.append(End(self._keep_alive and pos == n))
        return pos


try:
    import httptools
except ImportError:  # pragma: no cover - a dependency; the fallback is for installs without it
    httptools = None  # type: ignore[assignment]


_LLHTTP_ERRORS: tuple[type[Exception], ...] = (
    (httptools.HttpParserError, httptools.HttpParserUpgrade) if httptools is not None else ()
)


class _Stop(Exception):
    """Raised from a callback to stop llhttp: the response ended (HEAD) or bytes follow it."""


class LlhttpParser:
    """The framing on httptools' llhttp bindings (see the module docstring).

    llhttp calls back for each piece it recognizes; the callbacks collect them and `feed`
    returns them as events. llhttp frames the body itself (and refuses what RFC 9112 does,
    such as Content-Length beside Transfer-Encoding); the head is looked at in Python only
    for Content-Type, and for the whole framing when llhttp cannot tell: a HEAD answer,
    whose body llhttp would wait for, and a head without keep-alive, whose body may end at
    the close. llhttp goes on to the next message after one ends, so a byte that starts one
    after the end stops it (`_Stop`) and counts as a byte beyond the body. llhttp skips CR
    and LF between messages without a callback: those alone after the end go unnoticed,
    and are harmless (the next response's parse starts clean).
    """

    __slots__ = (
        "_began",
        "_body",
        "_close_delimited",
        "_content_type",
        "_ended",
        "_head",
        "_head_bytes",
        "_head_request",
        "_headers",
        "_heads",
        "_interim",
        "_keep_alive",
        "_p",
        "_raw",
        "_reason",
        "_stopped",
        "_trailing",
        "max_head",
        "on_body",
    )  # fmt: skip

    def __init__(self, *, head_request: bool = False, max_head: int = MAX_HEAD) -> None:
        if httptools is None:  # pragma: no cover
            raise RuntimeError("httptools is not installed")
        self.max_head = max_head
        # llhttp calls on_body once per chunk: the list's own append, not a Python method,
        # so a streamed answer's chunks cost no Python frame each. The list stays the same
        # object for the parser's life (llhttp holds its append).
        self._body: list[bytes] = []
        self.on_body = self._body.append
        self._p = httptools.HttpResponseParser(self)
        self._began = False
        self._ended = False
        self._stopped = False
        self._keep_alive: bool = True
        self.reset(head_request=head_request)

    def reset(self, *, head_request: bool = False) -> None:
        """Ready for the next response (`head_request`: it answers a HEAD, so has no body)."""
        if self._stopped or (self._began and not (self._ended and self._keep_alive)):
            # llhttp is ready for the next message only after a clean end that kept the
            # connection alive.
            self._p = httptools.HttpResponseParser(self)
        self._head_request = head_request
        self._head: Head | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._reason = b""
        self._content_type = ""
        self._body.clear()
        self._began = False
        self._interim = False
        self._ended = False
        self._stopped = False
        self._trailing = False
        self._keep_alive = True
        self._close_delimited = False
        self._head_bytes = 0
        self._heads = 0
        self._raw = b""

    @property
    def ended(self) -> bool:
        return self._ended

    def feed(self, data: bytes) -> list[Event]:
        if self._head is None:
            return self._feed_head(data)
        if self._ended:
            raise ProtocolError("bytes after the end of the response")
        try:
            self._p.feed_data(data)
        except _LLHTTP_ERRORS as exc:
            self._failed(exc)
        body = self._body
        if body:
            data = body[0] if len(body) == 1 else b"".join(body)
            body.clear()
            if self._ended:
                return [data, End(self._keep_alive and not self._trailing)]
            return [data]
        if self._ended:
            return [End(self._keep_alive and not self._trailing)]
        return []

    def _feed_head(self, data: bytes) -> list[Event]:
        if self._ended:  # an error ended it
            raise ProtocolError("bytes after the end of the response")
        if self._head_request:
            self._raw += data
        try:
            self._p.feed_data(data)
        except _LLHTTP_ERRORS as exc:
            self._failed(exc)
            if self._head_request:
                self._trailing = self._after_heads(self._raw)
        head = self._head
        if head is None:
            self._head_bytes += len(data)
            if self._head_bytes > self.max_head:
                self._stopped = True
                raise ProtocolError("the response head is too large")
            return []
        events: list[Event] = [head]
        body = self._body
        if body:
            events.append(body[0] if len(body) == 1 else b"".join(body))
            body.clear()
        if self._ended:
            events.append(End(self._keep_alive and not self._trailing))
        return events

    def _failed(self, exc: Exception) -> None:
        """llhttp stopped: a `_Stop`, else a malformed response."""
        self._stopped = True
        if self._ended:
            return
        if isinstance(exc, httptools.HttpParserUpgrade):
            raise ProtocolError("the engine switched protocols unasked") from None
        cause = exc.__context__ if isinstance(exc.__context__, ProtocolError) else exc
        raise ProtocolError(str(cause) or type(cause).__name__) from None

    def feed_eof(self) -> list[Event]:
        """The connection closed: the end of a close-delimited body, else an error."""
        if self._close_delimited and not self._ended:
            self._ended = True
            self._stopped = True  # llhttp itself still waits for the body's end
            return [End(False)]
        raise ProtocolError("the connection closed before the end of the response")

    def _after_heads(self, raw: bytes) -> bool:
        """Whether bytes follow the heads (interim and final) at the start of `raw`."""
        for _ in range(self._heads):
            raw = raw.lstrip(b"\r\n")
            raw = raw[raw.find(b"\r\n\r\n") + 4 :]
        return bool(raw)

    # ------------------------------------------------------------ llhttp's callbacks

    def on_message_begin(self) -> None:
        if self._ended:
            self._trailing = True
            raise _Stop
        self._began = True

    def on_status(self, reason: bytes) -> None:
        self._reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._head is None:
            value = value.rstrip(b" \t")
            self._headers.append((name, value))
            if len(name) == 12 and name.lower() == b"content-type":
                self._content_type = _media_type(value)

    def on_headers_complete(self) -> None:
        p = self._p
        status = p.get_status_code()
        self._heads += 1
        if p.get_http_version() not in ("1.1", "1.0"):
            # llhttp takes HTTP/0.9 and HTTP/2.0 too: neither frames an answer here.
            raise ProtocolError(f"malformed status line: HTTP/{p.get_http_version()}")
        if status < 200:
            if status < 100:
                raise ProtocolError(f"malformed status {status}")
            if status == 101:
                raise ProtocolError("the engine switched protocols unasked")
            self._interim = True  # its message ends at once; the real head follows
            self._headers = []
            self._reason = b""
            self._content_type = ""
            return
        headers = self._headers
        if self._head_request:
            keep_alive = _keep_alive(p.get_http_version() == "1.1", headers)
        else:
            keep_alive = p.should_keep_alive()
            if not keep_alive:
                self._close_delimited = _body_mode(status, headers, False)[0] == _CLOSE
        self._keep_alive = keep_alive
        self._head = Head(status, self._reason, headers, keep_alive, self._content_type)
        if self._head_request:
            self._ended = True
            raise _Stop

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self._ended = True


ResponseParser = LlhttpParser if httptools is not None else PyParser
"""The faster implementation where it is installed."""

"""Raw HTTP/1.1 over real sockets, plain or TLS: what a listener answers to bytes no client
library sends (a malformed header with a key in it, a request head trickled in, a head
never finished). Blocking: from an async test, call through `asyncio.to_thread`.

Also what a listener does with a connection that sends nothing (`silent`) or sends its
next request after an idle spell (`kept_alive`), and with a gzip bomb (`gzip_bomb`: how
much CPU it spends, `cpu_s`).

Used by the front-door tests of every listener: tests/integration/test_router_hygiene.py
(the router's two) and tests/integration/test_listener_hygiene.py (the control plane's admin
API, the agent's admin listener, `llmgw console`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import socket
import ssl
import struct
import time
import urllib.parse
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

SECRET = "sk-hygiene-secret-7f3a9c"
"""What a tenant's key looks like; no answer and no log line may ever hold it."""


def addr(url: str) -> tuple[str, int]:
    """(host, port) of `http://host:port` or `https://host:port`."""
    where = urllib.parse.urlsplit(url)
    assert where.hostname is not None, url
    assert where.port is not None, url
    return where.hostname, where.port


def connect(url: str, *, timeout: float, tls: ssl.SSLContext | None = None) -> socket.socket:
    """A connection to the listener at `url` (through TLS with `tls`)."""
    sock = socket.create_connection(addr(url), timeout=timeout)
    if tls is None:
        return sock
    try:
        return tls.wrap_socket(sock, server_hostname=addr(url)[0])
    except BaseException:
        sock.close()
        raise


def exchange(
    url: str, raw: bytes, *, timeout: float = 20.0, tls: ssl.SSLContext | None = None
) -> bytes:
    """Send `raw`, return everything the server answers until it closes the connection."""
    with connect(url, timeout=timeout, tls=tls) as sock:
        sock.sendall(raw)
        answer = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return answer
            answer += chunk


def answer_to(
    url: str, raw: bytes, *, timeout: float = 60.0, tls: ssl.SSLContext | None = None
) -> bytes:
    """`exchange`, for a request with a large body that the server may answer before it has
    read it all, and close: what it answered, b"" when it closed without an answer."""
    with connect(url, timeout=timeout, tls=tls) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, ssl.SSLEOFError):
            sock.sendall(raw)
        answer = b""
        with contextlib.suppress(ConnectionResetError, ssl.SSLError):
            while chunk := sock.recv(65536):
                answer += chunk
        return answer


def with_body(url: str, method: str, path: str, body: bytes, *headers: str) -> bytes:
    """A request (Connection: close) of `path` carrying `body` and `headers` ("Name: value")."""
    host, port = addr(url)
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", *headers,
             f"Content-Length: {len(body)}", "Connection: close"]  # fmt: skip
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@functools.cache
def gzip_bomb() -> bytes:
    """A gzip stream of a GiB of zeros, about a MB: what a client with no key could send to
    have a server that inflates request bodies spend seconds of CPU on it. Built in a
    fraction of a second: a MiB of zeros deflated and fully flushed (which makes the piece
    independent of what came before) is repeated 1024 times, then the last block and
    gzip's trailer (the zeros' CRC and length)."""
    zeros = bytes(1 << 20)
    deflate = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    piece = deflate.compress(zeros) + deflate.flush(zlib.Z_FULL_FLUSH)
    crc = functools.reduce(lambda c, _: zlib.crc32(zeros, c), range(1024), 0)
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff"  # gzip, deflate, no name, no time
    last_block = b"\x03\x00"  # final, fixed codes, nothing but its end
    trailer = struct.pack("<II", crc, (1024 << 20) & 0xFFFFFFFF)
    return header + piece * 1024 + last_block + trailer


def cpu_s(pid: int) -> float:
    """The CPU time a process has used, user and system."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def silent(
    url: str, *, tls: ssl.SSLContext | None = None, wait_s: float = 30.0
) -> tuple[bytes, float]:
    """Connect and send nothing (with `tls`: nothing after the handshake; without, not
    even a handshake to a TLS listener): what the server sent before it closed the
    connection, and the seconds from before the connect to the close. TimeoutError when
    it is still open after `wait_s`."""
    t0 = time.monotonic()  # before the connect: the server's clock starts at its accept
    with connect(url, timeout=wait_s, tls=tls) as sock:
        answer = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            answer += chunk
        return answer, time.monotonic() - t0


def get(host: str, path: str) -> bytes:
    """A GET of `path` that keeps the connection alive."""
    return f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()


def read_response(sock: socket.socket) -> bytes:
    """One response with a Content-Length body, read off `sock`."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a whole head: {data[:300]!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, f"closed before the whole body: {data[:300]!r}"
        body += chunk
    return head + b"\r\n\r\n" + body


def kept_alive(
    url: str, path: str, *, idle_s: float, tls: ssl.SSLContext | None = None
) -> tuple[bytes, bytes]:
    """Two GETs of `path` on one connection, `idle_s` apart: both answers."""
    host, _ = addr(url)
    with connect(url, timeout=30, tls=tls) as sock:
        sock.sendall(get(host, path))
        first = read_response(sock)
        time.sleep(idle_s)
        sock.sendall(get(host, path))
        return first, read_response(sock)


def in_pieces(
    url: str, path: str, *, pieces: int, every_s: float, tls: ssl.SSLContext | None = None
) -> bytes:
    """A GET of `path` (Connection: close) sent in `pieces` parts, `every_s` apart from the
    connect on: the answer."""
    host, _ = addr(url)
    raw = f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
    size = -(-len(raw) // pieces)
    with connect(url, timeout=30, tls=tls) as sock:
        for start in range(0, len(raw), size):
            time.sleep(every_s)
            sock.sendall(raw[start : start + size])
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


def malformed_key(url: str, path: str = "/metrics") -> bytes:
    """A GET whose `Authorization` header holds `SECRET` and a control character."""
    return (f"GET {path} HTTP/1.1\r\nHost: {addr(url)[0]}\r\n"
            f"Authorization: Bearer {SECRET}\x01tail\r\n\r\n").encode("latin-1")  # fmt: skip


def unfinished_head(url: str, *, tls: ssl.SSLContext | None = None) -> bytes:
    """Send a request head without its end, all at once, then wait: what the server
    answers before it closes the connection (the head never ends)."""
    host, _ = addr(url)
    return exchange(url, f"GET /metrics HTTP/1.1\r\nHost: {host}\r\nX-Slow: 1\r\n".encode(),
                    timeout=120, tls=tls)  # fmt: skip


def trickle(
    url: str,
    start: bytes,
    pieces: Iterable[bytes],
    *,
    every_s: float,
    tls: ssl.SSLContext | None = None,
) -> tuple[bytes, float]:
    """Send `start`, then one of `pieces` every `every_s` until the server closes the
    connection (or the pieces run out): what it answered, and the seconds it took from
    connecting to the end."""
    # Before the connection: a server's head deadline runs from the moment it accepts, and a
    # clock started at the send (or even after the connect returned) measured 0.9993 s of 1.
    t0 = time.monotonic()
    with connect(url, timeout=30, tls=tls) as sock:
        sock.sendall(start)
        answer = b""
        sock.settimeout(every_s)
        for piece in pieces:
            try:
                sock.sendall(piece)
            except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
                break
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            except (ConnectionResetError, ssl.SSLError):
                break  # the answer must have come before: the server lingers after it
            if not chunk:
                break
            answer += chunk
        return answer, time.monotonic() - t0


def one_byte_at_a_time(url: str, *, every_s: float, for_s: float) -> tuple[bytes, Iterator[bytes]]:
    """(`start`, `pieces`) for `trickle`: a request line, then a header that never ends,
    one byte a piece, enough pieces for `for_s` seconds at one every `every_s`."""
    start = f"GET /metrics HTTP/1.1\r\nHost: {addr(url)[0]}\r\nX-Slow: ".encode()
    return start, itertools.repeat(b"a", round(for_s / every_s))


def logged_without_the_key(read: Callable[[], str], problem: str, before: int) -> str:
    """Wait for the log `read` returns to name `problem` more than `before` times (the
    line may be written just after the answer), then check it holds neither `SECRET` nor
    a traceback; the log."""
    deadline = time.monotonic() + 20
    log = read()
    while log.count(problem) <= before:
        assert time.monotonic() < deadline, log[-2000:]
        time.sleep(0.05)
        log = read()
    assert SECRET not in log
    assert "Traceback" not in log
    return log

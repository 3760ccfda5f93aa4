"""Raw HTTP/1.1 over real sockets, plain or TLS: what a listener answers to bytes no client
library sends (a malformed header with a key in it, a request head trickled in, a head
never finished). Blocking: from an async test, call through `asyncio.to_thread`.

Also what a listener does with a connection that sends nothing (`silent`) or sends its
next request after an idle spell (`kept_alive`).

Used by the front-door tests of every listener: tests/integration/test_router_hygiene.py
(the router's two) and tests/integration/test_listener_hygiene.py (the control plane's admin
API, the agent's admin listener, `llmgw console`).
"""

from __future__ import annotations

import itertools
import socket
import ssl
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator

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

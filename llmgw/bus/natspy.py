"""nats-py's internals that llmgw overrides, in one place, behind one version guard.

llmgw relies on four private parts of nats-py, each for a reason measured in
production or in tests/bench:

- `Client._select_next_server`: nats-py waits a fixed `reconnect_time_wait` between
  attempts at the same server; `Client` here waits a jittered exponential backoff
  instead (`backoff_delay`), so a fleet of agents does not stampede a restarted server
  in lockstep;
- `Client._process_msg`: a fast subscription's messages go straight to a synchronous
  handler (`fast_subscribe`), skipping nats-py's per-message header parsing and queueing;
- its protocol `Parser`: `FrameParser` reads message frames without nats-py's per-frame
  regular expressions and hands a fast subscription's messages over inline (the
  `Reader` replays the log several times faster with both);
- `Client._connect_to_server`: the TCP transport is `UpgradeSafeTransport`, which a failed
  TLS upgrade leaves closed (nats-py's own then held a connecting client forever) and
  which says why the server closed the connection (its TLS alert, not "Connection lost").

They were written against nats-py 2.16 (`KNOWN`, the range pyproject pins). At import
this module reads the installed version; outside that range `Client` behaves as stock
nats-py (a fixed reconnect wait, fast subscriptions delivered through an ordinary
callback, nats-py's parser), slower but correct, and says so once in the log
(`bus.natspy_fallback`). tests/unit/test_wire.py pins what `FrameParser` may change;
tests/integration/test_natspy_fallback.py shows a client on the stock path still works.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import random
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
from nats.aio.client import DEFAULT_BUFFER_SIZE
from nats.aio.client import Client as _NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.aio.transport import TcpTransport
from nats.protocol.parser import AWAITING_CONTROL_LINE, Parser

from llmgw import logs
from llmgw.bus.headers import header_block

log = logs.get("llmgw.bus")

KNOWN = ((2, 16), (2, 17))
"""The nats-py versions [from, to) the overrides were written against."""
FALLBACK_RECONNECT_WAIT_S = 2
"""nats-py's own default wait between attempts, for the stock reconnect loop."""
STABLE_S = 10.0
"""How long a connection must have lasted for its outage to start the backoff over (the
first attempt at once). A server that answers CONNECT and then drops the client (shutting
down, overloaded, refusing what follows) would otherwise be retried several times a second
by every client of the fleet."""

# (subject, reply, payload, raw header block or b"") of one message, called inline.
FastHandler = Callable[[bytes, bytes, bytes, bytes], None]


def unsupported(version: str) -> str | None:
    """Why the overrides do not apply to nats-py `version`, or None when they do. Pure."""
    try:
        found = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return f"nats-py {version!r} is not a version llmgw can read"
    low, high = KNOWN
    if not low <= found < high:
        return (
            f"nats-py {version} is outside {low[0]}.{low[1]} <= v < {high[0]}.{high[1]}, "
            "which llmgw's overrides of its internals were written for"
        )
    return None


def _installed() -> str:
    try:
        return importlib.metadata.version("nats-py")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


VERSION = _installed()
REASON = unsupported(VERSION)
"""Why the overrides are off (None: they are on)."""
_told = False


def overrides_on() -> bool:
    """Whether a new client uses llmgw's overrides; logs once why not."""
    global _told
    if REASON is None:
        return True
    if not _told:
        _told = True
        log.warning(
            "natspy_fallback",
            version=VERSION,
            why=REASON,
            action="using nats-py's stock reconnect loop, parser and dispatch",
        )
    return False


def backoff_delay(attempt: int, *, base: float, cap: float, rand: random.Random) -> float:
    """Seconds to wait before reconnect attempt `attempt` (1, 2, ...). Pure given `rand`.

    "Full jitter": uniform in [0, min(cap, base * 2**(attempt-1))], with a floor of
    a tenth of the window so that a failing server is never hammered in a tight loop.
    """
    window = min(cap, base * (2.0 ** min(max(attempt - 1, 0), 30)))
    return float(window * (0.1 + 0.9 * rand.random()))


def _stock_delivery(handler: FastHandler) -> Callable[[Msg], Awaitable[None]]:
    """An ordinary subscription callback that hands `handler` what the fast path would:
    raw subject, reply, payload and header block (a status line for a status message)."""

    async def deliver(msg: Msg) -> None:
        headers = msg.headers or {}
        status = headers.get("Status")
        try:
            if status and not msg.reply:
                raw = f"NATS/1.0 {status} {headers.get('Description', '')}\r\n\r\n".encode()
                handler(msg.subject.encode(), b"", b"", raw)
            else:
                raw = header_block(msg.headers)
                handler(msg.subject.encode(), (msg.reply or "").encode(), msg.data, raw)
        except Exception as exc:  # a handler bug must not kill the subscription
            log.error("fast_handler_failed", error=repr(exc))

    return deliver


READ_BYTES = 262_144
"""The most one read from the server's connection takes (`UpgradeSafeTransport.read`)."""


class UpgradeSafeTransport(TcpTransport):
    """nats-py's TCP transport, corrected where a TLS upgrade fails or the server refuses.

    A failed upgrade (a server certificate that does not verify, a handshake past its
    timeout): asyncio's `start_tls` closes the socket, but that close reaches the TLS layer
    it handed the socket to, never the plain stream nats-py keeps. nats-py then waits for
    that stream to close, forever: a client still making its first connection never tried
    again. Here the stream goes with the socket, so there is nothing to wait for, and the
    next attempt makes a new transport.

    A server that refuses this client's certificate sends a TLS alert and closes; a write
    that meets the close fails with asyncio's "Connection lost", and the alert is left in
    the reader. `drain` raises the alert instead, so the caller learns what was refused.
    """

    async def connect_tls(self, *args: Any, **kwargs: Any) -> None:
        try:
            await super().connect_tls(*args, **kwargs)
        except BaseException:
            self._io_reader = self._bare_io_reader = None
            self._io_writer = self._bare_io_writer = None
            raise

    async def read(self, buffer_size: int) -> bytes:
        # nats-py asks for 32 KiB a read: about 20 of a replay's messages, each read one
        # wait on the event loop and one parse call. Asking for `READ_BYTES` measured 3-4 %
        # more attested events a second in a replay (5 % per CPU-second); a read still
        # returns whatever has arrived, so nothing waits for a full buffer.
        data: bytes = await super().read(max(buffer_size, READ_BYTES))
        return data

    async def drain(self) -> None:
        try:
            await super().drain()  # type: ignore[no-untyped-call]  # nats-py's, unannotated
        except ConnectionResetError:
            why = self._io_reader.exception() if self._io_reader is not None else None
            if isinstance(why, ssl.SSLError):
                raise why from None
            raise


class Client(_NatsClient):
    """nats-py's client with llmgw's overrides where the version is known (`overridden`)."""

    def __init__(self) -> None:
        super().__init__()
        self.backoff_base = 0.25
        self.backoff_cap = 10.0
        self._rand = random.Random()
        self._fast: dict[int, FastHandler] = {}
        self._failed_attempts = 0
        self._up_since: float | None = None
        self.overridden = overrides_on()
        # Only over the parser it was written against.
        if self.overridden and type(self._ps) is Parser:
            self._ps = FrameParser(self)

    @property
    def server_tried(self) -> str:
        """The URL of the server this client connects (or last connected) to; "" before any."""
        server = self._current_server
        return server.uri.geturl() if server is not None else ""

    @property
    def reconnect_wait_s(self) -> int:
        """What to pass as nats-py's `reconnect_time_wait`: 0 where this client waits its
        own backoff, nats-py's default otherwise (never a tight loop)."""
        return 0 if self.overridden else FALLBACK_RECONNECT_WAIT_S

    # nats-py's own loop waits a fixed `reconnect_time_wait` between attempts at the
    # same server. This replaces it with a jittered exponential backoff; the body
    # otherwise follows nats-py 2.16's `_select_next_server`.
    async def _select_next_server(self) -> None:
        if not self.overridden:
            await super()._select_next_server()
            return
        self._end_of_connection(time.monotonic())
        while True:
            if len(self._server_pool) == 0:
                self._current_server = None
                raise nats.errors.NoServersError
            server = self._server_pool.pop(0)
            max_attempts = self.options["max_reconnect_attempts"]
            if max_attempts > 0 and server.reconnects > max_attempts:
                continue
            self._server_pool.append(server)
            if server.last_attempt is not None or self._failed_attempts:
                self._failed_attempts += 1
                delay = backoff_delay(
                    self._failed_attempts,
                    base=self.backoff_base,
                    cap=self.backoff_cap,
                    rand=self._rand,
                )
                await asyncio.sleep(delay)
            try:
                await self._connect_to_server(server)
            except Exception as exc:
                server.last_attempt = time.monotonic()
                # What `max_reconnect_attempts` counts: without it a client that should
                # give up (ctl, tests) would retry a dead server forever.
                server.reconnects += 1
                log.warning(
                    "connect_failed",
                    server=server.uri.netloc,
                    attempt=self._failed_attempts + 1,
                    error=str(exc) or type(exc).__name__,
                )
                continue
            self._current_server = server
            return

    def _end_of_connection(self, now: float) -> None:
        """Before reconnecting: a connection that lasted `STABLE_S` starts the backoff over;
        a shorter one leaves it where it was, so a server that keeps dropping its clients
        soon after they connect sees them back ever more slowly."""
        up_since, self._up_since = self._up_since, None
        server = self._current_server
        if up_since is None or server is None or now - up_since < STABLE_S:
            return
        self._failed_attempts = 0
        server.last_attempt = None
        server.reconnects = 0

    async def _process_connect_init(self) -> None:
        await super()._process_connect_init()
        if self.overridden and self._current_server is not None:
            # Connected: from here (not from the TCP connect, which a server that refuses a
            # certificate or an authorization also accepts) the connection counts as up;
            # its outage starts the backoff over if it lasted (`_end_of_connection`).
            self._up_since = time.monotonic()

    # nats-py makes a stock TcpTransport wherever the one it has holds no open stream (a
    # new one included): this keeps `UpgradeSafeTransport`. The body otherwise follows
    # nats-py 2.16's `_connect_to_server` for a TCP server.
    async def _connect_to_server(self, s: Any) -> None:
        if not self.overridden or s.uri.scheme not in ("nats", "tls"):
            await super()._connect_to_server(s)
            return
        s.last_attempt = time.monotonic()
        if not isinstance(self._transport, UpgradeSafeTransport):
            self._transport = UpgradeSafeTransport()  # type: ignore[no-untyped-call]
        await self._transport.connect(
            s.uri, buffer_size=DEFAULT_BUFFER_SIZE, connect_timeout=self.options["connect_timeout"]
        )

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes
    ) -> None:
        # Stock: `_fast` stays empty (fast subscriptions are ordinary callbacks then).
        handler = self._fast.get(sid)
        if handler is None:
            await super()._process_msg(sid, subject, reply, data, headers)
            return
        self.stats["in_msgs"] += 1
        self.stats["in_bytes"] += len(data)
        try:
            handler(subject, reply, data, headers or b"")
        except Exception as exc:  # a handler bug must not kill the connection's reader
            log.error("fast_handler_failed", error=repr(exc))

    async def fast_subscribe(self, subject: str, handler: FastHandler) -> Subscription:
        """Subscribe with `handler` called in order for every message on `subject`: inline
        where the overrides are on, from an ordinary callback otherwise.

        The handler gets raw bytes and must not block; it is the caller's job to decode.
        """
        if not self.overridden:
            return await self.subscribe(subject, cb=_stock_delivery(handler))
        sub = await self.subscribe(subject)
        self._fast[sub._id] = handler
        return sub

    async def fast_unsubscribe(self, sub: Subscription) -> None:
        self._fast.pop(sub._id, None)
        with contextlib.suppress(
            nats.errors.ConnectionClosedError, nats.errors.BadSubscriptionError
        ):
            await sub.unsubscribe()


# --------------------------------------------------------------------------- the parser
#
# A replay is one `HMSG` frame per event, and nats-py's parser spends more on each frame
# than the reader spends checking and decoding the event inside it: it tries the `MSG`
# pattern, then the `HMSG` pattern, on the whole buffer, keeps the arguments in a dict,
# and awaits a coroutine per message. `FrameParser` reads `MSG` and `HMSG` frames with
# `bytes.find` and `split`, hands those of a fast subscription to its handler inline, and
# leaves everything else (PING, PONG, INFO, -ERR, a frame split across reads, anything it
# does not recognise) to nats-py's own parser, whose state it shares. What it may change
# is pinned by tests/unit/test_wire.py, which feeds the same random protocol streams, cut
# at random points, to both parsers and requires the same deliveries in the same order.

_MSG = b"MSG "
_HMSG = b"HMSG "
_CRLF = b"\r\n"
# The server's limit on a control line: beyond it, nats-py's parser decides.
_MAX_CONTROL_LINE = 4096


class FrameParser(Parser):
    """nats-py's `Parser` with a fast path for message frames.

    `nc` is the client: `nc._fast` maps subscription ids to inline handlers, the rest
    go to `nc._process_msg` as with the stock parser.
    """

    # The loop runs once per frame of a replay, so it is one function: reading the control
    # line in a helper measured about 8% fewer frames per second (CPU-only, 50,000 frames).
    # long: the per-frame loop of the replay's hot path, inlined on purpose
    async def parse(self, data: bytes = b"") -> None:
        buf = self.buf
        if self.state != AWAITING_CONTROL_LINE:
            buf.extend(data)
            await super().parse()
            return
        nc: Any = self.nc
        fast: dict[int, FastHandler] = nc._fast
        # One copy per read at most: what an earlier read left (a frame cut short) joined to
        # this one. Slices of bytes are one copy each, of a bytearray two.
        view = bytes(buf) + data if buf else bytes(data)
        pos = 0
        end = len(view)
        # Whether what is left is the start of a frame that a later read completes (kept
        # for this parser) rather than something for nats-py's parser.
        partial = False
        # nats-py's counters, added once per read rather than per frame.
        delivered = delivered_bytes = 0
        try:
            while pos < end:
                if view.startswith(_HMSG, pos):
                    skip, with_headers = 5, True
                elif view.startswith(_MSG, pos):
                    skip, with_headers = 4, False
                else:
                    tail = view[pos:]
                    partial = len(tail) < 5 and (_HMSG.startswith(tail) or _MSG.startswith(tail))
                    break
                eol = view.find(_CRLF, pos, pos + _MAX_CONTROL_LINE)
                if eol < 0:
                    partial = end - pos < _MAX_CONTROL_LINE
                    break
                args = view[pos + skip : eol].split()
                try:
                    if with_headers:
                        if len(args) == 5:
                            subject, sid_b, reply, hsize_b, size_b = args
                        elif len(args) == 4:
                            subject, sid_b, hsize_b, size_b = args
                            reply = b""
                        else:
                            break
                        hsize = int(hsize_b)
                    else:
                        if len(args) == 4:
                            subject, sid_b, reply, size_b = args
                        elif len(args) == 3:
                            subject, sid_b, size_b = args
                            reply = b""
                        else:
                            break
                        hsize = 0
                    sid, size = int(sid_b), int(size_b)
                except ValueError:
                    break  # nats-py's parser reports it
                if not 0 <= hsize <= size:
                    break
                start = eol + 2
                if end < start + size + 2:
                    partial = True  # the rest of this frame is in a later read
                    break
                headers = view[start : start + hsize]
                payload = view[start + hsize : start + size]
                pos = start + size + 2
                handler = fast.get(sid)
                if handler is not None:
                    delivered += 1
                    delivered_bytes += len(payload)
                    try:
                        handler(subject, reply, payload, headers)
                    except Exception as exc:  # a handler bug must not kill the connection's reader
                        log.error("fast_handler_failed", error=repr(exc))
                    continue
                await nc._process_msg(sid, subject, reply, payload, headers or None)
                if self.buf is not buf:
                    return  # the client reset the parser (a reconnect) while it was delivering
        finally:
            if delivered:
                stats: dict[str, int] = nc.stats
                stats["in_msgs"] += delivered
                stats["in_bytes"] += delivered_bytes
        # What is left waits for the next read, or for nats-py's parser.
        buf[:] = view[pos:]
        if buf and not partial:
            await super().parse()

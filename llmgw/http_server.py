"""HTTP/1.1 connection handling for every listener llmgw runs: a deadline on request heads,
quiet 400s, bodies taken as sent.

aiohttp's server has no limit on how long a request's head (request line and headers) may
take to arrive, nor on how long a new connection may stay silent before it sends one (its
keep-alive timeout, 3630 s, is all): a client sending one header byte every few seconds,
or none at all, holds a connection, its file descriptor and buffers, for as long as it
likes. Here a connection's first head must be complete within the listener's head timeout
of the connection's accept, and each later head (on a kept-alive connection) within the
timeout of its first byte; a late head gets a 408 and the connection is closed, a
connection that sent nothing is closed without an answer. Between requests a kept-alive
connection may stay idle for aiohttp's keep-alive timeout.

aiohttp answers a request that is not valid HTTP with its parser's message, which quotes
the offending line (an `Authorization` header with its key included), and logs it with a
traceback. Here the answer is a JSON 400 naming only the kind of problem, and the log line
names the client and the kind, never the bytes.

aiohttp inflates a request body sent with a `Content-Encoding` (gzip, deflate, br) as it
is read, and reads whatever a handler left unread before the connection's next request,
even on a GET: a megabyte of gzip, a gigabyte of zeros, held a listener's loop for
seconds, no credential needed. Here bodies are never inflated (what is drained is the
bytes sent), and a request whose body has a `Content-Encoding` other than identity gets a
415 (`compressed_body`) before any handler: llmgw's clients send none.

Every listener is served so, plain HTTP or HTTPS (TLS hands the handler the decrypted
bytes; the handler is made at the accept, before the handshake, so the first head's
deadline covers the handshake too, and `start_site` holds the handshake itself to it):
the router's front door and admin listener (`server`, aiohttp's low-level
server, through llmgw.router.protocol, which answers in OpenAI's error shape), the control
plane's admin API (llmgw.control.admin), the agent's admin listener (llmgw.agent.metrics)
and `llmgw console` (`app_runner`, for an aiohttp Application). Each listener's `Rules`
give its head timeout, its logger and how its error bodies look.

`Handler` subclasses aiohttp's request handler and reads its private attributes (`_waiter`,
`_messages`, `_loop`, the server's `_loop` and `_kwargs`), and `app_runner` overrides the
runner's `_make_server`: they are used only on the aiohttp versions in `KNOWN`, and
aiohttp's own server on any other, which serves the same requests without the head
deadline and with aiohttp's 400s (logged once per listener). Bodies are taken as sent and
compressed ones refused on every version: that needs only aiohttp's public arguments.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import msgspec
import structlog
from aiohttp import hdrs, http_exceptions, typedefs, web
from aiohttp.web_protocol import RequestHandler

KNOWN = ((3, 12), (3, 15))
"""aiohttp versions llmgw's readings of aiohttp's internals were written for (here and in
llmgw.router.aiohttp_direct): from the first, up to (not including) the second."""


def supported(version: str) -> bool:
    """Whether an aiohttp version string lies in `KNOWN`."""
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    return KNOWN[0] <= (major, minor) < KNOWN[1]


SUPPORTED = supported(aiohttp.__version__)
"""Whether `Handler`'s reading of aiohttp's internals was written for this aiohttp."""

ErrorBody = Callable[[str, str], bytes]
"""A listener's JSON error body from what the client is told and a code
(`request_timeout`, `bad_http_request`)."""


def plain_error(message: str, code: str) -> bytes:
    """`{"error": message}`, as the admin listeners and the console answer errors."""
    return msgspec.json.encode({"error": message})


@dataclass(frozen=True, slots=True)
class Rules:
    """How one listener holds its connections."""

    head_timeout_s: float
    """A connection's first request head must be complete this long after the accept, a
    later one this long after its first byte, or 408 (a silent connection: closed)."""
    log: structlog.typing.FilteringBoundLogger
    """The listener's logger: the late heads and malformed requests are its lines."""
    error_body: ErrorBody = plain_error
    late_headers: Callable[[str | None], Mapping[str, str]] | None = None
    """The headers a late head's 408 carries besides its own, given the `Origin` the part
    of the head that came names (None: it names none): the router's CORS headers. None: no
    more headers, and the part that came is not kept."""


def head_timeout_answer(rules: Rules, origin: str | None = None) -> bytes:
    """The whole 408 response sent when a request's head is late; `origin` is what the
    part of the head that came says in its `Origin` header (None: nothing)."""
    body = rules.error_body(
        f"the request headers did not arrive within {rules.head_timeout_s:g} s: send them at once",
        "request_timeout",
    )
    more = rules.late_headers(origin) if rules.late_headers is not None else {}
    lines = b"".join(f"{name}: {value}\r\n".encode() for name, value in more.items())
    return (
        b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n%s"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (lines, len(body), body)
    )


PARTIAL_HEAD_BYTES = 16_384
"""The most of a late head kept to find its `Origin` in (browsers send it among the
first headers)."""


def sent_origin(partial_head: bytes) -> str | None:
    """The value of the first whole `Origin` line in the part of a head that came; None
    when it has none (a line cut short is none: its value may be cut too). One pass over
    the lines, whatever a client puts in them: it runs on the event loop."""
    *whole, _cut_short = partial_head.split(b"\n")
    for line in whole[1:]:  # the first is the request line
        name, colon, value = line.removesuffix(b"\r").partition(b":")
        if colon and name.lower() == b"origin" and b"\r" not in value:
            return value.strip(b" \t").decode("latin-1")
    return None


COMPRESSED = "the request body is compressed (Content-Encoding): send it uncompressed"


def compressed(request: web.BaseRequest) -> bool:
    """Whether the request has a body sent with a content coding other than identity."""
    codings = request.headers.getall(hdrs.CONTENT_ENCODING, ())
    if not codings or not request.body_exists:
        return False
    return any(c.strip().lower() not in ("", "identity") for c in ",".join(codings).split(","))


async def _refuse_compressed(rules: Rules) -> web.Response:
    # In a 415, Accept-Encoding names the codings a request body may use (RFC 7694).
    return web.Response(
        status=415,
        body=rules.error_body(COMPRESSED, "compressed_body"),
        content_type="application/json",
        headers={hdrs.ACCEPT_ENCODING: "identity"},
    )


_Request = TypeVar("_Request", bound=web.BaseRequest)


def _unless_compressed(
    request: _Request,
    handler: Callable[[_Request], Awaitable[web.StreamResponse]],
    rules: Rules,
) -> Awaitable[web.StreamResponse]:
    """`handler`'s answer, or a 415 for a compressed body: the handler's own awaitable,
    not a coroutine around it, so that no frame of ours is resumed at each of its awaits."""
    if compressed(request):
        return _refuse_compressed(rules)
    return handler(request)


def _compressed_refused(rules: Rules) -> typedefs.Middleware:
    """An Application's middleware answering a compressed body with a 415."""

    @web.middleware
    async def refuse_compressed(
        request: web.Request, handler: typedefs.Handler
    ) -> web.StreamResponse:
        return await _unless_compressed(request, handler, rules)

    return refuse_compressed


def _parser_reason(exc: http_exceptions.BadHttpMessage) -> str:
    """The parser's fixed reason ("Invalid header value char"), without the bytes that
    its message quotes after it; "" when there is none."""
    head, sep, _ = str(exc.message).partition(":\n\n")
    reason = head.rsplit("\n", 1)[-1].strip()
    if not sep or len(reason) > 80 or not reason.isascii() or not reason.isprintable():
        return ""
    return reason


def bad_http_message(exc: http_exceptions.BadHttpMessage) -> tuple[str, str]:
    """(what the client is told, the problem's kind for the log), quoting nothing sent."""
    if isinstance(exc, http_exceptions.LineTooLong):
        return (
            "a request line or header is too long (the limit is 8190 bytes): send shorter headers",
            "line_too_long",
        )
    reason = _parser_reason(exc)
    if isinstance(exc, http_exceptions.InvalidHeader) or "header" in reason.lower():
        return (
            "a request header is malformed or holds a character HTTP does not allow"
            " (a control character, a bare CR or LF): fix the header",
            "invalid_header",
        )
    said = f" ({reason})" if reason else ""
    return (f"the request is not valid HTTP/1.1{said}: fix the client", "not_http")


_LINGER_S = 2.0
"""How long a connection answered with a 408 still reads (and drops) before it closes."""


class Handler(RequestHandler):
    """One client connection."""

    __slots__ = (
        "_accepted_at",
        "_draining_late",
        "_head_timer",
        "_heard",
        "_no_head_yet",
        "_partial_head",
        "_rules",
    )

    def __init__(self, manager: Any, *, rules: Rules, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._rules = rules
        # The server makes its handler at the accept, before a TLS handshake.
        self._accepted_at = self._loop.time()
        self._head_timer: asyncio.TimerHandle | None = None
        self._draining_late = False
        self._no_head_yet = True
        """No complete head has arrived on this connection yet."""
        self._heard = False
        """A byte has arrived on this connection."""
        self._partial_head = b""
        """What came of a head still awaited (kept only for `Rules.late_headers`)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        # The first head's deadline runs from the accept: a connection that never sends
        # a byte is closed then, not after aiohttp's hour of keep-alive.
        deadline = self._accepted_at + self._rules.head_timeout_s
        self._head_timer = self._loop.call_at(deadline, self._head_late)

    def _awaiting_head(self) -> bool:
        # start() waits on _waiter exactly while no complete request head is queued.
        waiter = self._waiter
        if waiter is None:
            # Bytes that come with the connection (uvloop reads them at accept) arrive
            # before start() first waits: they can only be the first head's. Without
            # this, a partial head sent at once, then silence, had no deadline.
            return self._no_head_yet and not self._messages
        return not waiter.done()

    def data_received(self, data: bytes) -> None:
        if self._draining_late:
            return  # answered with a 408: what still arrives is dropped
        self._heard = self._heard or bool(data)
        super().data_received(data)
        if self._messages:
            self._no_head_yet = False  # what follows a head may be its body
        if self._awaiting_head():
            # Part of a head: the deadline runs from its first byte (the first head's:
            # from the accept), not from each piece.
            if self._head_timer is None and data:
                timeout_s = self._rules.head_timeout_s
                self._head_timer = self._loop.call_later(timeout_s, self._head_late)
            room = PARTIAL_HEAD_BYTES - len(self._partial_head)
            if self._rules.late_headers is not None and room > 0:
                self._partial_head += data[:room]
        elif self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
            self._partial_head = b""

    def _head_late(self) -> None:
        self._head_timer = None
        if not self._awaiting_head() or self.transport is None:
            return
        peer = self.transport.get_extra_info("peername")
        if not self._heard:
            # Nothing asked, so nothing to answer: a client that opened a connection ahead
            # of need (a browser, a proxy's pool) reconnects when it has a request. Debug
            # only: such closes are routine, and a flood of them would drown the log.
            self._rules.log.debug(
                "connection_silent", peer=str(peer), timeout_s=self._rules.head_timeout_s
            )
            self.force_close()
            return
        self._rules.log.info(
            "request_head_timeout", peer=str(peer), timeout_s=self._rules.head_timeout_s
        )
        self.transport.write(head_timeout_answer(self._rules, sent_origin(self._partial_head)))
        # A lingering close: closing while the client's next header lines sit unread would
        # make the kernel answer with a reset, which can discard the 408 before the client
        # reads it. So: send the answer (and end our side, where the transport can: TLS's
        # cannot), read and drop what still comes for a moment, then close.
        self._draining_late = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._loop.call_later(_LINGER_S, self.force_close)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if not isinstance(exc, http_exceptions.BadHttpMessage):
            return super().handle_error(request, status, exc, message)
        said, kind = bad_http_message(exc)
        self._rules.log.info("bad_http_request", peer=str(request.remote), problem=kind)
        resp = web.Response(
            status=400,
            body=self._rules.error_body(said, "bad_http_request"),
            content_type="application/json",
        )
        resp.force_close()
        return resp


class Server(web.Server):
    """aiohttp's low-level server, making `Handler`s."""

    def __init__(self, *args: Any, rules: Rules, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rules = rules

    def __call__(self) -> RequestHandler:
        return Handler(self, loop=self._loop, rules=self._rules, **self._kwargs)


def _stock(rules: Rules) -> None:
    rules.log.warning(
        "request_handler_stock",
        aiohttp=aiohttp.__version__,
        reason="an aiohttp version llmgw's request handler was not written for: "
        "no deadline on request heads, and aiohttp's own answers to malformed requests",
    )


def server(
    handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
    *,
    rules: Rules,
    client_max_size: int,
    request_type: Callable[[Any], Callable[..., web.BaseRequest]] | None = None,
    **kwargs: Any,
) -> web.Server:
    """A low-level server (no Application): `Server` (head deadline, quiet 400s) on the
    aiohttp versions it was written for, aiohttp's own `web.Server` on any other; requests
    take bodies of up to `client_max_size` bytes, as sent (a compressed one: 415).
    `request_type`, given a request's parsed head, picks what makes its request object
    (`web.BaseRequest` or a subclass, called with its arguments); None: always BaseRequest."""
    loop = asyncio.get_running_loop()
    # A partial, not a closure: one Python call per request less on the router's hot path.
    guarded = functools.partial(_unless_compressed, handler=handler, rules=rules)
    kwargs["auto_decompress"] = False

    def make_request(
        message: Any, payload: Any, conn: Any, writer: Any, task: Any
    ) -> web.BaseRequest:
        make = web.BaseRequest if request_type is None else request_type(message)
        return make(message, payload, conn, writer, task, loop, client_max_size=client_max_size)

    kwargs["request_factory"] = make_request
    if SUPPORTED:
        return Server(guarded, rules=rules, **kwargs)
    _stock(rules)
    return web.Server(guarded, **kwargs)


class _AppRunner(web.AppRunner):
    """aiohttp's runner for an Application, serving it through `Server`."""

    __slots__ = ("_rules",)

    def __init__(self, app: web.Application, *, rules: Rules, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._rules = rules

    async def _make_server(self) -> web.Server:
        # aiohttp's own (the app started and frozen, its request factory and handler
        # arguments), remade as a `Server` with the same parts.
        stock = await super()._make_server()
        return Server(
            stock.request_handler,
            request_factory=stock.request_factory,
            handler_cancellation=stock.handler_cancellation,
            loop=stock._loop,
            rules=self._rules,
            **stock._kwargs,
        )


def app_runner(app: web.Application, *, rules: Rules, **kwargs: Any) -> web.AppRunner:
    """A runner for `app` (`kwargs` as aiohttp's `AppRunner` takes them) whose connections
    follow `rules` on the aiohttp versions `Server` was written for; aiohttp's own on any
    other. Either way bodies are taken as sent, and a compressed one gets a 415."""
    # Outermost: the 415 comes before any other check, as a low-level server's does.
    app.middlewares.insert(0, _compressed_refused(rules))
    kwargs["auto_decompress"] = False
    if SUPPORTED:
        return _AppRunner(app, rules=rules, **kwargs)
    _stock(rules)
    return web.AppRunner(app, **kwargs)


class _Site(web.SockSite):
    """aiohttp's site on a listening socket, whose TLS handshakes must end within
    `handshake_timeout_s`: aiohttp's own leaves them asyncio's default, a minute."""

    __slots__ = ("_handshake_timeout_s",)

    def __init__(
        self,
        runner: web.BaseRunner,
        sock: socket.socket,
        *,
        ssl_context: ssl.SSLContext | None,
        handshake_timeout_s: float,
    ) -> None:
        super().__init__(runner, sock, ssl_context=ssl_context)
        self._handshake_timeout_s = handshake_timeout_s

    async def start(self) -> None:
        # SockSite.start, with the handshake's timeout: BaseSite.start registers the site.
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        tls = self._ssl_context
        self._server = await asyncio.get_running_loop().create_server(
            server,
            sock=self._sock,
            ssl=tls,
            backlog=self._backlog,
            ssl_handshake_timeout=self._handshake_timeout_s if tls is not None else None,
        )


async def start_site(
    runner: web.BaseRunner,
    sock: socket.socket,
    *,
    rules: Rules,
    ssl_context: ssl.SSLContext | None = None,
) -> None:
    """Serve `runner` on the listening `sock`, over TLS with `ssl_context`: a TLS handshake
    must end within the head timeout (the first head's deadline, which it is part of),
    not asyncio's minute. On an aiohttp `Server` was not written for, aiohttp's own site."""
    if SUPPORTED:
        site: web.SockSite = _Site(
            runner, sock, ssl_context=ssl_context, handshake_timeout_s=rules.head_timeout_s
        )
    else:
        site = web.SockSite(runner, sock, ssl_context=ssl_context)
    await site.start()

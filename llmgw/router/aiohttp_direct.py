"""The relay's shortcuts through aiohttp, behind one guard.

A streamed answer's bytes leave from the engine connection's data callback
rather than from the handler's task, which would have to be woken for each
chunk. That takes four things aiohttp does not promise:

- `SSEResponse` sets the private `_send_headers_immediately`, so a stream's
  headers leave with its first bytes (one send, not two);
- `run_now` steps aiohttp's `prepare`, `write` and `write_eof` coroutines by
  hand, from a callback or a timer: as the relay calls them (a plain request,
  no compression, no signals, `drain=False`) they never wait;
- `write_chunk` writes HTTP/1.1 chunk frames straight onto the client's
  transport, past aiohttp's writer, once the response has started;
- the relay reads the request's transport to see whether the client keeps up.

They were written against aiohttp 3.12 to 3.14 (the range pyproject pins:
`llmgw.http_server.KNOWN`, which guards every listener's connection handler too).
`DIRECT` is True only on those versions; on any other, or when the operator sets
LLMGW_AIOHTTP_DIRECT=0, the relay uses plain awaited writes from the handler's task
instead: slower (a task wake-up and a send per chunk), never wrong. `explain` logs
why, once.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar, cast

import aiohttp
from aiohttp import web
from aiohttp.http import StreamWriter

from llmgw import logs
from llmgw.http_server import KNOWN, supported

log = logs.get("llmgw.router")

ENV = "LLMGW_AIOHTTP_DIRECT"


def _why_not(version: str, env: str) -> str:
    """Why the shortcuts are off ("" when they are on)."""
    if env.strip().lower() in ("0", "false", "no", "off"):
        return f"turned off by {ENV}={env}"
    if not supported(version):
        low, high = KNOWN
        return (
            f"aiohttp {version} is outside {low[0]}.{low[1]} to {high[0]}.{high[1] - 1},"
            " the versions the router's direct writes were written for"
        )
    return ""


WHY_NOT = _why_not(aiohttp.__version__, os.environ.get(ENV, ""))
DIRECT = not WHY_NOT
_explained = False


def explain() -> None:
    """Log, once per process, that streams go through awaited writes and why."""
    global _explained
    if WHY_NOT and not _explained:
        _explained = True
        log.warning("aiohttp_direct_writes_off", reason=WHY_NOT, aiohttp=aiohttp.__version__)


class SSEResponse(web.StreamResponse):
    """A streamed response whose headers leave with its first bytes: one send, not two.

    (aiohttp's web.Response buffers headers the same way; StreamResponse sends them at
    prepare() unless told otherwise.) On loopback every send also runs the receiver's
    TCP path in the sender's context, so saved sends are saved CPU.
    """

    _send_headers_immediately = False


def sse_response(headers: dict[str, str]) -> web.StreamResponse:
    """A 200 stream response: `SSEResponse` on the direct path, aiohttp's own otherwise."""
    cls = SSEResponse if DIRECT else web.StreamResponse
    return cls(status=200, headers=headers)


_T = TypeVar("_T")


def run_now(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run a coroutine that does not wait to its end, here and now; one that would
    wait is closed and raises RuntimeError."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return cast(_T, stop.value)
    coro.close()
    raise RuntimeError(f"{coro!r} waited where it was expected not to")


def write_now(resp: web.StreamResponse, request: web.BaseRequest, data: bytes) -> None:
    """Start `resp` if need be and write `data`, here and now, from a protocol callback
    or a timer. Raises ConnectionResetError if the client left."""
    writer = run_now(resp.prepare(request))
    if not isinstance(writer, StreamWriter):
        raise RuntimeError(f"unexpected response writer {writer!r} (the response ended?)")
    run_now(writer.write(data, drain=False))


def end_now(resp: web.StreamResponse, request: web.BaseRequest, data: bytes) -> None:
    """Write the last bytes and end `resp` here and now (see `write_now`): the caller
    knows aiohttp's write_eof has nothing to wait for."""
    run_now(resp.prepare(request))
    run_now(resp.write_eof(data))


def client_transport(request: web.BaseRequest) -> asyncio.WriteTransport | None:
    # uvloop's transports are not asyncio.Transport subclasses, only alike.
    return cast("asyncio.WriteTransport | None", request.transport)


def write_chunk(transport: asyncio.WriteTransport, data: bytes, chunked: bool) -> None:
    """The next piece of a started body, past aiohttp's writer: one HTTP/1.1 chunk frame
    (HTTP/1.0 has none: its body ends with the connection)."""
    if chunked:
        transport.write(b"%x\r\n%b\r\n" % (len(data), data))
    else:
        transport.write(data)

"""Writing a generation to its client: the whole body once it is done, or SSE chunks as
tokens come, with the fault plan's stalls and deaths where it puts them.

A handler waits on a future the engine loop resolves when its request has new
output (`wait`), then writes everything new in one write. Used by
`llmgw.sim.server`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from typing import Any

from aiohttp import web

from llmgw.sim import api, apis, bodies
from llmgw.sim.config import Faults
from llmgw.sim.engine import Request

_JSON = "application/json"


async def die(request: web.Request) -> None:
    """Abort the connection with a TCP RST, as a crashed engine would leave it."""
    transport = request.transport
    if transport is not None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()
    # handler_cancellation cancels this handler as the connection goes.
    raise asyncio.CancelledError


async def wait(req: Request) -> None:
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    req.waiter = fut
    try:
        await fut
    finally:
        req.waiter = None


def usage(req: Request, kind: str = "chat") -> dict[str, Any]:
    """The request's usage in the shape of its API."""
    counts = (req.num_prompt, req.num_generated, req.cached_tokens or 0)
    if kind == "responses":
        return apis.responses_usage(*counts)
    if kind == "messages":
        return apis.messages_usage(*counts)
    return bodies.usage(*counts)


def _format(p: api.Prepared, req: Request) -> Any:
    """The SSE framing of `p`'s API."""
    if p.kind == "responses":
        return apis.ResponsesFormat(p, req.rid, int(time.time()))
    if p.kind == "messages":
        return apis.MessagesFormat(p, req.rid, int(time.time()), req.num_prompt)
    return bodies.StreamFormat(p, req.rid, int(time.time()))


async def complete(
    request: web.Request, p: api.Prepared, req: Request, fault: Faults | None
) -> web.StreamResponse:
    while not req.finished:
        await wait(req)
    if fault is not None:
        if fault.stall_at in ("first_token", "mid_stream"):
            await asyncio.sleep(fault.stall_s)
        if fault.die_mid_stream:
            await die(request)
    text, finish = "".join(req.pieces), req.finish_reason or "stop"
    if p.kind in ("responses", "messages"):
        counts = (req.num_prompt, req.num_generated, req.cached_tokens or 0)
        body = apis.full_body(p, req.rid, int(time.time()), text, finish, counts)
    else:
        body = bodies.full_response(p, req.rid, int(time.time()), text, finish, usage(req))
    return web.Response(body=body, content_type=_JSON)


async def stream(
    request: web.Request, p: api.Prepared, req: Request, fault: Faults | None, *, zero: bool
) -> web.StreamResponse:
    """Stream `req`'s output as SSE; `zero`: the model has zero latency (see below)."""
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    # The client may leave between two writes, before handler cancellation gets
    # to us: not an error of the sim. `_generation` drops the request; aiohttp
    # notices the closed connection when it finishes the response.
    with contextlib.suppress(ConnectionResetError):
        await _stream_to(resp, request, p, req, fault, zero)
    return resp


async def _stream_to(
    resp: web.StreamResponse,
    request: web.Request,
    p: api.Prepared,
    req: Request,
    fault: Faults | None,
    zero: bool,
) -> None:
    await resp.prepare(request)
    # aiohttp holds the headers back until the first body write. A real engine
    # sends them at once, so a slow prefill or a long queue shows up as a late
    # first token rather than late headers; the sim does the same, except with
    # a zero-latency model, where the whole response (headers, every chunk,
    # the end) goes out in one write unless the request has to queue.
    flushed = False  # the headers are on the wire
    if not zero:
        await resp.write(b"")
        flushed = True
    fmt = _format(p, req)
    # The chat role chunk goes out with the first token, as vLLM sends it.
    opening = fmt.opening()
    pending = b""
    cut = _mid_stream_cut(fault)
    if fault is not None and fault.stall_at == "first_token":
        await resp.write(opening)
        opening = b""
        flushed = True
        await asyncio.sleep(fault.stall_s)
    sent = 0
    woken = not zero
    while True:
        emit = req.emit
        if emit > sent:
            pending += opening
            opening = b""
            if 0 <= cut < emit:
                pending += fmt.pieces(req.pieces[sent:cut])
                sent, cut = cut, -1
                assert fault is not None
                await _strike(request, resp, pending, fault)
                pending = b""
                flushed = True
                continue
            pending += fmt.pieces(req.pieces[sent:emit])
            sent = emit
        if req.finished:
            use = usage(req, p.kind) if p.include_usage else None
            closing = fmt.closing(req.finish_reason or "stop", use)
            await resp.write_eof(opening + pending + closing)
            return
        if pending:
            await resp.write(pending)
            pending = b""
            flushed = True
        elif woken and not flushed:
            # Woken with nothing to send: the request queues. Send the headers now.
            await resp.write(b"")
            flushed = True
        await wait(req)
        woken = True


def _mid_stream_cut(fault: Faults | None) -> int:
    """Where a mid-stream fault strikes, counted in streamed tokens; -1 for none."""
    if fault is not None and (fault.stall_at == "mid_stream" or fault.die_mid_stream):
        return fault.after_tokens
    return -1


async def _strike(
    request: web.Request, resp: web.StreamResponse, pending: bytes, fault: Faults
) -> None:
    """Send what streamed before the fault, then die or stall as it says."""
    await resp.write(pending)
    if fault.die_mid_stream:
        await die(request)
    await asyncio.sleep(fault.stall_s)

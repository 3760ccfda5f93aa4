"""The relay: an engine's SSE stream onto the client's response.

`ClientStream` is one request's side towards the client (its response once started, keep-alive
comments before the first token, the error event that ends a cut stream). `EngineStream` turns
the engine's bytes into whole events (given the indices an engine's Responses events lack:
`llmgw.router.responses_stream`), counts usage, moves the deadlines with each chunk and,
on the direct path (`llmgw.router.aiohttp_direct`), writes them to the client from the engine
connection's data callback. `relay` drives one attempt's stream. What the relay reports
(usage, the first token, a slow client, the gap between tokens) goes through `Hooks`, a narrow
protocol the dispatch loop implements.

Until the first token the request may still move to another endpoint (`Retry`): nothing has
reached the client. After it, a cut stream ends with an OpenAI error event (`EngineFault`),
never spliced onto another engine's answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Protocol

import aiohttp
from aiohttp import web

from llmgw import logs
from llmgw.core.profile import Deadlines, ModelProfile
from llmgw.router import aiohttp_direct, auth, requests, responses_stream, sse
from llmgw.router import upstream as upstream_http
from llmgw.router.deadlines import Deadline, Watchdog
from llmgw.router.errors import NOSNIFF, ClientGone, EngineFault, Retry
from llmgw.router.tracing import RequestTrace

log = logs.get("llmgw.router")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **NOSNIFF}
DONE = sse.DONE
KEEPALIVE = b": keep-alive\n\n"
MAX_EVENT_BYTES = 4 * 1024 * 1024
"""An upstream 'event' this long without a blank line is relayed as is rather than buffered."""
DIRECT_HIGH_WATER = 64 * 1024
"""Bytes waiting in the client's transport that take a stream off the direct path."""
END_NOW_MAX = 16 * 1024
"""The most bytes a stream's end is written with from the data callback (`EngineStream.sink`)."""
OPENERS_HELD = 64 * 1024  # a Responses stream's response.created repeats the request's tools
"""Opening events held back for the first token, at most this many bytes."""


class Hooks(Protocol):
    """What a relayed stream tells the rest of the router."""

    def usage(self, prof: ModelProfile, client: ClientStream, u: requests.Usage) -> None:
        """A usage went by: count what it adds to the totals (metrics, key buckets, cache)."""

    def first_token(self, model: str, after_s: float) -> None:
        """The first token reached the client, `after_s` after the request began."""

    def slow_client(self, model: str) -> None:
        """The client reads slower than the engine writes: awaited writes from here."""

    def inter_token(self, model: str, gap_s: float) -> None:
        """A finished stream's mean gap between chunks."""


class ClientStream:
    """Per-request relay state shared across attempts (the client response, once started)."""

    __slots__ = (
        "asked_out", "cache_reported", "cached_endpoint", "cached_predicted", "drop_usage",
        "failed_status", "keepalive", "keepalive_s", "keepalive_task", "kind", "loop",
        "loop_start", "principal", "prompt_chars", "request", "response", "rid", "start",
        "stream", "tokens", "trace", "usage_coming",
    )  # fmt: skip

    def __init__(
        self,
        request: web.BaseRequest,
        rid: str,
        start: float,
        *,
        kind: requests.Kind,
        stream: bool,
        drop_usage: bool,
        principal: auth.Principal | None,
        trace: RequestTrace | None = None,
        prompt_chars: int = 0,
        usage_coming: bool = True,
        asked_out: tuple[int, int, int] = (0, 1, 1),
    ) -> None:
        self.request = request
        self.trace = trace
        """The request's spans, when its trace is recorded (llmgw.router.tracing)."""
        self.rid = rid
        self.start = start
        self.kind = kind
        self.principal = principal
        self.tokens = (0, 0)
        """Prompt and completion tokens of the answer: the most the engine's usages said."""
        self.asked_out = asked_out  # tokens an answer may take (0: unsaid), answers, prompts
        self.prompt_chars = prompt_chars
        """Characters of the prompt's text (else of the body): its tokens' estimate."""
        self.usage_coming = usage_coming
        """A stream's engine was asked for its usage (else a cut one is not estimated)."""
        self.response: web.StreamResponse | None = None
        self.stream, self.drop_usage = stream, drop_usage
        self.failed_status = 0
        """The status metrics record for a stream that ended with an error event."""
        self.cached_predicted = -1
        """Prompt tokens predicted cached at the engine (-1: none), its id, compared yet."""
        self.cached_endpoint, self.cache_reported = "", False
        self.loop = asyncio.get_running_loop()
        # Deadlines run on the loop's clock; start was taken on time.monotonic (the same clock
        # under asyncio's default and uvloop), so the phases line up with the request's start.
        self.loop_start = self.loop.time() - (time.monotonic() - start)
        self.keepalive: asyncio.TimerHandle | None = None
        self.keepalive_task: asyncio.Task[None] | None = None
        self.keepalive_s = 0.0

    @property
    def started(self) -> bool:
        """Whether the response (a 200 stream) has begun: its status can no longer change."""
        return self.response is not None and self.response.prepared

    def _sse_response(self) -> web.StreamResponse:
        if self.response is None:
            resp = aiohttp_direct.sse_response(SSE_HEADERS)
            resp.headers["X-Request-Id"] = self.rid
            if self.kind == "messages":
                resp.headers["request-id"] = self.rid  # as errors.id_headers
            if self.request.version >= aiohttp.HttpVersion11:
                # What aiohttp does anyway for a body of unknown length, said up front: the
                # relay writes the next chunks itself (`EngineStream.sink`).
                resp.enable_chunked_encoding()
            self.response = resp
        return self.response

    async def prepare(self) -> web.StreamResponse:
        resp = self.response
        if resp is None:
            resp = self._sse_response()
        if not resp.prepared:
            try:
                await resp.prepare(self.request)
            except ConnectionResetError:
                raise ClientGone from None
        return resp

    def write_now(self, data: bytes) -> None:
        """Write to the client here and now, from a protocol callback or a timer (the
        direct path only). Raises ConnectionResetError if the client left."""
        resp = self.response
        aiohttp_direct.write_now(
            resp if resp is not None else self._sse_response(), self.request, data
        )

    def end_now(self, data: bytes) -> None:
        """Write the last bytes and end the response here and now (see `write_now`)."""
        resp = self.response
        aiohttp_direct.end_now(
            resp if resp is not None else self._sse_response(), self.request, data
        )

    def start_keepalive(self, every: float) -> None:
        """SSE comments every `every` seconds until the first token (for load balancers
        that close idle connections)."""
        self.keepalive_s = every
        if aiohttp_direct.DIRECT:
            self.keepalive = self.loop.call_later(every, self._keep_alive)
        else:
            self.keepalive_task = self.loop.create_task(self._keep_alive_awaited())

    def _keep_alive(self) -> None:
        self.keepalive = None
        try:
            self.write_now(KEEPALIVE)
        except ConnectionResetError:
            return  # the client left; its handler is being cancelled
        except Exception:  # a bug: never raise into the loop
            log.exception("keepalive_failed", request_id=self.rid)
            return
        self.keepalive = self.loop.call_later(self.keepalive_s, self._keep_alive)

    async def _keep_alive_awaited(self) -> None:
        """`_keep_alive` without the direct path: a task that awaits its writes."""
        while True:
            await asyncio.sleep(self.keepalive_s)
            try:
                await self.write(KEEPALIVE)
            except ClientGone:
                return  # the client left; its handler is being cancelled
            except Exception:  # a bug: logged here, not as a task nobody awaits
                log.exception("keepalive_failed", request_id=self.rid)
                return

    def stop_keepalive(self) -> None:
        if self.keepalive is not None:
            self.keepalive.cancel()
            self.keepalive = None
        if self.keepalive_task is not None:
            self.keepalive_task.cancel()
            self.keepalive_task = None

    async def write(self, data: bytes) -> None:
        resp = await self.prepare()
        try:
            await resp.write(data)
        except ConnectionResetError:
            raise ClientGone from None

    async def finish_with_error(self, message: str, type_: str, code: str, status: int) -> None:
        self.stop_keepalive()  # nothing may follow the end of the body
        self.failed_status = status
        resp = await self.prepare()
        with contextlib.suppress(ConnectionResetError):
            body = requests.api_error_body(self.kind, status, message, type_, code)
            await resp.write_eof(requests.error_event(self.kind, body))


class EngineStream:
    """One relayed stream: whole events out of the engine's bytes, usage counted, deadlines
    moved with each chunk, written to the client from the engine's data callback (`sink`)."""

    __slots__ = (
        "buf", "buffered", "chunked", "chunks", "client", "deadline", "drop", "endpoint", "events",
        "failed", "first", "gone", "held", "hooks", "idle", "loop", "prof", "repair", "t_first",
        "t_last", "tail", "total_at", "transport", "upstream",
    )  # fmt: skip

    def __init__(
        self,
        client: ClientStream,
        upstream: upstream_http.Response,
        prof: ModelProfile,
        hooks: Hooks,
        total_at: float,
        endpoint: str,
    ) -> None:
        self.client, self.endpoint, self.upstream = client, endpoint, upstream
        self.prof, self.hooks = prof, hooks
        self.drop = client.drop_usage
        self.loop = client.loop
        self.first = b""
        """Opening events (`sse.only_openers`), held until the first token comes."""
        self.buf: list[bytes] = []
        """The reads (`buffered` bytes) of an event not yet complete, joined once it is: not
        copied again with each read of an event that trickles in."""
        self.buffered = 0
        self.tail = b""
        """The last bytes relayed: a complete stream ends with [DONE]."""
        self.held = b""
        """Events ending in [DONE], kept to leave with the end of the body."""
        self.chunks = self.events = 0
        """Whole events relayed (not a usage-only one dropped): a cut stream's estimate."""
        self.t_first = 0.0
        """When the first token came (0: not yet, the request may still move elsewhere)."""
        self.t_last = 0.0
        self.idle, self.total_at = prof.deadlines.idle_s, total_at
        self.deadline: Deadline | None = None
        self.transport: asyncio.WriteTransport | None = None
        """The client's, once the response has started."""
        self.chunked = True
        self.failed = False
        """The direct path hit a bug (logged); the stream is cut."""
        self.gone = False
        """The client went away while the callback wrote to it."""
        self.repair = responses_stream.repair(client.kind, prof.engine)

    def take(self, data: bytes) -> bytes:
        """The whole events now complete (usage counted, a requested usage chunk dropped)."""
        if not data:
            return b""
        end = sse.events_end(self.buf[-1][-1:] if self.buf else b"", data)
        if end < 0 and self.buffered + len(data) <= MAX_EVENT_BYTES:
            self.buf.append(data)
            self.buffered += len(data)
            return b""
        if end < 0:
            end = len(data)  # no blank line for too long: relayed as it is
        head = data[:end] if end < len(data) else data
        out = b"".join((*self.buf, head)) if self.buf else head
        if end < len(data):
            self.buf, self.buffered = [data[end:]], len(data) - end
        elif self.buf:
            self.buf, self.buffered = [], 0
        at = out.find(sse.USAGE_KEY)
        if at >= 0:
            out, usages = sse.take_usage(out, at, drop=self.drop)
            for usage in usages:
                self.hooks.usage(self.prof, self.client, usage)
        if out and self.repair is not None:
            out = self.repair(out)
        if out:
            self.tail = out
            self.events += out.count(b"\n\n")
        return out

    def arrived(self, now: float) -> None:
        """A chunk came: count it and move the idle deadline past it."""
        self.chunks += 1
        self.t_last = now
        d = self.deadline
        if d is not None and d.when < self.total_at and not d.expired():
            d.reschedule(min(now + self.idle, self.total_at))

    def _first_token(self, data: bytes, now: float) -> bytes | None:
        """The bytes to relay once the first token is in (None: not yet, or too late)."""
        first = self.first + data if self.first else data
        # Held bytes are openers already: looking again at all with each read was quadratic.
        if len(first) < OPENERS_HELD and sse.only_openers(data):
            # A chat stream opens with a role-only chunk (vLLM sends it with the first
            # token, others at once), the other APIs with opening events: held back, so the
            # first-token deadline still covers the wait and the request can still move.
            self.first = first
            return None
        d = self.deadline
        if d is None or d.expired():
            return None  # the first-token deadline fired: the request moves on
        self.first = b""
        self.t_first = self.t_last = now
        self.chunks = 1
        d.reschedule(min(now + self.idle, self.total_at))  # from here: the idle gap
        self.client.stop_keepalive()
        self.hooks.first_token(self.prof.name, now - self.client.loop_start)
        if self.client.trace is not None:
            self.client.trace.first_token = time.monotonic()  # uvloop's `now`: coarse ms
        c = self.client
        if c.kind == "messages":  # an engine may leave its message_start out: written here
            first = sse.with_message_start(first, c.rid, self.prof.name, c.prompt_chars)
        return first

    def feed(self, data: bytes, now: float) -> bytes:
        """What to send the client now for `data` from the engine (b"": nothing yet)."""
        if self.t_first:
            self.arrived(now)
        else:
            first = self._first_token(data, now)
            if first is None:
                return b""
            data = first
        out = self.take(data)
        if out and self.held:
            out = self.held + out
            self.held = b""
        return out

    def sink(self, data: bytes) -> None:
        """The engine connection's data callback on the direct path: writes to the client
        here, without waking the handler."""
        try:
            out = self.feed(data, self.loop.time())
            if not out:
                return
            # Held up to END_NOW_MAX: an engine ending every read with [DONE] is not held.
            if out.endswith(DONE) and len(out) <= END_NOW_MAX:
                client = aiohttp_direct.client_transport(self.client.request)
                if (
                    self.upstream.at_eof()
                    and len(out) < END_NOW_MAX
                    and client is not None
                    and not client.is_closing()
                    and not client.get_write_buffer_size()
                ):
                    # The end: the last events and the end of the body leave together,
                    # now. (Nothing waits in the client's transport and this is small, so
                    # aiohttp's write_eof has nothing to wait for.)
                    self.client.end_now(out)
                    return
                self.held = out  # most likely the end: it leaves with the last chunk marker
                return
            t = self.transport
            if t is None:
                # The response starts: aiohttp's headers leave in the same send.
                self.client.write_now(out)
                resp = self.client.response
                self.chunked = bool(resp and resp.chunked)
                t = self.transport = aiohttp_direct.client_transport(self.client.request)
                if t is None:
                    raise ConnectionResetError("the client's connection is gone")
            elif t.is_closing():
                return  # the client left; its handler is being cancelled
            else:
                aiohttp_direct.write_chunk(t, out, self.chunked)
            if t.get_write_buffer_size() > DIRECT_HIGH_WATER:
                self.hooks.slow_client(self.prof.name)
                self.upstream.relay_to(None)
        except ConnectionResetError:
            self.gone = True
            self.upstream.relay_to(None)
        except Exception:  # a bug: never raise into the engine connection's callback
            log.exception("relay_failed")
            self.failed = True
            self.upstream.relay_to(None)


async def _direct(stream: EngineStream) -> tuple[str, str] | None:
    """The direct path: chunks leave from the data callback (`EngineStream.sink`); the
    handler wakes at the end, or when a slow client needs awaited writes. Returns the
    problem that cut the stream, if any."""
    upstream, client = stream.upstream, stream.client
    upstream.relay_to(stream.sink)
    try:
        early = upstream.take_pending()  # body bytes that came with the head
        if early:
            stream.sink(early)
        await upstream.wait_end()
    finally:
        upstream.relay_to(None)
    if stream.gone:
        raise ClientGone
    if stream.failed:
        return ("relay_error", "the router failed relaying the stream (a bug): see its log")
    if not stream.t_first:
        raise Retry("empty_stream", 502, "engine ended the stream before any token")
    # A slow client (or none of the above: the body is complete, and this reads
    # nothing): awaited writes, which wait for it.
    resp = await client.prepare()
    while True:
        chunk = await upstream.read_any()
        if not chunk:
            return None
        stream.arrived(stream.loop.time())
        out = stream.take(chunk)
        if out:
            # (`held` is empty: the sink gives up only right after a write, which takes it.)
            try:
                await resp.write(out)
            except ConnectionResetError:
                raise ClientGone from None


async def _awaited(stream: EngineStream) -> None:
    """Without the direct path: every chunk read and written from the handler's task."""
    upstream, client = stream.upstream, stream.client
    loop = stream.loop
    chunk = upstream.take_pending() or await upstream.read_any()
    while chunk:
        out = stream.feed(chunk, loop.time())
        if out:
            await client.write(out)
        chunk = await upstream.read_any()
    if not stream.t_first:
        raise Retry("empty_stream", 502, "engine ended the stream before any token")


async def relay(
    stream: EngineStream, watchdog: Watchdog, d: Deadlines, t0: float
) -> web.StreamResponse:
    """Relay one attempt's SSE stream; raises Retry while nothing reached the client,
    EngineFault when a started stream was cut (the client got an error event)."""
    upstream, client = stream.upstream, stream.client
    total_at = stream.total_at
    problem: tuple[str, str] | None = None
    try:
        async with watchdog.at(min(t0 + d.first_token_s, total_at)) as cm:
            stream.deadline = cm
            if aiohttp_direct.DIRECT:
                problem = await _direct(stream)
            else:
                await _awaited(stream)
    except TimeoutError:
        if not stream.t_first:
            why = f"engine sent no first token within {d.first_token_s} s"
            raise Retry("first_token_timeout", 504, why) from None
        if stream.deadline is not None and stream.deadline.when >= total_at:
            problem = ("total_timeout", f"the engine did not finish within {d.total_s} s")
        else:
            problem = ("idle_timeout", f"the engine sent nothing for {d.idle_s} s")
    except (upstream_http.UpstreamError, OSError) as exc:
        if not stream.t_first:
            raise Retry("upstream_error", 502, f"engine response failed: {exc}") from None
        problem = ("engine_disconnected", f"the engine's stream broke off: {exc}")
    if stream.chunks > 1:
        stream.hooks.inter_token(
            stream.prof.name, (stream.t_last - stream.t_first) / (stream.chunks - 1)
        )
    if problem is None and not sse.complete(stream.tail, client.kind):
        problem = ("engine_disconnected", "the engine ended the stream before it was complete")
    if problem is not None:
        log.warning("stream_cut", request_id=client.rid, endpoint=stream.endpoint,
                    reason=problem[0])  # fmt: skip
        upstream.close()
        if stream.held:
            # Whole events kept for the end of the body: the client gets them (with
            # [DONE]), then the error.
            resp = await client.prepare()
            with contextlib.suppress(ConnectionResetError):
                await resp.write(stream.held)
        await client.finish_with_error(
            problem[1], "server_error", problem[0], 504 if "timeout" in problem[0] else 502
        )
        raise EngineFault
    resp = await client.prepare()
    try:
        # The rest (for a fast engine: the whole answer, headers included) and the end
        # of the body, in one send.
        await resp.write_eof(stream.held)
    except ConnectionResetError:
        raise ClientGone from None
    return resp

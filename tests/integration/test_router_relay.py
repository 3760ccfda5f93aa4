"""The stream relay's two paths: chunks (the first token and the end included) straight
from the engine's connection to the client, and awaited writes for a client that reads
slower than the engine writes. Real `llmgw sim` engines and a real router; clients on raw
sockets, so what is checked is the bytes on the wire."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from aiohttp import web

from tests.integration.router_kit import Router, Sim
from tests.kit.threaded_http import ThreadedApp, engine_app

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def routed_sim(tmp: Path, *sim_args: str, stall_first_s: float = 0.0,
               **settings: Any) -> Iterator[Router]:  # fmt: skip
    """One `llmgw sim` (with `sim_args`) behind a router (with `settings`); both stopped
    afterwards."""
    sim = Sim.start("m", *sim_args)
    try:
        if stall_first_s:
            sim.faults(stall_at="first_token", stall_s=stall_first_s)
        router = Router.start(tmp, {"s": sim}, **settings)
        try:
            yield router
        finally:
            router.stop()
    finally:
        sim.stop()


def post_stream(url: str, *, tokens: int, version: str = "1.1", rcvbuf: int = 0,
                wait_s: float = 0.0) -> tuple[str, bytes]:  # fmt: skip
    """Send a streamed chat request; after `wait_s` without reading, read the whole answer.

    Returns the response head and the body as sent (still chunked when it was)."""
    parts = urlsplit(url)
    body = json.dumps({
        "model": "m", "messages": [{"role": "user", "content": "relay"}], "stream": True,
        "max_tokens": tokens, "stream_options": {"include_usage": True},
    }).encode()  # fmt: skip
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(30)
    s.connect((parts.hostname, parts.port))
    s.sendall(
        f"POST /v1/chat/completions HTTP/{version}\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n".encode()
        + body
    )
    time.sleep(wait_s)
    data = bytearray()
    while chunk := s.recv(65536):
        data += chunk
    s.close()
    head, _, rest = bytes(data).partition(b"\r\n\r\n")
    return head.decode("latin-1"), rest


def dechunk(body: bytes) -> bytes:
    """HTTP/1.1 chunked framing, strictly: every size line, every CRLF, the last chunk."""
    out = bytearray()
    pos = 0
    while True:
        end = body.index(b"\r\n", pos)
        size = int(body[pos:end], 16)
        pos = end + 2
        if size == 0:
            assert body[pos:] == b"\r\n", "bytes after the last chunk"
            return bytes(out)
        out += body[pos : pos + size]
        assert body[pos + size : pos + size + 2] == b"\r\n", "a chunk without its CRLF"
        pos += size + 2


def events(sse: bytes) -> list[dict[str, object] | str]:
    assert sse.endswith(b"\n\n")
    out: list[dict[str, object] | str] = []
    for event in sse[:-2].split(b"\n\n"):
        assert event.startswith(b"data: "), event[:80]
        payload = event[6:]
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def check_complete(evs: list[dict[str, object] | str], tokens: int) -> None:
    """One engine's whole answer: every token, the usage chunk, [DONE] last, no error."""
    assert evs[-1] == "[DONE]"
    objs = [e for e in evs[:-1] if isinstance(e, dict)]
    assert len(objs) == len(evs) - 1
    assert not [e for e in objs if "error" in e]
    assert len({e["id"] for e in objs}) == 1  # never spliced from two answers
    usage = [e["usage"] for e in objs if e.get("usage")]
    assert len(usage) == 1
    assert usage[0]["completion_tokens"] == tokens  # type: ignore[index]
    content = [e for e in objs if _content(e)]
    assert len(content) == tokens


def _content(event: dict[str, Any]) -> str:
    return str(event["choices"][0]["delta"].get("content") or "") if event["choices"] else ""


FAST_TOKENS = ("--decode-base-ms", "5", "--eos-min-tokens", "400")
"""A token every 5 ms: each one its own chunk, relayed on the direct path."""


def test_a_stream_in_many_chunks_arrives_whole_and_framed(tmp_path: Path) -> None:
    with routed_sim(tmp_path, *FAST_TOKENS) as router:
        head, body = post_stream(router.url, tokens=60)
        m = router.metrics()
    assert head.startswith("HTTP/1.1 200")
    assert "transfer-encoding: chunked" in head.lower()
    check_complete(events(dechunk(body)), 60)
    assert m['llmgw_router_requests_total{model="m",status="200"}'] == 1
    assert m['llmgw_router_tokens_total{direction="out",model="m"}'] == 60
    assert m['llmgw_router_inter_token_latency_seconds_count{model="m"}'] == 1
    assert m.get('llmgw_router_slow_clients_total{model="m"}', 0) == 0


def test_a_client_that_reads_late_gets_the_whole_stream(tmp_path: Path) -> None:
    """~6 MB of events while the client reads nothing for a while: the kernel's buffers
    (up to 4 MB here) fill, the stream leaves the direct path, and every byte still
    arrives, in order."""
    big = ("--eos-min-tokens", "40000", "--eos-max-tokens", "40000", "--max-model-len",
           "65536", "--num-blocks", "8192")  # fmt: skip
    with routed_sim(tmp_path, *big) as router:
        head, body = post_stream(router.url, tokens=36000, rcvbuf=4096, wait_s=3.0)
        slow = router.metrics().get('llmgw_router_slow_clients_total{model="m"}', 0)
    assert head.startswith("HTTP/1.1 200")
    check_complete(events(dechunk(body)), 36000)
    assert slow == 1


def test_an_http_1_0_client_gets_an_unchunked_stream(tmp_path: Path) -> None:
    with routed_sim(tmp_path, *FAST_TOKENS) as router:
        head, body = post_stream(router.url, tokens=30, version="1.0")
    assert head.startswith(("HTTP/1.0 200", "HTTP/1.1 200"))
    assert "chunked" not in head.lower()
    check_complete(events(body), 30)


class BurstEngine(ThreadedApp):
    """An engine (aiohttp, on its own thread) that stays silent past the router's keep-alive
    interval, then sends its tokens back to back, one write each."""

    def __init__(
        self, tokens: int, *, silence_s: float = 0.3, hang_s: float = 0.0, opener: bool = False,
        abort: bool = False,
    ) -> None:  # fmt: skip
        self.tokens = tokens
        self.silence_s = silence_s
        self.hang_s = hang_s
        """After [DONE], this long without ending the body (a wedged engine)."""
        self.opener = opener
        """Open with a role-only chunk; with no tokens, end the body right after it."""
        self.abort = abort
        """With no tokens, drop the connection after the opener (the body never ends)."""
        self.requests = 0
        super().__init__(engine_app(self._chat))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.requests += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if self.opener:
            opener = {"index": 0, "delta": {"role": "assistant", "content": ""}}
            chunk = {"id": "b", "object": "chat.completion.chunk", "choices": [opener]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if not self.tokens:
                if self.abort:
                    assert request.transport is not None
                    request.transport.close()  # a crashed engine: no last chunk
                    return resp
                await resp.write_eof()  # a broken engine: the stream ends with no token
                return resp
        await asyncio.sleep(self.silence_s)
        for i in range(self.tokens):
            choice = {"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}
            chunk = {"id": "b", "object": "chat.completion.chunk", "choices": [choice]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if self.hang_s:
            await asyncio.sleep(0.05)  # [DONE] comes on its own, on the direct path
        await resp.write(b"data: [DONE]\n\n")
        await asyncio.sleep(self.hang_s)
        await resp.write_eof()
        return resp


def test_tokens_that_come_after_keepalive_comments_follow_them_in_order(tmp_path: Path) -> None:
    """Keep-alive comments go out from a timer while the first token is awaited; the first
    token then comes in a burst of 300 writes. The comments, then every token in order."""
    engine = BurstEngine(300)
    try:
        router = Router.start(tmp_path, {"s": engine.url}, keepalive_s=0.05)
        try:
            # Three times: how the burst splits into reads is a matter of timing.
            answers = [post_stream(router.url, tokens=300) for _ in range(3)]
        finally:
            router.stop()
    finally:
        engine.stop()
    for head, body in answers:
        assert head.startswith("HTTP/1.1 200")
        sse = dechunk(body)
        comments = sse[: sse.index(b"data: ")]
        assert comments.count(b": keep-alive\n\n") >= 3
        evs = events(sse[len(comments) :])
        assert evs[-1] == "[DONE]"
        assert "".join(_content(e) for e in evs[:-1] if isinstance(e, dict)) == "".join(
            f"t{i} " for i in range(300)
        )


def test_keepalive_comments_end_at_the_first_token(tmp_path: Path) -> None:
    """Comments keep the connection open while the first token is awaited, and stop with
    it: going on, they fell between a slow engine's tokens and, once its stream ended,
    after the end of the body."""
    slow = ("--decode-base-ms", "60", "--eos-min-tokens", "400")
    with routed_sim(tmp_path, *slow, stall_first_s=0.5, keepalive_s=0.05) as router:
        head, body = post_stream(router.url, tokens=10)
    assert head.startswith("HTTP/1.1 200")
    sse = dechunk(body)
    first = sse.index(b"data: ")
    assert sse[:first].count(b": keep-alive\n\n") >= 2
    assert b": keep-alive" not in sse[first:]
    check_complete(events(sse[first:]), 10)


def test_an_engine_that_wedges_after_done_still_delivers_the_stream(tmp_path: Path) -> None:
    """[DONE] reached the router but the body never ends: at the idle deadline the client
    has every token and [DONE], then the idle-timeout error event."""
    engine = BurstEngine(20, silence_s=0.0, hang_s=2.0)
    try:
        deadlines = {"idle_s": 0.5, "total_s": 30}
        router = Router.start(
            tmp_path, {"s": engine.url}, models=[{"name": "m", "deadlines": deadlines}]
        )
        try:
            _, body = post_stream(router.url, tokens=20)
        finally:
            router.stop()
    finally:
        engine.stop()
    evs = events(dechunk(body))
    assert evs[-2] == "[DONE]"
    assert evs[-1]["error"]["code"] == "idle_timeout"  # type: ignore[index]
    assert "".join(_content(e) for e in evs[:-2] if isinstance(e, dict)) == "".join(
        f"t{i} " for i in range(20)
    )


@pytest.mark.parametrize("abort", [False, True], ids=["ended", "dropped"])
@pytest.mark.parametrize("direct", ["1", "0"], ids=["direct", "awaited"])
def test_a_stream_that_ends_before_its_first_token_moves_to_another_engine(
    tmp_path: Path, direct: str, abort: bool
) -> None:
    """An engine opens the stream with the role-only chunk and ends it (or drops its
    connection) with no token. Nothing has reached the client (the opener is held back for
    the first token), so the request moves to the healthy engine and the client gets its
    whole answer; on either path the relay writes by."""
    broken = BurstEngine(0, opener=True, abort=abort)
    sim = Sim.start("m", "--eos-min-tokens", "400")
    try:
        env = {"LLMGW_AIOHTTP_DIRECT": direct}
        router = Router.start(tmp_path, {"a": broken.url, "b": sim}, env=env)
        try:
            answers = [post_stream(router.url, tokens=12) for _ in range(6)]
            m = router.metrics()
        finally:
            router.stop()
    finally:
        broken.stop()
        sim.stop()
    assert broken.requests >= 1
    reason = "upstream_error" if abort else "empty_stream"
    assert m[f'llmgw_router_retries_total{{model="m",reason="{reason}"}}'] == broken.requests
    for head, body in answers:
        assert head.startswith("HTTP/1.1 200")
        check_complete(events(dechunk(body)), 12)

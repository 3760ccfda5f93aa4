"""How many streamed requests per second one `llmgw sim` process sustains.

    .venv/bin/python tests/bench/bench_sim.py [--requests 20000] [--concurrency 64]
        [--tokens 16] [--url http://127.0.0.1:PORT] [--client raw|aiohttp]

Starts a sim with a zero-latency model (unless --url points at one already
running), sends a bounded number of streamed chat completions of `--tokens`
output tokens each over keep-alive connections, checks that every response has
exactly that many token chunks and ends with `data: [DONE]`, and prints
requests/s, tokens/s and latency percentiles (time to first token, end to end).

The default client is a minimal HTTP/1.1 client on asyncio protocols: a load
generator in Python must cost less than the server it measures, and aiohttp's
client costs about as much as the sim does per request (`--client aiohttp`
shows it). The goal is >= 2,000 requests/s per sim process, so that the sim is
never the bottleneck of a router benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from urllib.parse import urlsplit

import uvloop

from llmgw.sim.testing import SimProcess


class _Conn(asyncio.Protocol):
    """One keep-alive connection that runs one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.done: asyncio.Future[bytes] | None = None
        self.t_first = 0.0
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport subclass

    def data_received(self, data: bytes) -> None:
        if not self.t_first and b'"content":"' in data:
            self.t_first = time.perf_counter()
        self.buf += data
        # A chunked response ends with the zero-length chunk.
        if self.buf.endswith(b"\r\n0\r\n\r\n") and self.done is not None and not self.done.done():
            self.done.set_result(bytes(self.buf))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError(f"connection lost: {exc}"))
        if not self.closed.done():
            self.closed.set_result(None)

    async def request(self, raw: bytes) -> tuple[float, float, bytes]:
        assert self.transport is not None
        self.buf.clear()
        self.t_first = 0.0
        self.done = asyncio.get_running_loop().create_future()
        t0 = time.perf_counter()
        self.transport.write(raw)
        body = await self.done
        t1 = time.perf_counter()
        return self.t_first - t0, t1 - t0, body


def _raw_request(host: str, port: int, tokens: int, i: int) -> bytes:
    body = json.dumps(
        {
            "model": "sim",
            "messages": [{"role": "user", "content": f"request {i}: say something"}],
            "max_tokens": tokens,
            "stream": True,
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


def _check(body: bytes, tokens: int) -> None:
    # One role chunk, `tokens` content chunks, the finish chunk, [DONE].
    content = body.count(b'"delta":{"content":')
    if content != tokens or b"data: [DONE]" not in body or not body.startswith(b"HTTP/1.1 200"):
        raise AssertionError(f"bad response ({content} token chunks): {body[:300]!r}")


async def _run_raw(
    url: str, requests: int, concurrency: int, tokens: int
) -> tuple[float, list[float], list[float]]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    loop = asyncio.get_running_loop()
    payloads = [_raw_request(host, port, tokens, i) for i in range(64)]
    ttft: list[float] = []
    e2e: list[float] = []
    next_i = 0

    async def worker() -> None:
        nonlocal next_i
        _, conn = await loop.create_connection(_Conn, host, port)
        try:
            while next_i < requests:
                i = next_i
                next_i += 1
                first, total, body = await conn.request(payloads[i % len(payloads)])
                _check(body, tokens)
                ttft.append(first)
                e2e.append(total)
        finally:
            assert conn.transport is not None
            conn.transport.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - t0, ttft, e2e


async def _run_aiohttp(
    url: str, requests: int, concurrency: int, tokens: int
) -> tuple[float, list[float], list[float]]:
    import aiohttp

    ttft: list[float] = []
    e2e: list[float] = []
    next_i = 0

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as http:

        async def worker() -> None:
            nonlocal next_i
            while next_i < requests:
                i = next_i
                next_i += 1
                payload = {
                    "model": "sim",
                    "messages": [{"role": "user", "content": f"request {i}"}],
                    "max_tokens": tokens,
                    "stream": True,
                }
                t0 = time.perf_counter()
                first = 0.0
                chunks = []
                async with http.post(url + "/v1/chat/completions", json=payload) as r:
                    async for line in r.content:
                        if not first and line.startswith(b'data: {"id"') and b'"content":"' in line:
                            first = time.perf_counter() - t0
                        chunks.append(line)
                body = b"HTTP/1.1 200 " + b"".join(chunks)
                _check(body, tokens)
                ttft.append(first)
                e2e.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - t0, ttft, e2e


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux /proc)."""
    import os

    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(p / 100 * len(values)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2_000)
    ap.add_argument("--url", default="", help="an already running sim (default: start one)")
    ap.add_argument("--client", choices=["raw", "aiohttp"], default="raw")
    args = ap.parse_args()

    sim = None if args.url else SimProcess.start("--max-num-seqs", "1024")
    url = args.url or (sim.url if sim else "")
    run = _run_raw if args.client == "raw" else _run_aiohttp
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(run(url, args.warmup, args.concurrency, args.tokens))
            cpu0 = _cpu_s(sim.proc.pid) if sim else 0.0
            elapsed, ttft, e2e = runner.run(run(url, args.requests, args.concurrency, args.tokens))
            cpu = _cpu_s(sim.proc.pid) - cpu0 if sim else 0.0
    finally:
        if sim is not None:
            sim.stop()
    rps = len(e2e) / elapsed
    ms = 1000.0
    print(
        f"llmgw sim, zero-latency model, {args.tokens} tokens per streamed request, "
        f"{args.concurrency} connections, {args.client} client"
    )
    print(f"  requests: {len(e2e)} in {elapsed:.2f} s")
    print(f"  throughput: {rps:,.0f} requests/s, {rps * args.tokens:,.0f} tokens/s")
    print(
        f"  ttft ms: p50 {_pct(ttft, 50) * ms:.2f}  p90 {_pct(ttft, 90) * ms:.2f}  "
        f"p99 {_pct(ttft, 99) * ms:.2f}"
    )
    print(
        f"  e2e  ms: p50 {_pct(e2e, 50) * ms:.2f}  p90 {_pct(e2e, 90) * ms:.2f}  "
        f"p99 {_pct(e2e, 99) * ms:.2f}  mean {statistics.fmean(e2e) * ms:.2f}"
    )
    if cpu:
        # On a shared machine requests/s depends on the neighbours; requests per
        # CPU-second of the sim process is what one dedicated core would sustain.
        print(f"  sim process CPU: {cpu:.2f} s, {len(e2e) / cpu:,.0f} requests per CPU-second")
    if rps < 2000:
        print("  below the 2,000 requests/s goal", file=sys.stderr)


if __name__ == "__main__":
    main()

"""Benchmark of the router's HTTP/1.1 response framing: llhttp (httptools) against plain Python.

Run: .venv/bin/python -m tests.bench.bench_http1 [--iterations 20000] [--repeats 5]

Frames two responses, each many times over, with both implementations of
`llmgw.router.http1` side by side in one run, and prints microseconds per response (the
best of the repeats, process CPU time; the two sides take turns):

- an SSE stream of 16 chunked events, fed as an engine's writes arrive: the head in one
  read, then one read per event, the last with the terminating chunk;
- a JSON answer with Content-Length, head and body in one read.

Each is measured on the parser alone (`feed` and `reset`, as for a kept-alive
connection) and through the engine connection (`upstream._Conn.data_received`, body
bytes going to a sink, as the relay takes them).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable

from llmgw.router import http1, upstream

HEAD_SSE = (
    b"HTTP/1.1 200 OK\r\ndate: Tue, 01 Dec 2026 12:00:00 GMT\r\nserver: uvicorn\r\n"
    b"content-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
)
EVENT = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1764590400,'
    b'"model":"llama","choices":[{"index":0,"delta":{"content":" token"},'
    b'"finish_reason":null}]}\n\n'
)


def sse_reads() -> list[bytes]:
    frame = b"%x\r\n%s\r\n" % (len(EVENT), EVENT)
    reads = [HEAD_SSE] + [frame] * 15
    reads.append(frame + b"0\r\n\r\n")
    return reads


def json_reads() -> list[bytes]:
    body = b'{"id":"chatcmpl-1","object":"chat.completion","choices":[{"message":' + (
        b'{"role":"assistant","content":"' + b"word " * 60 + b'"}}]}'
    )
    return [
        b"HTTP/1.1 200 OK\r\ndate: Tue, 01 Dec 2026 12:00:00 GMT\r\nserver: uvicorn\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    ]


def parser_loop(
    cls: type[http1.PyParser | http1.LlhttpParser], reads: list[bytes]
) -> Callable[[int], None]:
    p = cls()

    def run(n: int) -> None:
        for _ in range(n):
            p.reset()
            for r in reads:
                p.feed(r)
            assert p.ended

    return run


class _Transport:
    def abort(self) -> None:
        raise AssertionError("the benchmark's responses are valid")

    def get_extra_info(self, name: str) -> None:
        return None


def conn_loop(
    cls: type[http1.PyParser | http1.LlhttpParser], reads: list[bytes]
) -> Callable[[int], None]:
    loop = asyncio.new_event_loop()
    old = upstream._Conn.parser_class
    upstream._Conn.parser_class = cls
    try:
        c = upstream._Conn(loop)
    finally:
        upstream._Conn.parser_class = old
    c.connection_made(_Transport())  # type: ignore[arg-type]
    got: list[bytes] = []

    def run(n: int) -> None:
        for _ in range(n):
            c._reset()
            c.expecting = True
            c.sink = got.append
            for r in reads:
                c.data_received(r)
            assert c.done
            assert c.reusable
            got.clear()

    return run


def best_us(runs: list[Callable[[int], None]], iterations: int, repeats: int) -> list[float]:
    """The best time per response of each run; the runs take turns, so that a busy
    machine's slow moments fall on both sides alike."""
    for run in runs:
        run(max(1, iterations // 10))  # warm up
    best = [float("inf")] * len(runs)
    for _ in range(repeats):
        for i, run in enumerate(runs):
            t0 = time.process_time()
            run(iterations)
            best[i] = min(best[i], time.process_time() - t0)
    return [b / iterations * 1e6 for b in best]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    sides = [("plain Python", http1.PyParser), ("llhttp (httptools)", http1.LlhttpParser)]
    cases = [("16-event SSE stream", sse_reads()), ("JSON, Content-Length", json_reads())]
    print(f"µs per response, best of {args.repeats} x {args.iterations}, CPU time")
    print(f"{'response':<24} {'layer':<16}" + "".join(f"{name:>20}" for name, _ in sides))
    for label, reads in cases:
        for layer, make in (("parser", parser_loop), ("connection", conn_loop)):
            runs = [make(cls, reads) for _, cls in sides]
            figures = best_us(runs, args.iterations, args.repeats)
            print(f"{label:<24} {layer:<16}" + "".join(f"{f:>20.2f}" for f in figures))


if __name__ == "__main__":
    main()

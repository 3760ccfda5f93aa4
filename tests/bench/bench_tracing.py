"""What tracing costs the router, measured side by side on one machine in one run:

    .venv/bin/python -m tests.bench.bench_tracing              # ~5 minutes on 2 cores
    .venv/bin/python -m tests.bench.bench_tracing --quick      # a smoke run

Three `llmgw sim` engines (zero latency, 16 tokens per answer) and an OTLP/HTTP receiver
in this process that decodes every export. Each round starts three routers: one without
`traces` (tracing off); one with `traces: {sample_ratio: 0}`, on which the client's
`traceparent` decides (parent-based sampling); and one with `sample_ratio: 1`, which
records every request itself. The loads: tracing off, with and without the client sending
a sampled `traceparent` (which a router that does not trace still forwards to the engine);
the client-decided router with requests carrying none (configured, none sampled), 1 % of
them sampled by the client, and all of them; and the router that samples every request,
under the same traffic as tracing off. They take turns, in a rotating order; the figures
are the router process's CPU time per streamed request (from /proc) and TTFT p50, medians
over the rounds, and the median of each round's ratio to tracing off, and to tracing off
under the same client headers. And in process (measured first, printed last): what a
recorded request costs on its path and what its spans cost to encode in the exporter's
batches.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.bench_front_door import FAILED, Headers, load  # noqa: E402
from tests.integration.otlp_kit import Receiver  # noqa: E402
from tests.integration.router_kit import Router, Sim  # noqa: E402

OFF = "tracing off"
OFF_HEADERS = "tracing off, client headers"
"""Tracing off, the client sending every request a sampled `traceparent` (forwarded)."""


def none(_: int) -> dict[str, str]:
    return {}


def sampled(i: int) -> dict[str, str]:
    return {"traceparent": f"00-{i + 1:032x}-00f067aa0ba902b7-01"}


def one_in_100(i: int) -> dict[str, str]:
    return sampled(i) if i % 100 == 0 else {}


async def rounds(args: argparse.Namespace, sims: list[Sim], receiver: Receiver,
                 tmp: Path) -> None:  # fmt: skip
    eps = {f"e{i}": s for i, s in enumerate(sims)}
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "stream": True,
            "max_tokens": args.tokens}  # fmt: skip
    # Each target and the target with tracing off that the client's traffic is the same as.
    targets: dict[str, tuple[str, Headers, str]] = {
        OFF: ("off", none, OFF),
        OFF_HEADERS: ("off", sampled, OFF_HEADERS),
        "configured, none sampled": ("on", none, OFF),
        "1 % sampled by the client": ("on", one_in_100, OFF),
        "every request, by the client": ("on", sampled, OFF_HEADERS),
        "every request, by the router": ("all", none, OFF),
    }
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in targets}
    traces = {"endpoint": receiver.url, "sample_ratio": 0.0}
    every = {"endpoint": receiver.url, "sample_ratio": 1.0}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        for rnd in range(args.rounds):
            routers = {
                "off": Router.start(tmp, eps),
                "on": Router.start(tmp, eps, traces=traces),
                "all": Router.start(tmp, eps, traces=every),
            }
            try:
                for r in routers.values():
                    await load(http, r, sampled, 300, args.concurrency, body=body)  # warm-up
                order = list(targets.items())
                order = order[rnd % len(order) :] + order[: rnd % len(order)]
                for name, (which, headers, _) in order:
                    results[name].append(
                        await load(http, routers[which], headers, args.requests, args.concurrency,
                                   body=body)
                    )  # fmt: skip
            finally:
                for r in routers.values():
                    r.stop()
    shape = f"{args.requests} requests at {args.concurrency} concurrent, {args.rounds} rounds"
    print(f"\n1. router CPU per streamed request of {args.tokens} tokens, {shape} (medians)")
    print("  (vs off: the median over rounds of each round's ratio to tracing off in that")
    print("  round, loads being compared minutes apart on a machine whose speed drifts; same")
    print("  traffic: to tracing off under the same client headers, so that what the client's")
    print("  `traceparent` costs a router that only forwards it is not counted as tracing's)")
    print(f"  {'target':<30} {'CPU/request':>12} {'vs off':>8} {'rounds':>11} "
          f"{'same traffic':>13} {'rounds':>11} {'TTFT p50':>9}")  # fmt: skip
    for name, rows in results.items():
        c = statistics.median(x for x, _ in rows)
        t = statistics.median(y for _, y in rows)
        columns = ""
        for base in (OFF, targets[name][2]):
            off = [x for x, _ in results[base]]
            ratios = sorted(x / o - 1 for (x, _), o in zip(rows, off, strict=True))
            spread = f"{100 * ratios[0]:+.0f}..{100 * ratios[-1]:+.0f}%"
            columns += f" {100 * statistics.median(ratios):>+7.1f}% {spread:>11}"
            if base == targets[name][2] == OFF:
                columns += f" {'':>13} {'':>11}"
                break
        print(f"  {name:<30} {c * 1e6:>9.0f} us{columns} {t * 1e3:>6.2f} ms")
    if FAILED:
        print(f"  failed requests by status: {FAILED}")
    got = [s for s in receiver.spans if s.service == "llmgw-router"]
    print(f"  the receiver decoded {len(got)} router spans in {receiver.bodies} exports")


def in_process(n: int = 20_000) -> str:
    """A recorded request's share of the work, in microseconds: on its path, begin and the
    clock notes of one attempt; in the exporter's task, its spans encoded in a batch and
    the batch framed as one export."""
    from llmgw import otlp
    from llmgw.router.config import TracesConfig
    from llmgw.router.tracing import RequestTrace, Tracer

    tracer = Tracer(TracesConfig(endpoint="http://127.0.0.1:9"))
    headers = [sampled(i) for i in range(n)]
    ended: list[RequestTrace] = []
    count = 0
    t0 = time.perf_counter()
    for h in headers:
        t = tracer.begin(h, "rid", 1.0)
        assert t is not None
        t.admitted = 1.001
        t.attempt_begin("e0", "http://e0", "m", 1.002)
        t.headers()
        t.first_token = 1.01
        t.attempt_end("", 1.02)
        count = t.ended(1.03, kind="chat", model="m", status=200, tokens_in=5, tokens_out=16)
        ended.append(t)
    note = (time.perf_counter() - t0) / n * 1e6
    per_batch = max(1, tracer.exporter.batch // count)
    offset = time.time_ns() - time.monotonic_ns()
    t0 = time.perf_counter()
    for i in range(0, n, per_batch):
        parts = [t.encode_spans(offset) for t in ended[i : i + per_batch]]
        b"".join(otlp.encode_parts(parts, sum(map(len, parts)), "llmgw-router"))
    encode = (time.perf_counter() - t0) / n * 1e6
    return (f"\n2. in process, per recorded request ({count} spans): on its path {note:.1f} us; "
            f"encoded in the exporter's batches {encode:.1f} us")  # fmt: skip


async def main() -> None:
    ap = argparse.ArgumentParser()
    # /proc counts a process's CPU in 10 ms ticks: 1,500 requests of ~140 us are ~20 ticks,
    # +-5 % a round; 6,000 make it +-1.2 %.
    ap.add_argument("--requests", type=int, default=6000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16, help="tokens per answer (16: the worst case)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.rounds = 300, 1
    # First, on a fresh heap: after the rounds this process holds every decoded span, and
    # the loop's allocations read several times slower.
    in_process_line = in_process()
    receiver = Receiver()
    n = str(args.tokens)
    sims = [Sim.start("m", "--eos-min-tokens", n, "--eos-max-tokens", n) for _ in range(3)]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            await rounds(args, sims, receiver, Path(tmp))
        print(in_process_line)
    finally:
        for s in sims:
            s.stop()
        receiver.stop()


if __name__ == "__main__":
    asyncio.run(main())

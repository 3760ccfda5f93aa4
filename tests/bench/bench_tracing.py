"""What tracing costs the router, measured side by side on one machine in one run:

    .venv/bin/python -m tests.bench.bench_tracing              # ~1 minute on 2 cores
    .venv/bin/python -m tests.bench.bench_tracing --quick      # a smoke run

Three `llmgw sim` engines (zero latency, 16 tokens per answer) and an OTLP/HTTP receiver
in this process that decodes every export. Each round starts two routers: one without
`traces` (tracing off) and one with `traces: {sample_ratio: 0}`, on which the client's
`traceparent` decides (parent-based sampling): requests without one (configured, none
sampled), 1 % of requests sampled by the client, and every request sampled. The four
loads take turns, in a rotating order; the figures are the router process's CPU time per
streamed request (from /proc) and TTFT p50, medians over the rounds, and the median of
each round's ratio to tracing off. And in process (measured first, printed last): what a
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
    targets: dict[str, tuple[str, Headers]] = {
        "tracing off": ("off", none),
        "configured, none sampled": ("on", none),
        "1 % sampled": ("on", one_in_100),
        "every request sampled": ("on", sampled),
    }
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in targets}
    traces = {"endpoint": receiver.url, "sample_ratio": 0.0}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        for rnd in range(args.rounds):
            routers = {"off": Router.start(tmp, eps), "on": Router.start(tmp, eps, traces=traces)}
            try:
                for r in routers.values():
                    await load(http, r, sampled, 300, args.concurrency, body=body)  # warm-up
                order = list(targets.items())
                order = order[rnd % len(order) :] + order[: rnd % len(order)]
                for name, (which, headers) in order:
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
    print("  round: loads are compared minutes apart on a machine whose speed drifts)")
    off = [c for c, _ in results["tracing off"]]
    print(f"  {'target':<26} {'CPU/request':>12} {'vs off':>8} {'rounds':>16} {'TTFT p50':>10}")
    for name, rows in results.items():
        c = statistics.median(x for x, _ in rows)
        t = statistics.median(y for _, y in rows)
        ratios = sorted(x / o - 1 for (x, _), o in zip(rows, off, strict=True))
        spread = f"{100 * ratios[0]:+.0f}..{100 * ratios[-1]:+.0f}%"
        print(f"  {name:<26} {c * 1e6:>9.0f} us {100 * statistics.median(ratios):>+7.1f}% "
              f"{spread:>16} {t * 1e3:>7.2f} ms")  # fmt: skip
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

"""The console on a large log: time to display any point, and the page's size and load.

Run from the repository root:

    .venv/bin/python tests/bench/bench_console.py                  # 1,000,000 events
    .venv/bin/python tests/bench/bench_console.py --events 200000  # quicker

It starts a real nats-server (JetStream, file storage, mutual TLS), publishes the log of
tests/bench/bench_replay.py (64 nodes of 8 GPUs, 256 replicas cycling through restarts;
without its heartbeats, which a fleet's log holds only for their TTL of minutes; each
event signed by its owner), has a control identity attest it
as the leader does, and saves a snapshot of the folded state every `--snapshot-every`
events (a fleet's `snapshot: {every_events: 10000, keep: 100}` keeps as many). Then it
runs `llmgw console` as a real process, as an operator, and measures over HTTP, as the
page asks:

- `GET /api/fleet?at=SEQ` for `--points` points drawn uniformly over the whole log
  (p50, p99, max): the state rebuilt from the newest snapshot at or before the point
  plus the tail, with the page's whole view of it;
- the same by time (`at=@UNIX`), which first finds the point's sequence;
- the page itself (`GET /`: size, time) and its first view (`/api/fleet` live,
  `/api/events`): size and time.

Every point's answer is checked against a local fold of the log up to it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import structlog  # noqa: E402

from llmgw import bus  # noqa: E402
from llmgw.core import state  # noqa: E402
from tests.bench import bench_replay  # noqa: E402
from tests.e2e.console_kit import bearer, start_console  # noqa: E402
from tests.harness import TestNatsServer, TestPki, connect_as  # noqa: E402


def fetch(url: str) -> tuple[float, bytes]:
    started = time.perf_counter()
    with urllib.request.urlopen(
        urllib.request.Request(url, headers=bearer(url)), timeout=120
    ) as resp:
        body = resp.read()
        assert resp.status == 200, body[:300]
    return time.perf_counter() - started, body


def ms(values: list[float]) -> str:
    q = statistics.quantiles(values, n=100) if len(values) > 1 else values * 99
    p50, p99, top = statistics.median(values) * 1e3, q[98] * 1e3, max(values) * 1e3
    return f"p50 {p50:,.0f} ms, p99 {p99:,.0f} ms, max {top:,.0f} ms"


async def prepare(server: TestNatsServer, n: int, every: int) -> list[Any]:
    """Publish, attest and snapshot the log; its events."""
    # A fleet's heartbeats expire within minutes (their TTL), so almost all of a long
    # log is the other events: the same log with its heartbeats gone, `n` events long.
    log = bench_replay.without_heartbeats(n)
    took = await bench_replay.fill(server, log)
    print(f"published {n:,} events in {took:.0f} s", flush=True)
    attestations = await bench_replay.attest(server, n)
    control = await connect_as(server, "control", "bench-control")
    store = await bus.SnapshotStore.open(control.jetstream(), keep=n // every + 2)
    st = state.ClusterState()
    saved = 0
    for seq, event in enumerate(log, start=1):
        state.apply(st, event, seq, float(seq))
        if seq % every == 0:
            await store.save(state.encode_snapshot(st), seq)
            saved += 1
    await control.close()
    print(f"{len(attestations):,} attestations, {saved} snapshots (every {every:,})", flush=True)
    return log


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--snapshot-every", type=int, default=10_000)
    parser.add_argument("--points", type=int, default=60)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    print(f"load average before: {os.getloadavg()[0]:.2f} (2 = both cores busy)", flush=True)
    rng = random.Random(7)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        server = TestNatsServer(TestPki(root / "pki"), root / "nats")
        server.root.mkdir()
        server.start()
        console = None
        try:
            log = await prepare(server, args.events, args.snapshot_every)
            console, base = await asyncio.to_thread(start_console, server, root)
            while True:  # until it has rebuilt the present
                try:
                    await asyncio.to_thread(fetch, base + "/api/fleet")
                    break
                except OSError:
                    await asyncio.sleep(0.5)
            points = sorted(rng.randrange(1, args.events + 1) for _ in range(args.points))
            expected = {}
            st = state.ClusterState()
            wanted = iter(points)
            nxt = next(wanted, None)
            for seq, event in enumerate(log, start=1):
                state.apply(st, event, seq, float(seq))
                while nxt == seq:
                    expected[seq] = (len(st.replicas), sorted(st.endpoints))
                    nxt = next(wanted, None)
            by_seq, by_time, folded, rebuilds, times_of = [], [], [], [], {}
            rng.shuffle(points)
            for p in points:
                took, body = await asyncio.to_thread(fetch, f"{base}/api/fleet?at={p}")
                view = json.loads(body)
                assert view["seq"] == p, (view["seq"], p)
                got = (len(view["replicas"]), sorted(r["id"] for r in view["replicas"]
                                                     if r["endpoint"]))  # fmt: skip
                assert got == expected[p], (p, got[0], expected[p][0])
                by_seq.append(took)
                folded.append(view["rebuilt"]["folded"])
                rebuilds.append(view["rebuilt"]["elapsed_s"])
                times_of[p] = view["time"]
            for p in points[: max(5, len(points) // 3)]:
                took, body = await asyncio.to_thread(fetch, f"{base}/api/fleet?at=@{times_of[p]}")
                by_time.append(took)
            page_s, page = await asyncio.to_thread(fetch, base + "/")
            live_s, live = await asyncio.to_thread(fetch, base + "/api/fleet")
            events_s, recent = await asyncio.to_thread(fetch, base + "/api/events?limit=2000")
        finally:
            if console is not None:
                console.terminate()
            server.close()
    print(f"\nllmgw console, {args.events:,} events, a snapshot every {args.snapshot_every:,}")
    tails = f"median {statistics.median(folded):,.0f}, max {max(folded):,}"
    print(f"  any point by sequence ({len(by_seq)} points): {ms(by_seq)}; tail folded: {tails}")
    print(f"    of which the rebuild (snapshot + tail, each event checked): {ms(rebuilds)}")
    print(f"  any point by time ({len(by_time)} points): {ms(by_time)}")
    print(f"  the page: {len(page) / 1024:.1f} KiB in {page_s * 1e3:.0f} ms; its first view: "
          f"/api/fleet {len(live) / 1024:.0f} KiB in {live_s * 1e3:.0f} ms, /api/events "
          f"{len(recent) / 1024:.0f} KiB in {events_s * 1e3:.0f} ms")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())

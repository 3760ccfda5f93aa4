"""Agent benchmarks: supervisor spawn latency, and its footprint while idle with 8 sim shards.

Run: `.venv/bin/python tests/bench/bench_agent.py` (about 1 minute). Prints:
- time from calling Supervisor.start to the engine process existing (goal < 50 ms,
  the engine's own start-up excluded), median and worst over N starts;
- the time Supervisor.start takes to return (spawn + pid file + first status);
- resident memory and CPU of the agent process (this one) while 8 `llmgw sim`
  shards serve and nothing happens, with the default 0.5 s poll.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

from llmgw import logs
from llmgw.agent import engines
from llmgw.agent.discovery import simulated
from llmgw.agent.engines import Launch, LaunchContext
from llmgw.agent.supervisor import Settings, ShardView, Supervisor
from llmgw.core.inventory import Inventory
from llmgw.core.profile import LaunchSpec


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def spawn_latency(state: Path, runs: int) -> None:
    sup = Supervisor(Settings(state_dir=str(state / "spawn"), poll_s=0.5))
    spec = LaunchSpec(engine="sim", model="m", served_name="m", port=1, gpus=())
    launch = Launch(argv=("sleep", "300"), env={}, port=1, http=False)
    spawn, call = [], []
    for i in range(runs):
        began = time.perf_counter()
        await sup.start(f"r{i}", 1, 0, spec, launch)
        call.append(time.perf_counter() - began)
        spawn.append(sup._shards[(f"r{i}", 0)].spawned_perf)
    await sup.stop_all(grace_s=2)
    await sup.close()
    ms = sorted(x * 1000 for x in spawn)
    total = sorted(x * 1000 for x in call)
    print(f"spawn latency over {runs} starts (start() called -> engine process exists):")
    print(
        f"  median {statistics.median(ms):.2f} ms, p95 {ms[int(0.95 * (runs - 1))]:.2f} ms, "
        f"max {ms[-1]:.2f} ms   (goal < 50 ms)"
    )
    print(
        f"  start() returns (spawn + pid file + first status): median "
        f"{statistics.median(total):.2f} ms, max {total[-1]:.2f} ms"
    )


async def idle_footprint(state: Path, shards: int, window_s: float) -> None:
    serving = asyncio.Event()
    count = 0

    async def on_change(view: ShardView) -> None:
        nonlocal count
        if view.phase == "serving":
            count += 1
            if count == shards:
                serving.set()
        elif view.phase == "failed":
            print(f"shard failed: {view.error} {view.log_tail[-3:]}", file=sys.stderr)

    sup = Supervisor(Settings(state_dir=str(state / "idle")), on_change)
    inventory = Inventory(gpus=simulated.parse_spec(f"{shards}xh100-80g"))
    context = LaunchContext(host="127.0.0.1")
    try:
        rss_before = rss_mib()
        for i in range(shards):
            port = free_port()
            spec = LaunchSpec(
                engine="sim", model=f"m{i}", served_name=f"m{i}", port=port, gpus=(i,)
            )
            launch = engines.plan(spec, inventory, context, busy_gpus=sup.busy_gpus())
            await sup.start(f"rep-{i}", 1, 0, spec, launch)
        began = time.monotonic()
        await asyncio.wait_for(serving.wait(), 180)
        print(f"{shards} sim shards serving after {time.monotonic() - began:.1f} s")
        await asyncio.sleep(2)
        cpu0, wall0 = os.times(), time.monotonic()
        await asyncio.sleep(window_s)
        cpu1, wall1 = os.times(), time.monotonic()
        cpu_s = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
        print(f"agent process idle with {shards} serving shards, over {window_s:.0f} s:")
        print(f"  CPU {100 * cpu_s / (wall1 - wall0):.2f} % of one core")
        print(
            f"  RSS {rss_mib():.1f} MiB (before starting shards: {rss_before:.1f} MiB; "
            "includes the Python interpreter, asyncio, aiohttp, msgspec)"
        )
    finally:
        await sup.stop_all(grace_s=5)
        await sup.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--window", type=float, default=20.0)
    args = parser.parse_args()
    logs.setup("warning")
    with tempfile.TemporaryDirectory() as tmp:
        await spawn_latency(Path(tmp), args.runs)
        await idle_footprint(Path(tmp), args.shards, args.window)


if __name__ == "__main__":
    asyncio.run(main())

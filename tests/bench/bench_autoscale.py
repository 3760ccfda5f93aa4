"""A step of load x4 on an autoscaled model, beside static fleets at its min and its max,
every process real (issue 19, measure).

Run from the repository root:

    .venv/bin/python tests/bench/bench_autoscale.py
    .venv/bin/python tests/bench/bench_autoscale.py --base-s 20 --step-s 60 --after-s 60

Each target gets a fresh fleet (tests/e2e/fleet_kit.Fleet): nats-server with mutual TLS,
`llmgw control`, two `llmgw agent`s of two simulated GPUs each, whose replicas are
`llmgw sim` engines that saturate (`--max-num-seqs 4`, a step of 8 ms plus 2 ms per running
sequence: a fifth concurrent stream waits), and `llmgw router`. The load is closed-loop
streaming clients: `--clients` for `--base-s`, four times as many for `--step-s`, then
`--clients` again for `--after-s`. Targets:

- `autoscaled`: `min 1, max 4`, four running requests per replica, a TTFT p90 SLO of
  `--slo-ms` and one waiting request per replica, `--up-window-s` (3), `--down-window-s`
  (20);
- `static min`: one replica throughout; `static max`: four; `static N` (with `--only`): N;
- `square wave`: the autoscaled model under a load that switches between `--clients` and
  four times as many every `--square-s` seconds, for `--step-s`: faster than the down
  window, so it must scale out once and not flap.

Printed per target: TTFT p90 before, during and after the step, the time from the step
until the TTFT p90 of the last 5 s is back under the SLO (and stays there to the step's
end), the GPU-seconds used (live replicas, starting ones included, sampled every 0.5 s),
the requests that failed, and the replica count at the end. For the autoscaled target also
the GPU-seconds of an oracle that knew the load in advance and started, at each phase's
first second, the fewest replicas that run its streams without queueing (a sim runs 4 at
once), and of one that started the fewest that hold the SLO (`--slo-counts`).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from llmgw.core import events  # noqa: E402
from llmgw.core.autoscale import Autoscale  # noqa: E402
from tests.e2e.fleet_kit import Fleet, sim_model  # noqa: E402
from tests.harness import TestNatsServer, TestPki  # noqa: E402

SATURATING = ("--max-num-seqs", "4", "--decode-base-ms", "8", "--decode-per-seq-ms", "2")


def p90(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(int(len(ordered) * 0.9) - 1, 0)]


class Sampler:
    """The fleet's live replicas every 0.5 s: GPU-seconds, and the count at each moment."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.samples: list[tuple[float, int]] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            rows = await self.fleet.replicas()
            live = [r for r in rows if not r["retired"] or any(
                s["phase"] not in ("stopped", "failed") for s in r["shards"])]  # fmt: skip
            self.samples.append((time.monotonic(), len(live)))
            await asyncio.sleep(0.5)

    def gpu_seconds(self, since: float, until: float) -> float:
        total = 0.0
        for (t0, n), (t1, _) in zip(self.samples, self.samples[1:], strict=False):
            lo, hi = max(t0, since), min(t1, until)
            if hi > lo:
                total += n * (hi - lo)
        return total

    def count_at(self, t: float) -> int:
        before = [n for when, n in self.samples if when <= t]
        return before[-1] if before else 0


async def _stream(http: aiohttp.ClientSession, url: str, body: dict) -> float | None:
    """One streamed chat completion; its TTFT, or None when it failed or came short."""
    began = time.monotonic()
    first = None
    done = False
    try:
        async with http.post(url, json=body) as resp:
            if resp.status != 200:
                return None
            async for raw in resp.content:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data:") and first is None and '"content"' in line:
                    first = time.monotonic() - began
    except (aiohttp.ClientError, TimeoutError):
        return None
    return first if done else None


async def ttfts(url: str, clients: int, seconds: float, max_tokens: int) -> tuple[
    list[tuple[float, float]], int
]:  # fmt: skip
    """(when, TTFT) of every request of `clients` closed-loop streams for `seconds`, and
    the count that failed."""
    seen: list[tuple[float, float]] = []
    failed = 0
    until = time.monotonic() + seconds

    async def client(i: int, http: aiohttp.ClientSession) -> None:
        nonlocal failed
        n = 0
        while time.monotonic() < until:
            n += 1
            prompt = [{"role": "user", "content": f"client {i} request {n}"}]
            body = {"model": "m1", "stream": True, "max_tokens": max_tokens, "messages": prompt}
            ttft = await _stream(http, url + "/v1/chat/completions", body)
            if ttft is None:
                failed += 1
            else:
                seen.append((time.monotonic(), ttft))

    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        await asyncio.gather(*(client(i, http) for i in range(clients)))
    return seen, failed


async def run_target(name: str, args: argparse.Namespace, root: Path, pki: TestPki) -> dict:
    slo = args.slo_ms / 1000
    if name in ("autoscaled", "square wave"):
        spec = Autoscale(min=1, max=4, running_per_replica=4.0, ttft_p90_s=slo,
                         waiting_per_replica=1.0, up_window_s=args.up_window_s,
                         down_window_s=args.down_window_s, max_step=2)  # fmt: skip
        model = sim_model("m1", replicas=1, autoscale=spec, engine_args=SATURATING)
    else:
        count = {"static min": 1, "static max": 4}.get(name) or int(name.split()[-1])
        model = sim_model("m1", replicas=count, engine_args=SATURATING)
    server = TestNatsServer(pki, root / name.replace(" ", "-") / "nats")
    server.root.mkdir(parents=True)
    server.start()
    fleet = Fleet(server, root / name.replace(" ", "-"), models=(model,))
    sampler = Sampler(fleet)
    try:
        await fleet.start(within_s=120)
        sampler.start()
        t0 = time.monotonic()
        results = []
        failed = 0
        phases = [(args.clients, args.base_s), (args.clients * 4, args.step_s),
                  (args.clients, args.after_s)]  # fmt: skip
        if name == "square wave":
            flips = int(args.step_s // args.square_s)
            wave = [(args.clients * (4 if i % 2 == 0 else 1), args.square_s) for i in range(flips)]
            phases = [(args.clients, args.base_s), *wave, (args.clients, 1.0)]
        for clients, secs in phases:
            seen, bad = await ttfts(fleet.router_url, clients, secs, args.max_tokens)
            results.append(seen)
            failed += bad
        t_end = time.monotonic()
        if name == "square wave":
            decided = [r.event for r in await fleet.read_log()
                       if isinstance(r.event, events.ScaleDecided)]  # fmt: skip
            return {"name": name, "decided": [(d.from_replicas, d.to_replicas) for d in decided],
                    "failed": failed, "flips": len(phases) - 2}  # fmt: skip
        step_at = t0 + args.base_s
        step_end = step_at + args.step_s
        during = results[1]
        recovered = None
        for i, (when, _) in enumerate(during):
            window = [v for w, v in during if when - 5 <= w <= when]
            if p90(window) <= slo and all(
                p90([v for w, v in during if x - 5 <= w <= x]) <= slo for x, _ in during[i:]
            ):
                recovered = when - step_at
                break
        spans = [(t0, step_at), (step_at, step_end), (step_end, t_end)]
        return {
            "name": name,
            "ttft": [p90([v for _, v in seen]) for seen in results],
            "recovered_s": recovered,
            "gpu_s": sampler.gpu_seconds(t0, t_end),
            "oracle_gpu_s": sum(
                (b - a) * math.ceil(clients / 4)
                for (a, b), (clients, _) in zip(spans, phases, strict=True)
            ),
            "slo_oracle_gpu_s": sum(
                (b - a) * n
                for (a, b), n in zip(spans, map(int, args.slo_counts.split(",")), strict=True)
            ),
            "failed": failed,
            "requests": sum(len(s) for s in results),
            "replicas_end": sampler.count_at(t_end),
        }
    finally:
        await sampler.stop()
        await fleet.stop()
        server.close()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--base-s", type=float, default=15.0)
    ap.add_argument("--step-s", type=float, default=45.0)
    ap.add_argument("--after-s", type=float, default=45.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--slo-ms", type=float, default=400.0)
    ap.add_argument("--square-s", type=float, default=5.0)
    ap.add_argument(
        "--slo-counts",
        default="1,4,1",
        help="the fewest static replicas that hold the SLO in each phase (measured with "
        "`--only 'static 2,static 3'`: at 12 streams 3 replicas miss it)",
    )
    ap.add_argument("--up-window-s", type=float, default=3.0)
    ap.add_argument("--down-window-s", type=float, default=20.0)
    ap.add_argument("--only", default="autoscaled,static min,static max,square wave")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="llmgw-bench-autoscale-"))
    try:
        pki = TestPki(root / "pki")
        rows = [await run_target(name, args, root, pki) for name in args.only.split(",")]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\nstep x4: {args.clients} -> {args.clients * 4} -> {args.clients} streams "
          f"({args.base_s:g} s, {args.step_s:g} s, {args.after_s:g} s), TTFT SLO p90 "
          f"{args.slo_ms:g} ms, sims saturating at 4 streams, 4 GPUs")  # fmt: skip
    print(f"  {'target':<12} {'TTFT p90 before/during/after':>30} {'SLO back after':>15} "
          f"{'GPU-s':>7} {'failed':>7} {'requests':>9} {'replicas at end':>16}")  # fmt: skip
    for r in rows:
        if r["name"] == "square wave":
            continue
        ttft = "/".join(f"{v * 1000:.0f}" for v in r["ttft"]) + " ms"
        back = f"{r['recovered_s']:.1f} s" if r["recovered_s"] is not None else "never"
        print(f"  {r['name']:<12} {ttft:>30} {back:>15} {r['gpu_s']:>7.0f} {r['failed']:>7} "
              f"{r['requests']:>9} {r['replicas_end']:>16}")  # fmt: skip
    for r in rows:
        if r["name"] == "square wave":
            moves = ", ".join(f"{a}->{b}" for a, b in r["decided"]) or "none"
            print(f"  square wave, {r['flips']} flips of {args.square_s:g} s: scaling decisions "
                  f"{moves}; {r['failed']} requests failed")  # fmt: skip
        if r["name"] == "autoscaled":
            print(f"  autoscaled used {r['gpu_s'] / max(r['oracle_gpu_s'], 1e-9):.2f}x the GPU-s "
                  f"of an oracle knowing the load ({r['oracle_gpu_s']:.0f} GPU-s), "
                  f"{r['gpu_s'] / max(r['slo_oracle_gpu_s'], 1e-9):.2f}x one that also holds "
                  f"the SLO ({r['slo_oracle_gpu_s']:.0f} GPU-s: {args.slo_counts})")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())

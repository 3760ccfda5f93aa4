"""Figures for `llmgw up`: time from the command to the first streamed token, and the real
engine's tokens/s through the router against the engine directly.

    .venv/bin/python tests/bench/bench_up.py [--runs 3] [--streams 5]

1. `llmgw up` (2 simulated nodes, fresh state directory each run): seconds from starting the
   command to the first token the openai SDK receives, and to SIGINT leaving no process.
2. `llmgw up --engine llamacpp` (one node, SmolLM2-135M on the CPU; skipped without
   llama-server or the model): single-stream decode tokens/s (first to last content chunk,
   128 tokens, greedy) through the router and straight to the engine, alternating, medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from llmgw import pidfiles
from llmgw.up import locating, render
from tests.e2e import up_kit


def time_to_first_token(runs: int) -> None:
    firsts, stops = [], []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            up = up_kit.start_up(Path(tmp))
            try:
                first, _, _, _ = up_kit.stream_chat(up.base_url, "demo", deadline_s=60.0)
                firsts.append(first - up.started)
                t = time.monotonic()
                rc = up.interrupt()
                stops.append(time.monotonic() - t)
                left = up.leftovers()
                print(
                    f"  run: first token {firsts[-1]:.2f} s, stop {stops[-1]:.2f} s, rc {rc}, "
                    f"{len(up.seen)} processes started, {len(left)} left",
                    file=sys.stderr,
                )
            finally:
                if up.proc.poll() is None:
                    up.proc.kill()
                up_kit.kill_all(up.seen)
    print(
        f"llmgw up (2 nodes x 8 sim GPUs, 2 replicas) -> first streamed token: median "
        f"{statistics.median(firsts):.2f} s (min {min(firsts):.2f}, max {max(firsts):.2f}, "
        f"{runs} runs); SIGINT -> all stopped: median {statistics.median(stops):.2f} s"
    )


def llamacpp_rates(streams: int) -> None:
    gguf = locating.find_smollm2()
    if locating.find_llama_server() is None or gguf is None:
        print("llama.cpp: skipped (no llama-server or no SmolLM2 GGUF)")
        return
    with tempfile.TemporaryDirectory() as tmp:
        up = up_kit.start_up(
            Path(tmp), "--engine", "llamacpp", "--model-file", gguf, "--model", "smollm2",
            "--nodes", "1", "--replicas", "1",
        )  # fmt: skip
        try:
            first, _, _, _ = up_kit.stream_chat(up.base_url, "smollm2", deadline_s=60.0)
            print(f"llmgw up --engine llamacpp -> first streamed token: {first - up.started:.2f} s")
            [rec] = [r for _, r in pidfiles.load_all(up.state_dir / "agents/node-1/state") if r]
            direct = f"http://{render.node_address(up.state_dir.resolve(), 1)}:{rec.spec.port}/v1"
            rates: dict[str, list[float]] = {"router": [], "direct": []}
            ttft: dict[str, list[float]] = {"router": [], "direct": []}
            for i in range(streams * 2):
                which = "router" if i % 2 == 0 else "direct"
                url = up.base_url if which == "router" else direct
                start = time.monotonic()
                f, last, pieces, _ = up_kit.stream_chat(
                    url, "smollm2", deadline_s=30.0, max_tokens=128,
                    prompt=f"Write a short story about a lighthouse keeper, number {i // 2}.",
                )  # fmt: skip
                ttft[which].append(f - start)
                rates[which].append((len(pieces) - 1) / (last - f) if last > f else 0.0)
            r, d = statistics.median(rates["router"]), statistics.median(rates["direct"])
            print(
                f"llama.cpp SmolLM2-135M Q4_1, 1 stream, 128 tokens: direct {d:.0f} tok/s, "
                f"through the router {r:.0f} tok/s ({r / d:.2f} of direct); TTFT direct "
                f"{statistics.median(ttft['direct']) * 1000:.0f} ms, router "
                f"{statistics.median(ttft['router']) * 1000:.0f} ms (medians of {streams})"
            )
            up.interrupt()
        finally:
            if up.proc.poll() is None:
                up.proc.kill()
            up_kit.kill_all(up.seen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--streams", type=int, default=5)
    args = parser.parse_args()
    if args.runs:
        time_to_first_token(args.runs)
    llamacpp_rates(args.streams)


if __name__ == "__main__":
    main()

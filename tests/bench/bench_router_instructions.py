"""Router CPU per request as instructions, counted by valgrind (callgrind): this checkout's
router against another's, over the same three `llmgw sim` engines and the same load.

    apt-get install valgrind
    git worktree add /tmp/before <commit>
    .venv/bin/python -m tests.bench.bench_router_instructions --baseline /tmp/before

Wall-clock CPU time on a shared machine moves by a few percent from run to run, which
hides a change of that size; the number of instructions a process executes does not
(two runs agree within about 0.2 %). Each router runs under callgrind (some 50 times
slower, so the load is modest: 16 streams of the same 16-token answers as
`bench_router`), is warmed up, has its counters zeroed, serves `--requests` streams, and
has its counters read. The figure is user-space instructions per request, the router's
own and every library's; it says nothing about the kernel (system calls) or about
latency, which `bench_router --pin` measures.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from llmgw.sim.testing import wait_for_line  # noqa: E402
from tests.bench.bench_router import baseline_env, run_client  # noqa: E402
from tests.integration.router_kit import LINE, Sim  # noqa: E402


def router_config(tmp: Path, name: str, sims: list[Sim]) -> Path:
    cfg = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"host": "127.0.0.1", "port": 0},
        "workers": 1,
        "models": [{"name": "m"}],
        "endpoints": [{"id": f"s{i}", "url": s.url, "models": ["m"]} for i, s in enumerate(sims)],
        # Probes would add work that depends on how long the run takes, not on requests.
        "probe_interval_s": 3600.0,
        "seed": 7,
        "log_level": "warning",
        "auth": {"allow_anonymous": True},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def instructions_per_request(
    tmp: Path, name: str, env: dict[str, str], sims: list[Sim], requests: int, streams: int
) -> float:
    """Start one router under callgrind, warm it, count `requests` streams' instructions."""
    out = tmp / f"{name}.callgrind"
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}.%p"]
    cmd += [
        sys.executable,
        "-m",
        "llmgw",
        "router",
        "--config",
        str(router_config(tmp, name, sims)),
    ]
    with open(tmp / f"{name}.log", "ab") as log:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=log, env={**os.environ, **env}, cwd=tmp
        )
    try:
        url = wait_for_line(proc, LINE, f"{name} router under valgrind", 300).group(1)
        url += "/v1/chat/completions"
        run_client([url], streams, 100)  # imports, connections, caches: not what is counted
        control = ["callgrind_control"]
        subprocess.run([*control, "-z", str(proc.pid)], check=True, capture_output=True)
        result = run_client([url], streams, requests)
        subprocess.run([*control, "-d", str(proc.pid)], check=True, capture_output=True)
        if result["errors"] or result["n"] != requests:
            raise SystemExit(f"{name}: {result['errors']} errors in {result['n']} requests")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    dump = tmp / f"{name}.callgrind.{proc.pid}.1"  # the first dump: since the zeroing
    sent = requests + min(requests // 4, 512)  # run_client's warm-up streams count too
    for line in dump.read_text().splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1]) / sent
    raise SystemExit(f"{name}: no summary line in {dump}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, help="another llmgw checkout to compare with")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--streams", type=int, default=16, help="concurrent streams (16)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, each router once a round")
    ap.add_argument(
        "--decode-ms", type=float, default=0.0, help="sim step time in ms (0: no latency)"
    )
    args = ap.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("valgrind is not installed: apt-get install valgrind")
    targets = [("llmgw", {"PYTHONSAFEPATH": "1", "PYTHONPATH": str(ROOT)})]
    if args.baseline is not None:
        targets.append(("llmgw@baseline", baseline_env(args.baseline)))
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-instr-"))
    sim_args = ["--eos-min-tokens", "16", "--eos-max-tokens", "16", "--log-level", "warning"]
    sim_args += ["--decode-base-ms", str(args.decode_ms)]
    sims = [Sim.start("m", *sim_args) for _ in range(3)]
    figures: dict[str, list[float]] = {name: [] for name, _ in targets}
    try:
        for r in range(args.rounds):
            for name, env in targets:
                t0 = time.monotonic()
                n = instructions_per_request(tmp, name, env, sims, args.requests, args.streams)
                figures[name].append(n)
                print(f"round {r + 1} {name:<16} {n:>10,.0f} instructions/request"
                      f" ({time.monotonic() - t0:.0f} s)", flush=True)  # fmt: skip
    finally:
        for s in sims:
            s.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n{'router':<16} {'instructions per request, each round':>40}")
    for name, values in figures.items():
        print(f"{name:<16} {', '.join(f'{v:,.0f}' for v in values):>40}")
    if args.baseline is not None:
        a, b = min(figures["llmgw"]), min(figures["llmgw@baseline"])
        print(f"\nthis checkout against the baseline: {100 * (a - b) / b:+.1f} %")


if __name__ == "__main__":
    main()

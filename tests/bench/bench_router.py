"""Router overhead and throughput, side by side: direct to the sims, llmgw router,
vllm-router and sglang-router, over the same three `llmgw sim` engines.

    .venv/bin/python tests/bench/bench_router.py            # the whole run, ~3-4 minutes
    .venv/bin/python tests/bench/bench_router.py --quick    # fewer requests, a smoke run

Overhead: time to first token and total latency of streamed chat completions
through each router minus direct to the sims, p50 and p99, at 1, 64 and 512
concurrent streams. Throughput: streamed requests/s at 256 concurrent, divided
by direct. The peers (PyPI binary wheels `vllm-router==0.1.17`,
`sglang-router==0.3.2`, installed into .venv for the bench only) run with
`--policy round_robin` and their metrics bound to 127.0.0.1; a peer that is
not installed is skipped. The sims are infinitely fast (zero latency model,
16 tokens per answer) so the router is what is measured.

By default the load generator, the router and the three sims share this
machine's cores, so at high concurrency every figure includes CPU contention
between them, not only the router's own work. `--pin` separates them as
separate machines would: every router (all its threads and workers) runs on
the first half of the cores, the sims and the load generator on the other half,
and direct runs get the same cores for sims and client as every other target.

    .venv/bin/python tests/bench/bench_router.py --pin      # routers on their own core(s)

`--baseline TREE` adds the llmgw router of another checkout (an older commit, say,
from `git worktree add`) as the target "llmgw@baseline", run in the same rounds,
interleaved with this tree's: a before/after comparison on one machine at one time.
The targets take turns going first, round by round, so give as many rounds as there are
targets (or a multiple): `--rounds 6` for direct, llmgw and llmgw@baseline. With
`--baseline` (or `--fresh`) llmgw's routers are new processes every round: two processes
of the very same router differ by 2-4 % in CPU per request, so the medians must be over
several of each.

    git worktree add /tmp/before HEAD~3
    python -m tests.bench.bench_router --pin --baseline /tmp/before --only llmgw --rounds 6

`--decode-ms` gives the sims a step time, so tokens come one chunk at a time as from
a real engine's batch; `--levels 64` keeps such a run to the 64-stream overhead (and
the throughput run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from llmgw.natsd import free_port  # noqa: E402
from tests.integration.router_kit import Router, Sim  # noqa: E402

TOKENS = 16
BODY = {
    "model": "m",
    "messages": [{"role": "user", "content": "Say something short."}],
    "stream": True,
    "max_tokens": TOKENS,
}


# --------------------------------------------------------------------------- load generator


async def _client(urls: list[str], concurrency: int, requests: int, warmup: int) -> dict[str, Any]:
    """Measure `requests` streams at `concurrency`, after `warmup` streams on the same
    connections: connection set-up (and a SYN dropped in a burst of 512 connects, which
    costs a 1 s retransmit) is not what the figures are about."""
    import aiohttp

    body = json.dumps(BODY).encode()
    headers = {"Content-Type": "application/json", "Authorization": "Bearer none"}
    conn = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency, force_close=False)
    ttfts: list[float] = []
    totals: list[float] = []
    errors = 0
    counter = 0
    marker = b'"content":"'

    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as s:

        async def one(url: str) -> None:
            nonlocal errors
            t0 = time.perf_counter()
            first = 0.0
            try:
                async with s.post(url, data=body, headers=headers) as r:
                    if r.status != 200:
                        errors += 1
                        await r.read()
                        return
                    async for chunk in r.content.iter_any():
                        if not first:
                            i = chunk.find(marker)
                            while i >= 0:
                                if chunk[i + len(marker) : i + len(marker) + 1] != b'"':
                                    first = time.perf_counter()
                                    break
                                i = chunk.find(marker, i + 1)
            except (aiohttp.ClientError, TimeoutError):
                errors += 1
                return
            t1 = time.perf_counter()
            ttfts.append((first or t1) - t0)
            totals.append(t1 - t0)

        async def worker(limit: int) -> None:
            nonlocal counter
            while counter < limit:
                counter += 1
                await one(urls[counter % len(urls)])

        await asyncio.gather(*(worker(max(warmup, concurrency)) for _ in range(concurrency)))
        ttfts.clear()
        totals.clear()
        errors = 0
        counter = 0
        t_start = time.perf_counter()
        await asyncio.gather(*(worker(requests) for _ in range(concurrency)))
        elapsed = time.perf_counter() - t_start

    def q(xs: list[float], p: float) -> float:
        if not xs:
            return float("nan")
        xs = sorted(xs)
        return xs[min(int(p * len(xs)), len(xs) - 1)]

    return {
        "n": len(totals),
        "errors": errors,
        "rps": len(totals) / elapsed if elapsed > 0 else 0.0,
        "ttft_p50": q(ttfts, 0.5),
        "ttft_p99": q(ttfts, 0.99),
        "total_p50": q(totals, 0.5),
        "total_p99": q(totals, 0.99),
    }


def _client_main(args: argparse.Namespace) -> None:
    import uvloop

    urls = args.url

    async def main() -> dict[str, Any]:
        return await _client(urls, args.concurrency, args.requests, args.warmup)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        result = runner.run(main())
    print(json.dumps(result), flush=True)


def run_client(urls: list[str], concurrency: int, requests: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--client", "--concurrency", str(concurrency)]
    cmd += ["--requests", str(requests), "--warmup", str(min(requests // 4, 512))]
    for u in urls:
        cmd += ["--url", u]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"client failed: {out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


# --------------------------------------------------------------------------- CPU


def _proc_tree(pid: int) -> list[int]:
    """`pid` and its descendants (router workers)."""
    out = [pid]
    i = 0
    while i < len(out):
        try:
            for task in Path(f"/proc/{out[i]}/task").iterdir():
                kids = (task / "children").read_text().split()
                out.extend(int(k) for k in kids)
        except OSError:
            pass
        i += 1
    return out


def cpu_times(pids: list[int]) -> tuple[float, float]:
    """User and system CPU seconds of these processes (and their threads), from /proc."""
    user = system = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        user += int(fields[11])
        system += int(fields[12])
    tck = os.sysconf("SC_CLK_TCK")
    return user / tck, system / tck


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of these processes (and their threads), from /proc."""
    return sum(cpu_times(pids))


def pin_tree(pid: int, cores: set[int]) -> None:
    """Move a process, its threads and its descendants onto `cores`."""
    for p in _proc_tree(pid):
        try:
            tids = [int(t.name) for t in Path(f"/proc/{p}/task").iterdir()]
        except OSError:
            continue
        for tid in tids:
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                os.sched_setaffinity(tid, cores)


def baseline_env(tree: Path) -> dict[str, str]:
    """The environment that runs `python -m llmgw` from `tree` instead of this checkout:
    its package first on the path, and not the working directory, which `-m` would
    otherwise put before it. Checked, since a mistake here compares a tree with itself."""
    env = {"PYTHONPATH": str(tree.resolve()), "PYTHONSAFEPATH": "1"}
    found = subprocess.run(
        [sys.executable, "-c", "import llmgw; print(llmgw.__file__)"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(found).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"--baseline {tree}: llmgw still loads from {found}")
    return env


# --------------------------------------------------------------------------- peers


def wait_http(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    body = json.dumps({**BODY, "stream": False, "max_tokens": 1}).encode()
    while time.monotonic() < deadline:
        try:
            req = urllib.request.Request(
                url, data=body, headers={"Content-Type": "application/json"}, method="POST"
            )
            with urllib.request.urlopen(req, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} never answered")


class Peer:
    def __init__(self, name: str, cmd: list[str], port: int, log: Path) -> None:
        self.name = name
        self.url = f"http://127.0.0.1:{port}/v1/chat/completions"
        self.log = open(log, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_http(self.url)
        except RuntimeError:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def start_vllm_router(sims: list[Sim], tmp: Path) -> Peer | None:
    # Beside this interpreter (a venv), else on PATH (an install with pip --target).
    exe = shutil.which("vllm-router", path=str(Path(sys.executable).parent))
    exe = exe or shutil.which("vllm-router")
    if not exe:
        return None
    port = free_port()
    cmd = [exe, "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
           "--log-level", "warning", "--worker-urls", *[s.url for s in sims]]  # fmt: skip
    return Peer("vllm-router", cmd, port, tmp / "vllm-router.log")


def start_sglang_router(sims: list[Sim], tmp: Path) -> Peer | None:
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        return None
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
           "--port", str(port), "--policy", "round_robin", "--prometheus-host", "127.0.0.1",
           "--prometheus-port", str(free_port()), "--log-level", "warn",
           "--worker-urls", *[s.url for s in sims]]  # fmt: skip
    return Peer("sglang-router", cmd, port, tmp / "sglang-router.log")


# --------------------------------------------------------------------------- the run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--url", action="append", default=[], help=argparse.SUPPRESS)
    ap.add_argument("--concurrency", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--requests", type=int, default=100, help=argparse.SUPPRESS)
    ap.add_argument("--warmup", type=int, default=50, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="fewer requests, one round: a smoke run")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; figures are medians (3)")
    ap.add_argument("--only", default="", help="comma-separated targets besides direct")
    ap.add_argument(
        "--pin",
        action="store_true",
        help="routers on the first half of the cores, sims and load generator on the rest",
    )
    ap.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="another llmgw checkout whose router runs too, as target llmgw@baseline",
    )
    ap.add_argument(
        "--fresh",
        action="store_true",
        help="start llmgw's routers anew every round (always with --baseline)",
    )
    ap.add_argument(
        "--decode-ms",
        type=float,
        default=0.0,
        help="sim step time in ms (0: infinitely fast engines, the router alone is measured)",
    )
    ap.add_argument(
        "--levels",
        default="1,64,512",
        help="concurrency levels of the overhead runs (1,64,512); throughput is always at 256",
    )
    args = ap.parse_args()
    if args.client:
        _client_main(args)
        return
    if args.baseline is not None and not (args.baseline / "llmgw" / "__init__.py").is_file():
        raise SystemExit(f"--baseline {args.baseline}: no llmgw/__init__.py there, not a checkout")
    args.fresh = args.fresh or args.baseline is not None

    scale = 0.2 if args.quick else 1.0
    rounds = 1 if args.quick else max(args.rounds, 1)
    sizes = {1: 400, 64: 4000, 512: 6000}
    try:
        levels = [int(x) for x in args.levels.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--levels takes numbers like 1,64, not {args.levels!r}") from None
    if not levels or min(levels) < 1:
        raise SystemExit("--levels needs at least one concurrency level, each 1 or more")
    overhead_runs = [(c, int(sizes.get(c, 4000) * scale)) for c in levels]
    throughput_run = (256, int(8000 * scale))
    all_runs = [*overhead_runs, throughput_run]
    tmp = Path(tempfile.mkdtemp(prefix="bench-router-"))
    sim_args = ["--eos-min-tokens", str(TOKENS), "--eos-max-tokens", str(TOKENS),
                "--log-level", "warning", "--decode-base-ms", str(args.decode_ms)]  # fmt: skip
    wanted = set(filter(None, args.only.split(",")))
    cores = sorted(os.sched_getaffinity(0))
    router_cores: set[int] = set()
    if args.pin:
        if len(cores) < 2:
            raise SystemExit("--pin needs at least 2 cores")
        router_cores = set(cores[: len(cores) // 2])
        # Sims and every client process inherit the load side's cores from here on.
        os.sched_setaffinity(0, set(cores[len(cores) // 2 :]))
    sims = [Sim.start("m", *sim_args) for _ in range(3)]
    stops: list[Any] = []
    targets: dict[str, list[str]] = {"direct": [s.url + "/v1/chat/completions" for s in sims]}
    pids: dict[str, list[int]] = {"direct": []}
    samples: dict[tuple[str, int], list[dict[str, Any]]] = {}
    try:
        endpoints = {f"s{i}": s for i, s in enumerate(sims)}
        # Production settings: probes once a second (the test kit probes 5x faster).
        routers: list[tuple[str, int, dict[str, str]]] = [
            ("llmgw", 1, {}),
            ("llmgw --workers 2", 2, {}),
        ]
        if args.baseline is not None:
            routers.insert(1, ("llmgw@baseline", 1, baseline_env(args.baseline)))
        routers = [r for r in routers
                   if not wanted or r[0].split("@")[0] in wanted or r[0] in wanted]  # fmt: skip

        def start_routers() -> list[Router]:
            started: list[Router] = []
            for name, workers, env in routers:
                try:
                    r = Router.start(tmp, endpoints, workers=workers, log_level="warning",
                                     probe_interval_s=1.0, env=env)  # fmt: skip
                except BaseException:
                    for running in started:  # else they outlive the benchmark
                        running.stop()
                    raise
                started.append(r)
                targets[name] = [r.url + "/v1/chat/completions"]
                pids[name] = _proc_tree(r.pid)
                if router_cores:
                    pin_tree(r.pid, router_cores)
            return started

        running = start_routers()
        stops.append(lambda: [r.stop() for r in running])
        for name, start in (("vllm-router", start_vllm_router),
                            ("sglang-router", start_sglang_router)):  # fmt: skip
            if wanted and name not in wanted:
                continue
            try:
                peer = start(sims, tmp)
            except RuntimeError as exc:
                log = (tmp / f"{name}.log").read_text(errors="replace")[-1500:]
                print(f"  {name}: did not start ({exc}); its log ends:\n{log}")
                continue
            if peer is None:
                print(f"  {name}: not installed, skipped")
                continue
            stops.append(peer.stop)
            targets[name] = [peer.url]
            pids[name] = _proc_tree(peer.proc.pid)
            if router_cores:
                pin_tree(peer.proc.pid, router_cores)
        layout = (
            f"routers pinned to cores {sorted(router_cores)}, sims and client to "
            f"{sorted(os.sched_getaffinity(0))}"
            if router_cores
            else "all share every core"
        )
        print(f"cores: {len(cores)} ({layout}); sims: 3 x llmgw sim, {TOKENS} tokens, "
              f"step {args.decode_ms} ms; "
              f"{rounds} round(s), targets interleaved, medians reported")  # fmt: skip
        order = list(targets)
        for rnd in range(rounds):
            if args.fresh and rnd > 0:
                # New processes: one process of a router differs from the next by a few
                # percent in CPU per request (memory layout, hash seed), so one process
                # per target for the whole run would compare two draws, not two routers.
                for r in running:
                    r.stop()
                running[:] = start_routers()
            # Each round starts one target later: a target measured right after another
            # ran 2-4 % differently in CPU per request (the same router as two targets,
            # in fixed order, showed it), so over len(targets) rounds each takes each place.
            turn = order[rnd % len(order) :] + order[: rnd % len(order)]
            for conc, n in all_runs:
                for name in turn:
                    urls = targets[name]
                    u0, s0 = cpu_times(pids[name])
                    r = run_client(urls, conc, n)
                    u1, s1 = cpu_times(pids[name])
                    # Router CPU per request (warm-up included in both): steadier than
                    # latency on a machine whose other load comes and goes.
                    sent = n + min(n // 4, 512)
                    r["cpu_us"] = (u1 - u0 + s1 - s0) / sent * 1e6
                    r["sys_us"] = (s1 - s0) / sent * 1e6
                    samples.setdefault((name, conc), []).append(r)
                    print(f"  round {rnd + 1} {name:>17} c={conc:<4} n={r['n']:<5} "
                          f"err={r['errors']:<3} {r['rps']:8.0f} req/s  ttft p50 "
                          f"{r['ttft_p50'] * 1e3:7.2f} p99 {r['ttft_p99'] * 1e3:7.2f}  total p50 "
                          f"{r['total_p50'] * 1e3:7.2f} p99 {r['total_p99'] * 1e3:7.2f} ms",
                          flush=True)  # fmt: skip
    finally:
        for stop in stops:
            stop()
        for s in sims:
            s.stop()

    def med(name: str, conc: int, key: str) -> float:
        return statistics.median(r[key] for r in samples[(name, conc)])

    print()
    print("medians; overhead = through the router minus direct, ms")
    print(f"{'target':>18} {'conc':>5} {'req/s':>7} {'ttft p50':>9} {'ttft p99':>9}"
          f" {'total p50':>10} {'total p99':>10} {'router CPU/req (system)':>24}")  # fmt: skip
    for name in targets:
        for conc, _ in overhead_runs:
            d = {k: med("direct", conc, k) for k in ("ttft_p50", "ttft_p99", "total_p50",
                                                      "total_p99")}  # fmt: skip
            v = {k: med(name, conc, k) for k in d}
            if name == "direct":
                vals = [v[k] * 1e3 for k in d]
                label = "(absolute)"
            else:
                vals = [(v[k] - d[k]) * 1e3 for k in d]
                label = ""
            cpu = (
                f"{med(name, conc, 'cpu_us'):13.0f} us ({med(name, conc, 'sys_us'):3.0f} us)"
                if pids[name]
                else f"{'-':>24}"
            )
            print(f"{name:>18} {conc:>5} {med(name, conc, 'rps'):7.0f} {vals[0]:9.2f} "
                  f"{vals[1]:9.2f} {vals[2]:10.2f} {vals[3]:10.2f} {cpu} {label}")  # fmt: skip
    print()
    conc = throughput_run[0]
    print(f"throughput at {conc} concurrent streams (median requests/s, ratio to direct)")
    d_rps = med("direct", conc, "rps")
    for name in targets:
        rps = med(name, conc, "rps")
        cpu = f"  router CPU {med(name, conc, 'cpu_us'):4.0f} us/request" if pids[name] else ""
        print(f"{name:>18} {rps:8.0f}  {rps / d_rps:4.2f}{cpu}")
    print()
    if router_cores:
        print("note: routers ran on their own core(s); sims and client on the others.")
    else:
        print("note: client, router and sims share the same cores; at high concurrency the")
        print("figures include CPU contention between them, not only each router's own work.")
    out = {f"{name}@{conc}": rs for (name, conc), rs in samples.items()}
    (tmp / "results.json").write_text(json.dumps(out, indent=2))
    print(f"raw results: {tmp / 'results.json'}")


if __name__ == "__main__":
    main()

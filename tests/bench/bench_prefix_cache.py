"""Routing to the cache, side by side: shared-prefix and multi-turn workloads over `llmgw sim`
engines whose KV caches are too small to hold every prefix.

    .venv/bin/python tests/bench/bench_prefix_cache.py                 # both workloads
    .venv/bin/python tests/bench/bench_prefix_cache.py --workload shared --requests 240

The shared-prefix workload has the shape of SGLang's `generated-shared-prefix` benchmark:
`--groups` system prompts of `--prefix-tokens` tokens, each request one of them plus a
unique `--question-tokens` question, groups in shuffled order, `--output-tokens` out,
`--requests` requests at `--concurrency` streams. The multi-turn workload is
`--conversations` chats of `--turns` turns each (an `--opening-tokens` opening, a question
per turn, each turn's prompt the conversation so far with the real answers), one
conversation per stream at a time. Every dimension is a flag.

Each target gets fresh engines (`--engines` sims, `--num-blocks` KV blocks of 16 tokens,
the latency model of `--prefill-per-token-ms`, `--decode-base-ms`, `--decode-per-seq-ms`:
prefill is billed per uncached token), publishing their KV events as vLLM does:

- `round-robin`: the client rotates over the engines;
- `oracle`: the client sends group (or conversation) g to engine g mod N;
- `llmgw events`: the llmgw router, fed the engines' KV events through the agent's relay
  (llmgw.agent.kvrelay, one node identity per engine) and a real nats-server with mTLS;
- `llmgw approximate`: the same router without events (its own routes and prompt text);
- `llmgw x2`: two llmgw routers on the same events, the client alternating;
- `vllm-router`, `sglang-router`, `sglang-router x2`: the peers (PyPI wheels
  `vllm-router==0.1.17`, `sglang-router==0.3.2`, `pip install` them into .venv) with
  `--policy cache_aware`; a peer that is not installed is skipped.

Printed per target: TTFT p50 / p99, total latency p50, requests/s, and the engines' prefix
cache hit rate (hit tokens / prompt tokens, from their /metrics). This machine is shared
and noisy: compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from llmgw.natsd import free_port  # noqa: E402
from llmgw.sim.testing import SimProcess, wait_for_line  # noqa: E402
from tests.bench.bench_router import Peer  # noqa: E402

PY = sys.executable
MODEL = "m"
WORDS = [f"w{i:04d}" for i in range(5000)]  # each " wNNNN" is one token of the sim's


# --------------------------------------------------------------------------- workloads


def text(rng: random.Random, tokens: int) -> str:
    return "".join(" " + rng.choice(WORDS) for _ in range(tokens))


def shared_prefix(args: argparse.Namespace) -> list[tuple[int, list[dict[str, str]]]]:
    """(group, messages) per request, groups shuffled."""
    rng = random.Random(args.seed)
    systems = [f"Group {g}." + text(rng, args.prefix_tokens) for g in range(args.groups)]
    order = [i % args.groups for i in range(args.requests)]
    rng.shuffle(order)
    return [
        (
            g,
            [
                {"role": "system", "content": systems[g]},
                {"role": "user", "content": text(rng, args.question_tokens)},
            ],
        )
        for g in order
    ]


def conversations(args: argparse.Namespace) -> list[tuple[int, str, list[str]]]:
    """(conversation, opening, questions) per conversation."""
    rng = random.Random(args.seed)
    return [
        (
            c,
            f"Chat {c}." + text(rng, args.opening_tokens),
            [text(rng, args.question_tokens) for _ in range(args.turns)],
        )
        for c in range(args.conversations)
    ]


# --------------------------------------------------------------------------- the client


async def _client(spec: dict[str, Any]) -> dict[str, Any]:
    import aiohttp

    urls: list[str] = spec["urls"]
    pick: str = spec["pick"]  # "rotate" or "group"
    out_tokens: int = spec["output_tokens"]
    ttfts: list[float] = []
    totals: list[float] = []
    errors = 0
    counter = 0

    async def stream(s: aiohttp.ClientSession, url: str, messages: list[dict[str, str]]) -> str:
        nonlocal errors
        body = {"model": MODEL, "messages": messages, "stream": True, "max_tokens": out_tokens,
                "temperature": 0}  # fmt: skip
        t0 = time.perf_counter()
        first = 0.0
        pieces: list[str] = []
        try:
            async with s.post(url, json=body) as r:
                if r.status != 200:
                    errors += 1
                    await r.read()
                    return ""
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    for choice in chunk.get("choices") or []:
                        piece = (choice.get("delta") or {}).get("content")
                        if piece:
                            if not first:
                                first = time.perf_counter()
                            pieces.append(piece)
        except (aiohttp.ClientError, TimeoutError):
            errors += 1
            return ""
        t1 = time.perf_counter()
        ttfts.append((first or t1) - t0)
        totals.append(t1 - t0)
        return "".join(pieces)

    def url_for(group: int) -> str:
        nonlocal counter
        counter += 1
        return urls[group % len(urls)] if pick == "group" else urls[counter % len(urls)]

    conn = aiohttp.TCPConnector(limit=0)
    started = time.perf_counter()
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
        if spec["workload"] == "shared":
            items = list(spec["items"])

            async def worker() -> None:
                while items:
                    group, messages = items.pop(0)
                    await stream(s, url_for(group), messages)

        else:
            convs = list(spec["items"])

            async def worker() -> None:
                while convs:
                    c, opening, questions = convs.pop(0)
                    messages = [{"role": "system", "content": opening}]
                    for q in questions:
                        messages.append({"role": "user", "content": q})
                        answer = await stream(s, url_for(c), messages)
                        messages.append({"role": "assistant", "content": answer})

        await asyncio.gather(*(worker() for _ in range(spec["concurrency"])))
    elapsed = time.perf_counter() - started

    def q(xs: list[float], p: float) -> float:
        xs = sorted(xs)
        return xs[min(int(p * len(xs)), len(xs) - 1)] if xs else float("nan")

    return {"n": len(totals), "errors": errors, "rps": len(totals) / elapsed,
            "ttft_p50": q(ttfts, 0.5), "ttft_p99": q(ttfts, 0.99),
            "total_p50": q(totals, 0.5)}  # fmt: skip


def run_client(spec: dict[str, Any], tmp: Path) -> dict[str, Any]:
    path = tmp / "client.json"
    path.write_text(json.dumps(spec))
    out = subprocess.run([PY, __file__, "--client", str(path)], capture_output=True, text=True,
                         timeout=1800, check=False)  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"client failed: {out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


# --------------------------------------------------------------------------- engines, relays


class Engines:
    """N fresh sims publishing KV events on ipc sockets."""

    runs = 0

    def __init__(self, args: argparse.Namespace, sockets: Path) -> None:
        self.sockets = sockets
        self.sims: list[SimProcess] = []
        # New engines, new endpoint ids (as a fleet's replicas get): the updates of the
        # previous target's engines, still in llmgw-kv, describe other endpoints.
        Engines.runs += 1
        self.ids = [f"e{i}-{Engines.runs}" for i in range(args.engines)]
        lat = ["--prefill-per-token-ms", str(args.prefill_per_token_ms),
               "--decode-base-ms", str(args.decode_base_ms),
               "--decode-per-seq-ms", str(args.decode_per_seq_ms)]  # fmt: skip
        for i in range(args.engines):
            kv = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"ipc://{sockets}/e{i}.events",
                  "replay_endpoint": f"ipc://{sockets}/e{i}.replay"}  # fmt: skip
            self.sims.append(SimProcess.start(
                "--num-blocks", str(args.num_blocks), "--max-model-len", "4096",
                "--eos-min-tokens", "1000", "--eos-max-tokens", "1000",
                "--kv-events-config", json.dumps(kv), *lat, model=MODEL, timeout=60,
            ))  # fmt: skip

    @property
    def urls(self) -> list[str]:
        return [s.url + "/v1/chat/completions" for s in self.sims]

    def hit_rate(self) -> float:
        hits = queries = 0.0
        for s in self.sims:
            for line in s.metrics_text().splitlines():
                if line.startswith("vllm:prefix_cache_hits_total"):
                    hits += float(line.rsplit(" ", 1)[1])
                elif line.startswith("vllm:prefix_cache_queries_total"):
                    queries += float(line.rsplit(" ", 1)[1])
        return hits / queries if queries else 0.0

    def stop(self) -> None:
        for s in self.sims:
            s.stop()


class Fleet:
    """A real nats-server with mTLS and llmgw's authorization, provisioned, and one KV relay
    per engine (the agent's code, as node `node-<i>`), on a loop of its own thread."""

    def __init__(self, tmp: Path) -> None:
        from tests.harness import TestNatsServer, TestPki

        self.pki = TestPki(tmp / "pki")
        self.server = TestNatsServer(self.pki, tmp / "nats")
        self.server.root.mkdir()
        self.server.start()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self._run(self._provision())
        self.relays: list[Any] = []
        self.conns: list[Any] = []

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(120)

    async def _provision(self) -> None:
        from llmgw import bus
        from tests.harness import connect_as

        control = await connect_as(self.server, "control", "bench-control")
        await bus.provision(control.jetstream())
        await control.close()

    def relay(self, engines: Engines) -> None:
        self._run(self._relay(engines))

    async def _relay(self, engines: Engines) -> None:
        from llmgw import bus
        from llmgw.agent.kvrelay import EngineRelay
        from tests.harness import connect_as

        for i in range(len(engines.sims)):
            nc = await connect_as(self.server, "node", f"node-{i}")
            relay = EngineRelay(endpoint=engines.ids[i], model=MODEL,
                                events_addr=f"ipc://{engines.sockets}/e{i}.events",
                                replay_addr=f"ipc://{engines.sockets}/e{i}.replay",
                                send=bus.KvPublisher(nc, f"node-{i}").publish)  # fmt: skip
            relay.start()
            self.relays.append(relay)
            self.conns.append(nc)

    def unrelay(self) -> None:
        self._run(self._unrelay())

    async def _unrelay(self) -> None:
        from llmgw import bus

        for relay in self.relays:
            await relay.stop()
        for nc in self.conns:
            await bus.close(nc)
        self.relays, self.conns = [], []

    def source(self, name: str) -> dict[str, str | list[str]]:
        from llmgw.pki.identity import Identity

        self.pki.client_tls("router", name)
        ident = Identity("router", name)
        certs = self.pki.certs
        return {"servers": [self.server.url], "name": name, "ca_file": str(certs.ca_cert),
                "cert_file": str(certs.cert(ident)), "key_file": str(certs.key(ident))}  # fmt: skip

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.server.close()


COUNTER = re.compile(
    r"llmgw_router_cache_(predictions|tokens)_total"
    r'\{(?:kind|model)="([^"]+)",(?:model|source)="([^"]+)"\} (\S+)'
)


class LlmgwRouter:
    def __init__(self, tmp: Path, engines: Engines, fleet: Fleet | None, name: str,
                 cost: dict[str, float]) -> None:  # fmt: skip
        cfg: dict[str, Any] = {
            "listen": {"host": "127.0.0.1", "port": 0},
            "admin": {"host": "127.0.0.1", "port": 0},
            "models": [{"name": MODEL, "engine": "sim"}],
            "endpoints": [
                {"id": engines.ids[i], "url": s.url, "models": [MODEL], "node": f"node-{i}"}
                for i, s in enumerate(engines.sims)
            ],
            "auth": {"allow_anonymous": True},
            "cache": {"cost": cost},
            "log_level": "warning",
        }
        if fleet is not None:
            cfg["log"] = fleet.source(name)
        else:
            cfg["cache"]["events"] = False
        path = tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        self.log = open(tmp / f"{name}.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen([PY, "-m", "llmgw", "router", "--config", str(path)],
                                     stdout=subprocess.PIPE, stderr=self.log)  # fmt: skip
        line = re.compile(r"listening on (http://\S+) admin (http://\S+)")
        m = wait_for_line(self.proc, line, "llmgw router", 60)
        self.url = m.group(1) + "/v1/chat/completions"
        self.admin = m.group(2)
        if fleet is not None:
            time.sleep(1.0)  # its KV feed connects and catches up (empty at start)

    def sources(self) -> str:
        """Where the router's predictions came from, and predicted vs delivered tokens."""
        with urllib.request.urlopen(self.admin + "/metrics", timeout=5) as r:
            text = r.read().decode()
        counts: dict[str, float] = {}
        for line in text.splitlines():
            m = COUNTER.match(line)
            if m:
                label = m.group(3) if m.group(1) == "predictions" else m.group(2)
                counts[label] = counts.get(label, 0.0) + float(m.group(4))
        return " ".join(f"{k}={v:.0f}" for k, v in sorted(counts.items()))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def start_peer(kind: str, engines: Engines, tmp: Path, n: int) -> Peer | None:
    port = free_port()
    workers = [s.url for s in engines.sims]
    if kind == "vllm-router":
        exe = shutil.which("vllm-router", path=str(Path(PY).parent)) or shutil.which("vllm-router")
        if not exe:
            return None
        cmd = [exe, "--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--log-level", "warning", "--worker-urls", *workers]  # fmt: skip
    else:
        try:
            import sglang_router  # noqa: F401
        except ImportError:
            return None
        cmd = [PY, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
               "--port", str(port), "--policy", "cache_aware", "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(free_port()), "--log-level", "warn",
               "--worker-urls", *workers]  # fmt: skip
    return Peer(f"{kind}-{n}", cmd, port, tmp / f"{kind}-{n}.log")


# --------------------------------------------------------------------------- the run


def run_target(name: str, args: argparse.Namespace, workload: str, items: Any,
               tmp: Path, fleet: Fleet) -> dict[str, Any] | None:  # fmt: skip
    sockets = Path(tempfile.mkdtemp(prefix="kvb-", dir="/tmp"))
    engines = Engines(args, sockets)
    stops: list[Any] = []
    # The router's defaults unless a flag says otherwise.
    cost = {k: v for k, v in (("running_tokens", args.running_tokens),
                              ("waiting_tokens", args.waiting_tokens),
                              ("family_tokens", args.family_tokens),
                              ("agree_tokens", args.agree_tokens),
                              ("max_imbalance", args.max_imbalance)) if v is not None}  # fmt: skip
    try:
        pick = "rotate"
        if name == "round-robin":
            urls = engines.urls
        elif name == "oracle":
            urls, pick = engines.urls, "group"
        elif name.startswith("llmgw"):
            events = name != "llmgw approximate"
            if events:
                fleet.relay(engines)
            routers = [LlmgwRouter(tmp, engines, fleet if events else None, f"router-{i}", cost)
                       for i in range(2 if name.endswith("x2") else 1)]  # fmt: skip
            stops += routers
            urls = [r.url for r in routers]
        else:
            kind = "vllm-router" if name.startswith("vllm") else "sglang-router"
            peers = [start_peer(kind, engines, tmp, i) for i in range(2 if "x2" in name else 1)]
            if None in peers:
                return None
            stops += peers
            urls = [p.url for p in peers if p is not None]
        spec = {"urls": urls, "pick": pick, "workload": workload, "items": items,
                "concurrency": args.concurrency, "output_tokens": args.output_tokens}  # fmt: skip
        result = run_client(spec, tmp)
        result["hit_rate"] = engines.hit_rate()
        for r in stops:
            if isinstance(r, LlmgwRouter):
                result.setdefault("sources", []).append(r.sources())
        return result
    finally:
        for s in stops:
            s.stop()
        if name.startswith("llmgw") and name != "llmgw approximate":
            fleet.unrelay()
        engines.stop()
        shutil.rmtree(sockets, ignore_errors=True)


TARGETS = ("round-robin", "oracle", "llmgw events", "llmgw approximate", "llmgw x2",
           "vllm-router", "sglang-router", "sglang-router x2")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--client", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--workload", choices=("shared", "multiturn", "both"), default="both")
    ap.add_argument("--groups", type=int, default=12)
    ap.add_argument("--prefix-tokens", type=int, default=1200)
    ap.add_argument("--question-tokens", type=int, default=40)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--requests", type=int, default=480)
    ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument("--conversations", type=int, default=48)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--opening-tokens", type=int, default=300, help="multi-turn: first prompt")
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--num-blocks", type=int, default=420)
    ap.add_argument("--prefill-per-token-ms", type=float, default=0.05)
    ap.add_argument("--decode-base-ms", type=float, default=6.0)
    ap.add_argument("--decode-per-seq-ms", type=float, default=0.15)
    ap.add_argument("--running-tokens", type=float, default=None, help="llmgw cost model")
    ap.add_argument("--waiting-tokens", type=float, default=None, help="llmgw cost model")
    ap.add_argument("--max-imbalance", type=int, default=None, help="llmgw cost model")
    ap.add_argument("--family-tokens", type=float, default=None, help="llmgw cost model")
    ap.add_argument("--agree-tokens", type=float, default=None, help="llmgw cost model")
    ap.add_argument("--only", default="", help="comma-separated targets, in order (default: all)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if args.client is not None:
        import uvloop

        spec = json.loads(args.client.read_text())
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            print(json.dumps(runner.run(_client(spec))), flush=True)
        return
    wanted = [t.strip() for t in args.only.split(",")] if args.only else list(TARGETS)
    unknown = [t for t in wanted if t not in TARGETS]
    if unknown:
        raise SystemExit(f"--only: unknown targets {unknown}; the targets are {list(TARGETS)}")
    tmp = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    fleet = Fleet(tmp)
    workloads = ["shared", "multiturn"] if args.workload == "both" else [args.workload]
    try:
        for workload in workloads:
            items: Any = shared_prefix(args) if workload == "shared" else conversations(args)
            print(f"\n{workload}: " + (
                f"{args.groups} groups x {args.prefix_tokens}-token prefixes, "
                f"{args.question_tokens}-token questions, {args.requests} requests"
                if workload == "shared" else
                f"{args.conversations} conversations x {args.turns} turns, "
                f"{args.opening_tokens}-token openings, {args.question_tokens}-token questions"
            ) + f", {args.output_tokens} tokens out, {args.concurrency} streams, "
                f"{args.engines} engines x {args.num_blocks} blocks", flush=True)  # fmt: skip
            print(f"  {'target':<20} {'TTFT p50':>9} {'TTFT p99':>9} {'total p50':>10} "
                  f"{'req/s':>7} {'hit rate':>9}", flush=True)  # fmt: skip
            for name in wanted:
                r = run_target(name, args, workload, items, tmp, fleet)
                if r is None:
                    print(f"  {name:<20} (not installed)", flush=True)
                    continue
                errors = f"  ({r['errors']} errors)" if r["errors"] else ""
                print(f"  {name:<20} {r['ttft_p50'] * 1e3:7.0f}ms {r['ttft_p99'] * 1e3:7.0f}ms "
                      f"{r['total_p50'] * 1e3:8.0f}ms {r['rps']:7.1f} {r['hit_rate']:9.2f}{errors}",
                      flush=True)  # fmt: skip
                for line in r.get("sources", []):
                    print(f"  {'':<20} {line}", flush=True)
    finally:
        fleet.close()
        if os.environ.get("BENCH_KEEP"):
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

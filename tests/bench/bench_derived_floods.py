"""One identity flooding a derived stream, and what its readers suffer (docs/security.md,
"The routers' load reports" and "The engines' KV blocks").

Run from the repository root, one attack at a time:

    .venv/bin/python -m tests.bench.bench_derived_floods --attack node
    .venv/bin/python -m tests.bench.bench_derived_floods --attack router --subjects 100
    .venv/bin/python -m tests.bench.bench_derived_floods --attack router-junk
    .venv/bin/python -m tests.bench.bench_derived_floods --attack kv
    .venv/bin/python -m tests.bench.bench_derived_floods --attack kv-junk

A real nats-server (JetStream, mutual TLS, the harness's throwaway CA) and a writer in a
process of its own, publishing as fast as one connection goes:

- `node`: valid, signed load reports of 1 MiB on the node's one subject;
- `router`: the same on `--subjects` worker subjects of one router (`w0`, `w1`, ...);
- `router-junk`: 1-byte unsigned messages, each on a new subject below the router's own;
- `kv`: valid full KV updates of 50,000 keys for `--subjects` endpoints of one node;
- `kv-junk`: 1-byte unsigned messages, each on a new subject below the node's own.

The load-report attacks run against an in-process control plane (leader, one model) with
an honest node heartbeating and an honest router reporting every second, before, during
and after the flood; printed per phase: how late the process's event loop ran (a 20 ms
sleep's overshoot), how old the honest router's latest report was as the leader held it,
how long an honest heartbeat took from publish to fold, the lease lost (ticks of the
monitor) and reconnections. The KV attacks run against a router's KV feed, printing its
event loop's lateness. Last, the lines the readers logged of the messages they skipped
(the process logs nothing else).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import nats  # noqa: E402
import structlog  # noqa: E402

from llmgw import bus  # noqa: E402
from llmgw.control.service import ControlService  # noqa: E402
from llmgw.core import events, kvblocks, loadreport, subjects  # noqa: E402
from llmgw.core.kvindex import KvIndex  # noqa: E402
from llmgw.pki import signing, tls  # noqa: E402
from llmgw.pki.identity import Identity  # noqa: E402
from llmgw.router.config import LogSource  # noqa: E402
from llmgw.router.kvfeed import KvFeed  # noqa: E402
from tests.harness import TestNatsServer, TestPki, connect_as, wait_for  # noqa: E402
from tests.integration.control_kit import SimAgent, control_config, model, running  # noqa: E402

SKIP_LINES = [0]


def count_skips(_logger: object, _name: str, event: dict[str, Any]) -> dict[str, Any]:
    """Counts the readers' lines of skipped messages; drops every line."""
    if event.get("event") in ("bus.undecodable", "bus.signature_refused"):
        SKIP_LINES[0] += 1
    raise structlog.DropEvent


def largest_report() -> bytes:
    endpoints = tuple(
        loadreport.EndpointLoad(endpoint=f"e{i:011d}", model=f"m{i % 2000:04d}", queue=1.5,
                                running=2.25, kv_usage=0.5)
        for i in range(20_000)
    )  # fmt: skip
    models = tuple(loadreport.ModelTraffic(model=f"m{i:04d}", requests=5, samples=3)
                   for i in range(2000))  # fmt: skip
    return loadreport.encode(loadreport.LoadReport(ts=time.time(), endpoints=endpoints,
                                                   models=models))  # fmt: skip


def largest_update(subject: str) -> bytes:
    keys = [random.getrandbits(64) for _ in range(kvblocks.MAX_KEYS_PER_UPDATE)]
    update = kvblocks.KvUpdate(endpoint=subject.rsplit(".", 1)[1], model="m", block_size=16,
                               instance="i", seq=1, full=True, stored=keys)  # fmt: skip
    return kvblocks.encode_update(update)


async def write(cfg: dict[str, Any]) -> None:
    """The writer's process: publish for `seconds`, then print what it sent."""
    ctx = tls.client_context(ca_file=cfg["ca"], cert_file=cfg["cert"], key_file=cfg["key"])
    signer = signing.Signer.load(cfg["cert"], cfg["key"])
    nc = await nats.connect(cfg["url"], tls=ctx, max_reconnect_attempts=3,
                            pending_size=256 * 1024 * 1024)  # fmt: skip
    sent = 0
    end = time.monotonic() + cfg["seconds"]
    if cfg["junk"]:
        while time.monotonic() < end:
            for _ in range(1000):
                await nc.publish(f"{cfg['prefix']}{sent}", b"x")
                sent += 1
            await nc.flush(timeout=30)
    else:
        made = largest_update if cfg["kv"] else (lambda _s: largest_report())
        payloads = {s: made(s) for s in cfg["subjects"]}
        while time.monotonic() < end:
            for subject, data in payloads.items():
                msg_id = secrets.token_hex(12)
                headers = {"Nats-Msg-Id": msg_id, **signer.event_headers(subject, msg_id, data)}
                await nc.publish(subject, data, headers=headers)
                sent += 1
                if sent % 8 == 0:
                    await nc.flush(timeout=30)
    await nc.flush(timeout=30)
    await nc.close()
    print(json.dumps({"sent": sent}), flush=True)


async def flood(server: TestNatsServer, identity: Identity, cfg: dict[str, Any]) -> str:
    certs = server.pki.certs
    cfg = {**cfg, "url": server.url, "ca": str(certs.ca_cert), "cert": str(certs.cert(identity)),
           "key": str(certs.key(identity))}  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.bench.bench_derived_floods", "--writer", json.dumps(cfg),
        stdout=subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip
    out, _ = await proc.communicate()
    return out.decode().strip()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


class Lag:
    """How late the event loop runs a 20 ms sleep."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.stop = asyncio.Event()

    async def run(self) -> None:
        while not self.stop.is_set():
            began = time.perf_counter()
            await asyncio.sleep(0.02)
            self.samples.append(time.perf_counter() - began - 0.02)

    def line(self) -> str:
        s = self.samples
        return (f"loop late ms p50 {1000 * pct(s, 0.5):.1f} p99 {1000 * pct(s, 0.99):.1f} "
                f"max {1000 * max(s, default=0):.1f}")  # fmt: skip


class Phase:
    """What one phase measures of a control plane `svc`: its loop's lateness, the age of
    the honest router's latest report as the leader holds it, how long an honest
    heartbeat takes to fold, and ticks (0.1 s) without the lease."""

    def __init__(
        self, svc: ControlService, agent: SimAgent, publisher: bus.SignalsPublisher
    ) -> None:
        self.svc, self.agent, self.publisher = svc, agent, publisher
        self.lag = Lag()
        self.ages: list[float] = []
        self.folds: list[float] = []
        self.lost = 0

    async def watch(self) -> None:
        subject = subjects.router_signals("r1", 0)
        while not self.lag.stop.is_set():
            await self.publisher.publish(loadreport.LoadReport(ts=time.time()))
            for _ in range(10):
                held = self.svc.scaler.reports.get(subject)
                self.ages.append(time.time() - held.ts if held else float("inf"))
                self.lost += not self.svc.leading
                await asyncio.sleep(0.1)

    async def fold(self) -> None:
        while not self.lag.stop.is_set():
            began = time.monotonic()
            beat = events.Heartbeat(id=self.agent._id("b"), ts=time.time(), node="good",
                                    seq=10**6 + len(self.folds))  # fmt: skip
            published = await self.agent.publish(beat, ttl_s=60)
            while self.svc.state.last_seq < published.seq and not self.lag.stop.is_set():  # noqa: ASYNC110
                await asyncio.sleep(0.01)
            self.folds.append(time.monotonic() - began)
            await asyncio.sleep(0.5)

    def lines(self) -> str:
        ages, folds = self.ages, self.folds
        return (f"  {self.lag.line()}\n  honest report age s p50 {pct(ages, 0.5):.2f} max "
                f"{max(ages):.2f} (over 5 s: {sum(1 for a in ages if a > 5)}/{len(ages)})\n"
                f"  heartbeat folded in s p50 {pct(folds, 0.5):.3f} max "
                f"{max(folds, default=0):.3f}\n  lease lost ticks {self.lost}")  # fmt: skip


async def signals_attack(server: TestNatsServer, args: argparse.Namespace) -> None:
    cfg = control_config(server, "c1", models=(model("m1", 1),))
    async with running(ControlService(cfg)) as svc:
        await wait_for(lambda: svc.leading, 30, "the control plane to lead")
        agent = await SimAgent(server, "good", gpus=2).start()
        router = await connect_as(server, "router", "r1")
        publisher = bus.SignalsPublisher(router, "r1")
        if args.attack == "node":
            identity, cfg_ = Identity("node", "evil"), {"subjects": [subjects.node_signals("evil")]}
        else:
            identity = Identity("router", "evil")
            cfg_ = {"subjects": [subjects.router_signals("evil", i) for i in range(args.subjects)],
                    "prefix": "llmgw.signals.router.evil.x"}  # fmt: skip
        server.pki.client_tls(identity.kind, identity.name)
        cfg_ |= {"junk": args.attack.endswith("junk"), "kv": False, "seconds": args.seconds}
        for name in ("before", "during", "after"):
            phase = Phase(svc, agent, publisher)
            reconnects = svc._nc.stats["reconnects"] if svc._nc is not None else 0
            tasks = [asyncio.create_task(c()) for c in (phase.lag.run, phase.watch, phase.fold)]
            sent = ""
            if name == "during":
                sent = await flood(server, identity, cfg_)
            else:
                await asyncio.sleep(8.0)
            phase.lag.stop.set()
            await asyncio.gather(*tasks)
            now = svc._nc.stats["reconnects"] if svc._nc is not None else 0
            print(f"{name}: {sent}\n{phase.lines()}\n  reconnections {now - reconnects}",
                  flush=True)  # fmt: skip
        await agent.close()
        await bus.close(router)


async def kv_attack(server: TestNatsServer, args: argparse.Namespace) -> None:
    control = await connect_as(server, "control", "c1")
    await bus.provision(control.jetstream())
    await bus.close(control)
    source = LogSource(servers=(server.url,), name="r1", ca_file=str(server.pki.certs.ca_cert))
    feed = KvFeed(source, KvIndex(), tls=server.pki.client_tls("router", "r1"),
                  listed=lambda _endpoint, node: node == "good")  # fmt: skip
    feed.start()
    await wait_for(feed.ready.is_set, 30, "the KV feed")
    identity = Identity("node", "evil")
    server.pki.client_tls("node", "evil")
    cfg = {"subjects": [subjects.kv_updates("evil", f"e{i}") for i in range(args.subjects)],
           "prefix": "llmgw.kv.evil.x", "junk": args.attack == "kv-junk", "kv": True,
           "seconds": args.seconds}  # fmt: skip
    lag = Lag()
    watching = asyncio.create_task(lag.run())
    sent = await flood(server, identity, cfg)
    lag.stop.set()
    await watching
    resets = feed._reader.resets if feed._reader is not None else "-"
    print(f"during: {sent}\n  {lag.line()}\n  feed consumer resets {resets}", flush=True)
    await feed.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attack", default="node",
                        choices=["node", "router", "router-junk", "kv", "kv-junk"])  # fmt: skip
    parser.add_argument("--subjects", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--writer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.writer:
        await write(json.loads(args.writer))
        return
    structlog.configure(processors=[count_skips])
    if args.attack == "kv" and args.subjects == 1:
        args.subjects = 64
    with tempfile.TemporaryDirectory() as tmp:
        pki = TestPki(Path(tmp) / "pki")
        server = TestNatsServer(pki, Path(tmp) / "nats")
        server.root.mkdir()
        server.start()
        try:
            if args.attack.startswith("kv"):
                await kv_attack(server, args)
            else:
                await signals_attack(server, args)
            log = server.log_tail(10_000)
            print(f"server: {log.count('Slow Consumer')} slow-consumer disconnections")
        finally:
            server.close()
    print(f"reader log lines of skipped messages: {SKIP_LINES[0]}")


if __name__ == "__main__":
    asyncio.run(main())

"""Control-plane figures: cold start with and without a snapshot; CPU with 1,000 nodes beating.

Run from the repository root:

    .venv/bin/python tests/bench/bench_control.py                     # 1,000,000 events
    .venv/bin/python tests/bench/bench_control.py --events 200000 --cpu-s 20

It starts a real nats-server (JetStream, file store, mutual TLS, the test harness's
throwaway CA) and:

1. builds a log of `--events` events with pipelined publishes (1,000 nodes registering
   with 8 GPUs each, then heartbeats, cordons and uncordons, periodic re-registrations);
2. cold start without a snapshot: a ControlService (in this process) from start to
   caught up with the whole log (connect, provision, replay, fold);
3. saves a snapshot, appends a tail of `--tail` events, and cold-starts again:
   snapshot + tail;
4. on a fresh server, runs `llmgw control` as a real subprocess with a model of 100
   replicas declared, while this process simulates 1,000 nodes heartbeating every 2 s
   (one publishing process), and reads the control process's CPU time from /proc.

Prints one table. Goals (issue 5): cold start from a snapshot < 2 s whatever the log's
length; < 25% of one core for 1,000 heartbeating nodes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import select
import signal
import subprocess
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
import uvloop  # noqa: E402

from llmgw import bus  # noqa: E402
from llmgw.control.config import SnapshotConfig  # noqa: E402
from llmgw.control.service import ControlService  # noqa: E402
from llmgw.core import events, state  # noqa: E402
from llmgw.pki.identity import Identity  # noqa: E402
from tests.bench import bench_replay  # noqa: E402
from tests.harness import TestNatsServer, TestPki  # noqa: E402
from tests.integration.control_kit import (  # noqa: E402
    control_config,
    model,
    sim_gpus,
    write_config,
)

NODES = 1000
GPUS = sim_gpus(8)


def progress(what: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def dump_tasks() -> None:
    """On SIGUSR1: where every task is (a bench that seems stuck says why)."""
    for task in asyncio.all_tasks():
        task.print_stack(file=sys.stderr)


def quiet() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    logging.getLogger("asyncio").setLevel(logging.ERROR)  # aiohttp/ssl shutdown chatter


def registration(i: int, n: int, ts: float) -> events.NodeRegistered:
    return events.NodeRegistered(
        id=f"reg-{n}", ts=ts, node=f"node-{i:04d}", address=f"10.0.{i // 250}.{i % 250}", gpus=GPUS
    )


def make_events(start: int, count: int) -> list[events.Event]:
    """Event `n` of the mix: registrations first, then 60% heartbeats, 20% cordons,
    19% uncordons, 1% re-registrations (the big ones, ~1.5 kB)."""
    out: list[events.Event] = []
    base = 1.8e9
    for n in range(start, start + count):
        ts = base + n * 1e-3
        if n < NODES:
            out.append(registration(n, n, ts))
            continue
        i = n % NODES
        node = f"node-{i:04d}"
        r = n % 100
        if r < 60:
            out.append(events.Heartbeat(id=f"hb-{n}", ts=ts, node=node, seq=n))
        elif r < 80:
            out.append(
                events.NodeCordoned(id=f"c-{n}", ts=ts, operator="bench", node=node, reason="x")
            )
        elif r < 99:
            out.append(events.NodeUncordoned(id=f"u-{n}", ts=ts, operator="bench", node=node))
        else:
            out.append(registration(i, n, ts))
    return out


class OwnersPublisher:
    """Publishes events as the test administrator, each signed by the identity that owns
    its subject (what readers accept), with pipelined acknowledgements."""

    def __init__(self, nc: bus.BusClient, pki: TestPki, heartbeat_ttl: str = "3600s") -> None:
        self.js = nc.jetstream()
        self.pki = pki
        self.signers: dict[str, Any] = {}
        # The log's heartbeats outlive the run (its counts stay what was published); the
        # live beats of the CPU measurement expire as an agent's do.
        self.heartbeat_ttl = heartbeat_ttl

    async def publish_all(self, batch: list[events.Event]) -> None:
        for e in batch:
            subject, payload = events.subject_of(e), events.encode(e)
            owner = subject if ".node." in subject else subject.rsplit(".", 1)[0]
            signer = self.signers.get(owner)
            if signer is None:
                signer = self.signers.setdefault(owner, self.pki.owner_signer(e))
            headers = {"Nats-Msg-Id": e.id, **signer.event_headers(subject, e.id, payload)}
            if isinstance(e, events.Heartbeat):
                headers["Nats-TTL"] = self.heartbeat_ttl
            await self.js.publish_async(subject, payload, headers=headers)
        await self.js.publish_async_completed()


async def publish(server: TestNatsServer, start: int, count: int) -> float:
    """Publish events [start, start+count) as the test administrator; the seconds it took."""
    nc = await bus.connect(server.url, tls=server.pki.admin_tls(), identity=None, name="bench")
    pub = OwnersPublisher(nc, server.pki)
    began = time.perf_counter()
    chunk = 20_000
    for first in range(start, start + count, chunk):
        if first % 100_000 == 0:
            progress(f"published {first - start:,} of {count:,}")
        await pub.publish_all(make_events(first, min(chunk, start + count - first)))
    took = time.perf_counter() - began
    await bus.close(nc)
    return took


async def cold_start(
    server: TestNatsServer, *, snapshot_after: bool = False
) -> tuple[float, int, str, int]:
    """Seconds from start to caught up; folded seq; digest; snapshot bytes (when saved)."""
    cfg = control_config(
        server,
        "bench-control",
        snapshot=SnapshotConfig(every_events=0, every_s=0),
        sync_models=False,
        lease_ttl_s=5.0,
        reconcile_interval_s=1.0,
    )
    svc = ControlService(cfg)
    progress("cold start")
    stop = asyncio.Event()
    began = time.perf_counter()
    task = asyncio.create_task(svc.run(stop))
    waiter = asyncio.create_task(svc.caught_up.wait())
    await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
    took = time.perf_counter() - began
    if task.done():
        task.result()
    size = 0
    if snapshot_after:
        size = len(state.encode_snapshot(svc.state))
        await svc.snapshot_now()
    seq, digest = svc.state.last_seq, state.digest(svc.state)
    stop.set()
    await task
    progress(f"cold start took {took:.2f} s to fold {seq:,}")
    return took, seq, digest, size


def replicas_placed(admin_url: str) -> int:
    with urllib.request.urlopen(f"{admin_url}/v1/state", timeout=5) as resp:
        return int(json.load(resp)["replicas"])


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


async def cpu_under_heartbeats(pki: TestPki, folder: Path, seconds: float) -> tuple[float, int]:
    """% of one core the control process uses while 1,000 nodes heartbeat every 2 s."""
    server = TestNatsServer(pki, folder / "nats-cpu")
    server.root.mkdir()
    server.start()
    proc = None
    try:
        cfg = control_config(
            server,
            "bench-cpu",
            models=(model("m100", replicas=100, tensor_parallel=8),),
            lease_ttl_s=10.0,
            reconcile_interval_s=1.0,
            snapshot=SnapshotConfig(every_events=0, every_s=0),
            log_level="warning",
        )
        path = write_config(cfg, folder / "bench-cpu.yaml")
        proc = subprocess.Popen(  # noqa: ASYNC220 - started once, before anything is measured
            [sys.executable, "-m", "llmgw", "control", "--config", str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        announced = re.search(rb"admin (http://\S+)", proc.stdout.readline()) if ready else None
        if announced is None:
            raise RuntimeError("llmgw control did not start")
        admin_url = announced.group(1).decode()
        nc = await bus.connect(server.url, tls=pki.admin_tls(), identity=None, name="bench-hb")
        pub = OwnersPublisher(nc, pki, heartbeat_ttl="60s")
        now = time.time()
        await pub.publish_all([registration(i, i, now) for i in range(NODES)])
        sent = 0

        async def beat(until: float) -> None:
            nonlocal sent
            period, slice_n = 2.0, 20  # 1,000 nodes every 2 s: 20 slices of 50 every 0.1 s
            k = 0
            while time.monotonic() < until:
                tick = time.monotonic()
                first = (k % slice_n) * (NODES // slice_n)
                batch = [
                    events.Heartbeat(
                        id=f"hb-{k}-{i}", ts=time.time(), node=f"node-{i:04d}", seq=k + 1
                    )
                    for i in range(first, first + NODES // slice_n)
                ]
                await pub.publish_all(list(batch))
                sent += len(batch)
                k += 1
                await asyncio.sleep(max(0.0, period / slice_n - (time.monotonic() - tick)))

        await beat(time.monotonic() + 8.0)  # warm up: placement of 100 replicas, replay
        placed = await asyncio.to_thread(replicas_placed, admin_url)
        if placed != 100:
            raise RuntimeError(f"expected 100 replicas placed after the warm-up, found {placed}")
        cpu0, t0, sent0 = proc_cpu_s(proc.pid), time.monotonic(), sent
        await beat(time.monotonic() + seconds)
        cpu1, t1 = proc_cpu_s(proc.pid), time.monotonic()
        await bus.close(nc)
        return 100.0 * (cpu1 - cpu0) / (t1 - t0), int((sent - sent0) / (t1 - t0))
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        server.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--tail", type=int, default=10_000)
    parser.add_argument("--cpu-s", type=float, default=30.0)
    parser.add_argument("--skip-cold", action="store_true")
    parser.add_argument("--skip-cpu", action="store_true")
    args = parser.parse_args()
    quiet()
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump_tasks)
    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory(prefix="bench-control-") as tmp:
        folder = Path(tmp)
        pki = TestPki(folder / "pki")
        # Every identity whose events the bench signs, issued up front with one render: a
        # reload per certificate of a 1,000-account config would be most of the run.
        for i in range(NODES):
            pki.issue(Identity("node", f"node-{i:04d}"), reload=False)
        for kind, name in (("operator", "bench"), ("control", "control-test")):
            pki.issue(Identity(kind, name), reload=False)  # type: ignore[arg-type]
        if not args.skip_cold:
            server = TestNatsServer(pki, folder / "nats")
            server.root.mkdir()
            server.start()
            try:
                await cold_start(server)  # provisions the stream on an empty log
                took = await publish(server, 0, args.events)
                rows.append(
                    (f"write {args.events:,} events (pipelined)", f"{took:.1f} s "
                     f"({args.events / took:,.0f}/s)")
                )  # fmt: skip
                took, seq, _, size = await cold_start(server, snapshot_after=True)
                rows.append(
                    (f"cold start, no snapshot ({seq:,} events)", f"{took:.2f} s "
                     f"({seq / took:,.0f} events/s)")
                )  # fmt: skip
                rows.append(("snapshot size (1,000 nodes x 8 GPUs)", f"{size / 1024:,.0f} KiB"))
                await publish(server, args.events, args.tail)
                took, seq2, _, _ = await cold_start(server)
                rows.append(
                    (f"cold start, snapshot + {args.tail:,}-event tail", f"{took:.2f} s "
                     f"(log {seq2:,} events, every signature checked)")
                )  # fmt: skip
                # As a fleet's log is: its leader attested what it verified.
                await bench_replay.attest(server, seq2)
                took, seq3, _, _ = await cold_start(server)
                rows.append(
                    (f"cold start, snapshot + {args.tail:,}-event tail, attested",
                     f"{took:.2f} s (log {seq3:,} events)")
                )  # fmt: skip
            finally:
                server.close()
        if not args.skip_cpu:
            pct, rate = await cpu_under_heartbeats(pki, folder, args.cpu_s)
            rows.append(
                (f"control CPU, 1,000 nodes heartbeating ({rate}/s), 100 replicas",
                 f"{pct:.1f}% of one core")
            )  # fmt: skip
    width = max(len(r[0]) for r in rows)
    print()
    print(f"{'measure'.ljust(width)}  result")
    for name, value in rows:
        print(f"{name.ljust(width)}  {value}")


if __name__ == "__main__":
    uvloop.run(main())  # as `llmgw control` runs

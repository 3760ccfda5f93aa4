"""Throughput of the log: publish (synchronous / asynchronous acks), replay, decode + fold.

Run from the repository root:

    .venv/bin/python tests/bench/bench_log.py            # about a minute
    .venv/bin/python tests/bench/bench_log.py --events 50000 --quick

It starts a real nats-server with JetStream (file storage) under mutual TLS with the
rendered authorization (the test harness's throwaway CA), once with the production
`sync_interval: always` and once with the server default (fsync every 2 minutes),
publishes as a node and replays as a router, through llmgw.bus, and prints a table.
Replay alternatives through nats-py's own consumers are measured for comparison:
they are why `Reader` uses a raw pull consumer with an inline handler.
Every event is signed (llmgw.pki.signing): publishing signs, and the replay rows are
measured twice, on a log of signed events that the Reader verifies and on the same
events unsigned, read with `accept_unsigned_before` (no signature checks: the cost of
reading and folding alone).
Goals (issue 2): replay >= 100,000 events/s; decode + simple fold >= 1,000,000 events/s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import structlog  # noqa: E402
from nats.aio.client import Client  # noqa: E402
from nats.js import api  # noqa: E402

from llmgw import bus  # noqa: E402
from llmgw.bus import keys as bus_keys  # noqa: E402
from llmgw.core import events, subjects  # noqa: E402
from llmgw.pki import signing  # noqa: E402
from llmgw.pki.identity import Identity  # noqa: E402
from tests.harness import TestNatsServer, TestPki, connect_as  # noqa: E402


class Clock:
    """Wall-clock and this process's CPU time over a span: on a shared machine the CPU
    figure (events per CPU-second of the client) shows what the client itself costs."""

    def __init__(self) -> None:
        self.wall = time.perf_counter()
        self.cpu = time.process_time()

    def rates(self, count: int) -> tuple[float, float]:
        wall = time.perf_counter() - self.wall
        cpu = time.process_time() - self.cpu
        return count / wall, count / cpu if cpu > 0 else float("inf")


def make_events(n: int, start: int = 0) -> list[events.Event]:
    """A realistic mix: mostly shard transitions and control decisions, ~110-200 bytes."""
    out: list[events.Event] = []
    for i in range(start, start + n):
        node = f"node-{i % 64:02d}"
        if i % 4 == 0:
            out.append(events.Heartbeat(id=f"e{i}", ts=1.8e9 + i, node=node, seq=i))
        else:
            out.append(
                events.ShardStatus(
                    id=f"e{i}",
                    ts=1.8e9 + i,
                    node=node,
                    replica_id=f"r{i % 500}",
                    generation=1 + i % 3,
                    phase="serving",
                    endpoint=f"http://{node}:8000",
                )
            )
    return out


def fold(state: dict[str, Any], event: events.AnyEvent) -> None:
    """A simple fold: last heartbeat sequence per node, last phase per replica."""
    match event:
        case events.Heartbeat(node=node, seq=seq):
            state[node] = seq
        case events.ShardStatus(replica_id=rid, phase=phase):
            state[rid] = phase
        case _:
            pass


async def connect_plain(server: TestNatsServer, kind: str, name: str) -> Client:
    import nats

    ctx = await asyncio.to_thread(server.pki.client_tls, kind, name)
    identity = Identity(kind, name)  # type: ignore[arg-type]
    nc = await nats.connect(server.url, tls=ctx, inbox_prefix=identity.inbox_prefix)
    bus_keys.bind(nc, await asyncio.to_thread(server.pki.keys, kind, name))
    return nc


def unchecked(server: TestNatsServer) -> signing.Verifier:
    """A verifier that takes every unsigned event (a log from before signing)."""
    return server.pki.verifier(accept_unsigned_before=2**62)


async def publish_figures(server: TestNatsServer, n_sync: int, n_async: int) -> dict[str, float]:
    control = await connect_as(server, "control", "bench-control")
    await bus.provision(control.jetstream())
    node = await connect_as(server, "node", "node-00")
    publisher = bus.Publisher(node.jetstream(), timeout_s=10)
    sync_events = [e for e in make_events(n_sync * 4) if isinstance(e, events.Heartbeat)][:n_sync]
    sync_events = [
        events.Heartbeat(id=f"s{e.id}", ts=e.ts, node="node-00", seq=e.seq) for e in sync_events
    ]
    t0 = time.perf_counter()
    for event in sync_events:
        await publisher.publish(event)
    sync_rate = n_sync / (time.perf_counter() - t0)
    async_events = [
        events.Heartbeat(id=f"a{i}", ts=1.8e9 + i, node="node-00", seq=i) for i in range(n_async)
    ]
    t0 = time.perf_counter()
    for i in range(0, n_async, 5000):
        await publisher.publish_all(async_events[i : i + 5000])
    async_rate = n_async / (time.perf_counter() - t0)
    await node.close()
    await control.close()
    return {"sync": sync_rate, "async": async_rate}


async def fill(server: TestNatsServer, n: int, *, signed: bool) -> None:
    """Store n events, signed by the nodes that own them (or unsigned)."""
    control = await connect_as(server, "control", "bench-control")
    await bus.provision(control.jetstream())
    all_events = make_events(n)
    by_node: dict[str, list[events.Event]] = {}
    for e in all_events:
        assert isinstance(e, events.NodeEvent)
        by_node.setdefault(e.node, []).append(e)
    # One connection per node would be realistic but slow to set up for 64 nodes;
    # publishing everything through the control's unrestricted bench identity is not
    # allowed (control may not write node subjects), so use a test admin client.
    import nats

    admin = await nats.connect(server.url, tls=server.pki.admin_tls(), inbox_prefix="_INBOX.admin")
    js = admin.jetstream()
    signers = {node: server.pki.signer("node", node) for node in by_node} if signed else {}
    for i in range(0, n, 5000):
        for e in all_events[i : i + 5000]:
            subject, payload = events.subject_of(e), events.encode(e)
            headers = {"Nats-Msg-Id": e.id}
            if isinstance(e, events.Heartbeat):
                headers["Nats-TTL"] = "3600s"  # only heartbeats expire, and every one does
            if signed:
                assert isinstance(e, events.NodeEvent)
                headers |= signers[e.node].event_headers(subject, e.id, payload)
            await js.publish_async(subject, payload, headers=headers)
        await js.publish_async_completed()
    await admin.close()
    await control.close()


async def replay_reader(
    server: TestNatsServer, n: int, fast: bool, verifier: signing.Verifier | None = None
) -> tuple[float, float]:
    router = (
        await connect_as(server, "router", "router-bench")
        if fast
        else await connect_plain(server, "router", "router-bench")
    )
    state: dict[str, Any] = {}
    count = 0
    clock = Clock()
    async with bus.Reader(router, follow=False, batch=20_000, verifier=verifier) as reader:
        async for batch in reader.batches():
            for record in batch:
                fold(state, record.event)
            count += len(batch)
    rate = clock.rates(count)
    assert count == n, (count, n, list(reader.skipped)[:3])
    await router.close()
    return rate


async def replay_ordered(server: TestNatsServer, n: int) -> tuple[float, float]:
    nc = await connect_plain(server, "router", "router-bench")
    js = nc.jetstream()
    done = asyncio.Event()
    count = 0
    state: dict[str, Any] = {}

    async def cb(msg: Any) -> None:
        nonlocal count
        meta = msg.metadata
        fold(state, events.decode(msg.data))
        count += 1
        if count == n or meta.num_pending == 0:
            done.set()

    clock = Clock()
    sub = await js.subscribe(
        ">",
        stream=subjects.STREAM,
        ordered_consumer=True,
        deliver_policy=api.DeliverPolicy.ALL,
        pending_msgs_limit=-1,
        pending_bytes_limit=-1,
        cb=cb,
    )
    await done.wait()
    rate = clock.rates(count)
    await sub.unsubscribe()
    await bus.close(nc)
    return rate


async def replay_fetch(server: TestNatsServer, n: int) -> tuple[float, float]:
    nc = await connect_plain(server, "router", "router-bench")
    js = nc.jetstream()
    psub = await js.pull_subscribe(
        ">",
        stream=subjects.STREAM,
        config=api.ConsumerConfig(ack_policy=api.AckPolicy.NONE),
    )
    state: dict[str, Any] = {}
    count = 0
    clock = Clock()
    while count < n:
        msgs = await psub.fetch(5000, timeout=5)
        for m in msgs:
            _ = m.metadata
            fold(state, events.decode(m.data))
        count += len(msgs)
    rate = clock.rates(count)
    await bus.close(nc)
    return rate


def decode_fold(n: int, repeats: int = 3) -> tuple[tuple[float, float], int]:
    """Best of `repeats` passes over n encoded events (the machine is shared)."""
    encoded = [events.encode(e) for e in make_events(n)]
    size = sum(len(b) for b in encoded) // len(encoded)
    decode = events.decode
    best = (0.0, 0.0)
    for _ in range(repeats):
        state: dict[str, Any] = {}
        clock = Clock()
        for data in encoded:
            fold(state, decode(data))
        best = max(best, clock.rates(n))
    return best, size


def verify_decode_fold(n: int, pki: TestPki) -> tuple[float, float]:
    """Signature check + decode + fold of n signed events, in process (no server)."""
    verifier = signing.Verifier(pki.ca.cert)
    signers: dict[str, signing.Signer] = {}
    signed = []
    for e in make_events(n):
        assert isinstance(e, events.NodeEvent)
        signer = signers.get(e.node) or signers.setdefault(e.node, pki.signer("node", e.node))
        subject, payload = events.subject_of(e), events.encode(e)
        headers = signer.event_headers(subject, e.id, payload)
        sig, cert = headers[signing.SIG_HEADER].encode(), headers[signing.CERT_HEADER].encode()
        signed.append((subject, e.id.encode(), payload, sig, cert))
    state: dict[str, Any] = {}
    when = time.time()
    clock = Clock()
    for seq, (subject, mid, payload, sig, cert) in enumerate(signed, 1):
        assert verifier.event_refusal(subject, mid, payload, sig, cert, seq=seq, when=when) is None
        fold(state, events.decode(payload))
    return clock.rates(n)


def quiet_logs() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=200_000, help="events replayed")
    parser.add_argument("--quick", action="store_true", help="fewer publishes, no fetch row")
    parser.add_argument(
        "--loop", choices=("uvloop", "asyncio"), default="uvloop", help="event loop"
    )
    args = parser.parse_args()
    print(f"event loop: {args.loop}; replaying {args.events:,} events", flush=True)
    quiet_logs()
    n = args.events
    n_sync, n_async = (500, 10_000) if args.quick else (2_000, 50_000)
    rows: list[tuple[str, str, str, str]] = []

    def row(what: str, setting: str, rates: tuple[float, float] | float) -> None:
        wall, cpu = rates if isinstance(rates, tuple) else (rates, None)
        rows.append((what, setting, f"{wall:,.0f}", "" if cpu is None else f"{cpu:,.0f}"))

    print(f"load average before: {os.getloadavg()[0]:.2f} (2 = both cores busy)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        pki = TestPki(Path(tmp) / "pki")
        for sync in ("always", None):
            server = TestNatsServer(pki, Path(tmp) / f"nats-{sync}", sync_interval=sync)
            server.root.mkdir()
            server.start()
            try:
                figures = await publish_figures(server, n_sync, n_async)
            finally:
                server.close()
            label = f"sync_interval {sync or 'default (2 min)'}"
            row("publish, synchronous ack", label, figures["sync"])
            row("publish, asynchronous acks", label, figures["async"])

        server = TestNatsServer(pki, Path(tmp) / "nats-replay")
        server.root.mkdir()
        server.start()
        try:
            await fill(server, n, signed=False)
            off = unchecked(server)
            runs = [await replay_reader(server, n, fast=True, verifier=off) for _ in range(3)]
            row("replay + decode + fold: bus.Reader, unsigned", f"{n:,} events", max(runs))
            plain = await replay_reader(server, n, fast=False, verifier=off)
            row("replay: bus.Reader on a plain nats-py client", f"{n:,} events", plain)
            row(
                "replay: nats-py ordered consumer", f"{n:,} events", await replay_ordered(server, n)
            )
            if not args.quick:
                m = min(n, 50_000)
                row(
                    "replay: nats-py pull fetch(5000)",
                    f"{m:,} events",
                    await replay_fetch(server, m),
                )
        finally:
            server.close()

        server = TestNatsServer(pki, Path(tmp) / "nats-replay-signed")
        server.root.mkdir()
        server.start()
        try:
            await fill(server, n, signed=True)
            runs = [await replay_reader(server, n, fast=True) for _ in range(3)]
            row("replay + verify + decode + fold: bus.Reader", f"{n:,} signed events", max(runs))
        finally:
            server.close()
        m = min(n, 50_000)
        row("verify + decode + fold, in-process", f"{m:,} signed", verify_decode_fold(m, pki))

    rates, size = decode_fold(300_000)
    row("decode + simple fold, in-process", f"300,000 x {size} B", rates)

    head = ("measure", "setting", "events/s", "per client CPU-s")
    widths = [max(len(r[i]) for r in [*rows, head]) for i in range(4)]
    print()
    for i, line in enumerate([head, *rows]):
        left = f"{line[0]:<{widths[0]}}  {line[1]:<{widths[1]}}"
        print(f"{left}  {line[2]:>{widths[2]}}  {line[3]:>{widths[3]}}")
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    print("file storage, R1, mutual TLS, one machine; best of 3 for the Reader and the fold")
    print("goals: replay >= 100,000 events/s; decode + simple fold >= 1,000,000 events/s")


if __name__ == "__main__":
    if "--loop=asyncio" not in sys.argv and "asyncio" not in sys.argv:
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())

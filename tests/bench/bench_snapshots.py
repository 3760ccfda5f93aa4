"""Loading a snapshot as a router does (by request: a metadata listing, one message get per
chunk, the signature checked) beside nats-py's push-consumer object-store get of the same
object (which no llmgw identity may use: docs/security.md), in one run.

Run from the repository root:

    .venv/bin/python -m tests.bench.bench_snapshots
    .venv/bin/python -m tests.bench.bench_snapshots --sizes-mib 1,5,20,50 --rounds 5

A real nats-server (JetStream, file store, mutual TLS, the harness's throwaway CA); the
control identity saves each size once, a router loads it; the push get runs as the test
harness's administrator inside the streams' account. Best of `--rounds`, seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import structlog  # noqa: E402

from llmgw import bus  # noqa: E402
from llmgw.bus import snapshots  # noqa: E402
from tests.harness import Connector, TestNatsServer, TestPki  # noqa: E402


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", default="1,5,20")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    sizes = [int(s) for s in args.sizes_mib.split(",") if s.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        pki = TestPki(Path(tmp) / "pki")
        server = TestNatsServer(pki, Path(tmp) / "nats")
        server.root.mkdir()
        server.start()
        connect = Connector(server)
        try:
            control = await connect("control", "bench-control")
            await bus.provision(control.jetstream())
            store = await bus.SnapshotStore.open(control.jetstream(), keep=len(sizes) + 1)
            router = await bus.SnapshotStore.open((await connect("router", "r1")).jetstream())
            raw = await (await connect.admin()).jetstream().object_store(bus.SNAPSHOT_BUCKET)
            print(f"{'size':>8}  {'llmgw (by request)':>20}  {'nats-py push get':>17}")
            for seq, mib in enumerate(sizes, start=1):
                data = os.urandom(mib * 1024 * 1024)
                await store.save(data, seq)
                ours = theirs = float("inf")
                for _ in range(args.rounds):
                    started = time.perf_counter()
                    got = await router.load(at_or_before=seq)
                    ours = min(ours, time.perf_counter() - started)
                    assert got is not None
                    assert got.data == data
                    started = time.perf_counter()
                    await raw.get(snapshots.object_name(seq))
                    theirs = min(theirs, time.perf_counter() - started)
                print(f"{mib:>5} MiB  {ours:>18.3f} s  {theirs:>15.3f} s")
        finally:
            await connect.close()
            server.close()


if __name__ == "__main__":
    asyncio.run(main())

"""Agent benchmarks: spawn latency, command-to-spawn latency, and the idle footprint.

Run: `.venv/bin/python tests/bench/bench_agent.py` (about 2 minutes). Prints:
- time from calling Supervisor.start to the engine process existing (goal < 50 ms,
  the engine's own start-up excluded), median and worst over N starts;
- the time Supervisor.start takes to return (spawn + pid file + first status);
- resident memory and CPU of the agent process (this one) while 8 `llmgw sim`
  shards serve and nothing happens, with the default 0.5 s poll;
- through the whole agent service, against a real nats-server (mTLS): time from the
  control plane publishing a StartShard to the engine process existing (goal < 50 ms),
  and the service's idle CPU / RSS with 8 serving sim shards, heartbeats every 5 s.
  `--skip-service` leaves this part out.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from llmgw import logs
from llmgw.agent import engines
from llmgw.agent.discovery import simulated
from llmgw.agent.engines import Launch, LaunchContext
from llmgw.agent.shards import ShardView
from llmgw.agent.supervisor import Settings, Supervisor
from llmgw.core.inventory import Inventory
from llmgw.core.profile import LaunchSpec
from llmgw.natsd import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


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


async def service_latency(state: Path, runs: int, shards: int, window_s: float) -> None:
    """StartShard published -> engine spawned, through NATS and the whole AgentService."""
    import msgspec

    from llmgw import bus, pidfiles
    from llmgw.agent import config as agent_config
    from llmgw.agent.service import AgentService
    from llmgw.core import events
    from llmgw.pki.identity import Identity

    root = str(REPO_ROOT)
    if root not in sys.path:  # run as a script: the repo root holds the test harness
        sys.path.insert(0, root)
    from tests.harness import Connector, TestNatsServer, TestPki

    pki = TestPki(state / "pki")
    server = TestNatsServer(pki, state / "nats")
    server.root.mkdir(parents=True)
    server.start()
    connector = Connector(server)
    stop = asyncio.Event()
    node = "bench-node"
    node_id = Identity("node", node)
    pki.client_tls("node", node)
    agent_state = state / "agent"
    cfg = agent_config.complete(
        msgspec.convert(
            {
                "node_id": node,
                "address": "127.0.0.1",
                "state_dir": str(agent_state),
                "sim_gpus": "8xh100-80g",
                "engine_host": "127.0.0.1",
                "engine_ports": {"first": 1024, "last": 65535},
                # A stand-in engine that exists at once and binds nothing: only the spawn
                # is measured, not an engine's own start-up.
                "engine_commands": {"llamacpp": ["/bin/sh", "-c", "exec sleep 300", "engine"]},
                "nats": {
                    "servers": [server.url],
                    "ca_file": str(pki.certs.ca_cert),
                    "cert_file": str(pki.certs.cert(node_id)),
                    "key_file": str(pki.certs.key(node_id)),
                },
            },
            agent_config.AgentConfig,
        )
    )
    svc = AgentService(cfg)
    task = None
    try:
        control = await connector("control", "bench-control")
        js = control.jetstream()
        await bus.provision(js)
        publisher = bus.Publisher(js)
        task = asyncio.create_task(svc.run(stop))
        await asyncio.wait_for(svc.connected_once.wait(), 30)
        await asyncio.sleep(1.0)  # the command consumer is created
        latencies = []
        for i in range(runs):
            spec = LaunchSpec(
                engine="llamacpp",
                model="m",
                served_name="m",
                port=2000 + i,
                gpus=(),
                start_timeout_s=600,
            )
            cmd = events.StartShard(
                id=f"bench-{i}",
                ts=time.time(),
                epoch=1,
                node=node,
                replica_id=f"lat-{i}",
                generation=1,
                launch=spec,
            )
            sent = time.time()
            await publisher.publish(cmd)
            deadline = time.monotonic() + 10
            while True:
                records = {
                    r.replica_id: r for _, r in pidfiles.load_all(agent_state) if r is not None
                }
                if f"lat-{i}" in records:
                    latencies.append((records[f"lat-{i}"].started_at - sent) * 1000)
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"lat-{i} was never spawned")
                await asyncio.sleep(0.002)
            # One at a time: each command arrives alone, as the control plane sends them.
            await asyncio.sleep(0.05)
        ms = sorted(latencies)
        print(f"command published -> engine spawned, through NATS + agent service, {runs} runs:")
        print(
            f"  median {statistics.median(ms):.2f} ms, p95 {ms[int(0.95 * (runs - 1))]:.2f} ms, "
            f"max {ms[-1]:.2f} ms   (goal < 50 ms; includes the publish's own round trip)"
        )
        assert svc.supervisor is not None
        await svc.supervisor.stop_all(grace_s=2)

        serving = 0
        for i in range(shards):
            spec = LaunchSpec(
                engine="sim", model=f"m{i}", served_name=f"m{i}", port=free_port(), gpus=(i,)
            )
            await publisher.publish(
                events.StartShard(
                    id=f"idle-{i}",
                    ts=time.time(),
                    epoch=1,
                    node=node,
                    replica_id=f"idle-{i}",
                    generation=1,
                    launch=spec,
                )
            )
        deadline = time.monotonic() + 180
        while serving < shards:
            serving = sum(1 for v in svc.supervisor.views() if v.phase == "serving")
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {serving} of {shards} shards serve")
            await asyncio.sleep(0.2)
        await asyncio.sleep(2)
        cpu0, wall0 = os.times(), time.monotonic()
        await asyncio.sleep(window_s)
        cpu1, wall1 = os.times(), time.monotonic()
        cpu_s = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
        print(
            f"agent service idle with {shards} serving sim shards over {window_s:.0f} s "
            f"(poll {cfg.engine_poll_s} s, heartbeat {cfg.heartbeat_s} s): "
            f"CPU {100 * cpu_s / (wall1 - wall0):.2f} % of one core, RSS {rss_mib():.1f} MiB "
            f"(this process: service + a control client); heartbeats sent {svc.heartbeats_sent}"
        )
    finally:
        if svc.supervisor is not None:
            await svc.supervisor.stop_all(grace_s=5)
        stop.set()
        if task is not None:
            await asyncio.wait_for(task, 30)
        await connector.close()
        server.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--window", type=float, default=20.0)
    parser.add_argument("--skip-service", action="store_true")
    args = parser.parse_args()
    logs.setup("warning")
    with tempfile.TemporaryDirectory() as tmp:
        await spawn_latency(Path(tmp), args.runs)
        await idle_footprint(Path(tmp), args.shards, args.window)
        if not args.skip_service:
            await service_latency(Path(tmp), args.runs, args.shards, args.window)


if __name__ == "__main__":
    asyncio.run(main())

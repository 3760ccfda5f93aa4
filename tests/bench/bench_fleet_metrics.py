"""The cost of the fleet's state as metrics: one scrape of a control plane's /metrics at
1,000 nodes, 8,000 GPUs and 1,000 replicas (issue 21).

Run from the repository root:

    .venv/bin/python tests/bench/bench_fleet_metrics.py
    .venv/bin/python tests/bench/bench_fleet_metrics.py --nodes 200 --scrapes 50

It settles a fleet with the core's in-memory leader and agents (tests/unit/scenarios.py:
`--nodes` nodes of 8 H100s, 10 models of 8-GPU replicas filling every GPU), then times,
in this process, CPU only: the fleet families from the folded state
(llmgw.core.fleet_metrics), a whole /metrics body as the leader renders it, the
follower's extra cost (one reconcile plan per scrape for the unplaceable verdicts), and
the service discovery's target groups. It prints the scrape's size. Figures are per
scrape, the median of `--scrapes`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402

from llmgw.control.metrics import Metrics  # noqa: E402
from llmgw.core import fleet_metrics, views  # noqa: E402
from tests.unit import scenarios  # noqa: E402
from tests.unit.scenarios import Sim, profile  # noqa: E402


def median_ms(fn: object, n: int) -> float:
    times = []
    for _ in range(n):
        started = time.process_time()
        fn()  # type: ignore[operator]
        times.append((time.process_time() - started) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--scrapes", type=int, default=20)
    args = parser.parse_args()
    started = time.perf_counter()
    sim = Sim()
    for i in range(args.nodes):
        # Every agent serves its own /metrics, so discovery lists it beside its engines.
        node = f"node-{i:04d}"
        reg = scenarios.registered(node, ts=sim.now)
        sim.append(msgspec.structs.replace(reg, id=sim.eid("reg"), metrics=f"{node}:9191"))
    models = 10
    for m in range(models):
        sim.declare(profile(f"model-{m}", tensor_parallel=8, replicas=args.nodes // models))
    sim.settle(rounds=40)
    st = sim.state
    replicas = sum(1 for r in st.replicas.values() if not r.retired)
    gpus = sum(len(n.gpus) for n in st.nodes.values())
    print(
        f"fleet: {len(st.nodes):,} nodes, {gpus:,} GPUs, {replicas:,} replicas "
        f"(settled in {time.perf_counter() - started:.1f} s)"
    )
    metrics = Metrics()
    metrics.export_fleet(lambda: (st, {}))
    body = metrics.render()
    fleet_lines = [ln for ln in body.decode().splitlines() if ln.startswith("llmgw_fleet_")]
    plans = max(3, args.scrapes // 4)
    routers = {f"router-{i}": f"router-{i}:9090" for i in range(8)}
    control = ("control-1:9190", "control-1", routers)
    rows = [
        (
            "fleet families from the state",
            f"{median_ms(lambda: fleet_metrics.families(st, {}), args.scrapes):.1f} ms",
        ),
        ("whole /metrics body (leader)", f"{median_ms(metrics.render, args.scrapes):.1f} ms"),
        (
            "follower's extra: plan for unplaceable verdicts",
            f"{median_ms(lambda: views.unplaceable_codes(st, sim.now), plans):.1f} ms",
        ),
        (
            "service discovery (/v1/sd/prometheus) target groups",
            f"{median_ms(lambda: views.prometheus_targets(st, *control), args.scrapes):.1f} ms "
            f"({len(views.prometheus_targets(st, *control)):,} groups)",
        ),
        ("scrape size", f"{len(body) / 1024:,.0f} KiB, {len(fleet_lines):,} fleet samples"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"\none scrape, CPU time, median of {args.scrapes}:")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


if __name__ == "__main__":
    main()

"""The control plane's cost of autoscaling at 1,000 nodes and 200 models (issue 19).

Run from the repository root:

    .venv/bin/python tests/bench/bench_autoscale_cost.py
    .venv/bin/python tests/bench/bench_autoscale_cost.py --nodes 200 --models 50 --routers 4

A fleet of `--nodes` nodes with one endpoint each spread over `--models` autoscaled
models, and `--routers` router processes, each reporting every model and every endpoint
once a second (llmgw.core.loadreport). Each model's load is a random walk (seeded). For
`--seconds` of simulated time the leader's `Scaler` (llmgw.control.scaler) takes every
report and decides once a second, as `llmgw control` does; each decision is folded, as the
log would. Printed: the CPU of one decision pass (median and p99), of decoding one report,
a report's size (what `llmgw-signals` carries per router per second, outside the log), and
the scaling decisions per second the log gains, over the whole run; and what checking the
signatures costs the leader: each router's report and each node's agent's (one every 5 s
per node, its engines' load) verified as `llmgw.bus.signals.SignalsReader` does.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from llmgw.control.scaler import Scaler  # noqa: E402
from llmgw.core import events, loadreport  # noqa: E402
from llmgw.core.autoscale import Autoscale  # noqa: E402
from llmgw.core.profile import ModelProfile  # noqa: E402
from llmgw.core.state import ClusterState, Endpoint, apply  # noqa: E402

SPEC = Autoscale(min=1, max=20, waiting_per_replica=4.0, running_per_replica=16.0,
                 kv_usage=0.8, ttft_p90_s=1.0, itl_p90_s=0.1, up_window_s=15.0,
                 down_window_s=300.0, max_step=2)  # fmt: skip


def fleet(nodes: int, models: int) -> ClusterState:
    st = ClusterState()
    for m in range(models):
        profile = ModelProfile(name=f"model-{m}", engine="sim", replicas=1, autoscale=SPEC)
        reason = apply(st, events.ModelDeclared(id=f"d{m}", ts=1.0, operator="bench",
                                                profile=profile), m + 1)  # fmt: skip
        assert reason is None, reason
    for n in range(nodes):
        model = f"model-{n % models}"
        st.endpoints[f"r{n}"] = Endpoint(replica_id=f"r{n}", model=model, url=f"http://n{n}:8000")
    st.last_seq = models
    return st


def reports(
    st: ClusterState, routers: int, load: dict[str, float], now: float, rng: random.Random
) -> list[tuple[str, bytes]]:
    per_model: dict[str, list[str]] = {}
    for rid, ep in st.endpoints.items():
        per_model.setdefault(ep.model, []).append(rid)
    out = []
    for r in range(routers):
        models = tuple(
            loadreport.ModelTraffic(
                model=m,
                requests=int(load[m] * 10 / routers),
                waiting=int(load[m] / 20),
                ttft_p90_s=round(0.2 + load[m] / 400, 3),
                itl_p90_s=0.03,
                samples=50,
            )
            for m in sorted(load)
        )
        engines = tuple(
            loadreport.EndpointLoad(
                endpoint=rid,
                model=m,
                queue=load[m] / 50 / len(rids),
                running=load[m] / len(rids),
                kv_usage=min(load[m] / 400, 1.0),
            )
            for m, rids in per_model.items()
            for rid in rids
        )
        report = loadreport.LoadReport(ts=now, models=models, endpoints=engines)
        out.append((f"llmgw.signals.router.router-{r}.w0", loadreport.encode(report)))
    return out


def signature_cost(routers: int, nodes: int, report: bytes, node_report: bytes) -> str:
    """CPU per second of checking every report's signature (a real CA and certificates)."""
    import tempfile

    from tests.harness import TestPki

    with tempfile.TemporaryDirectory() as tmp:
        pki = TestPki(Path(tmp))
        costs = []
        for kind, name, subject, payload in (
            ("router", "router-0", "llmgw.signals.router.router-0.w0", report),
            ("node", "node-0", "llmgw.signals.node.node-0", node_report),
        ):
            signer = pki.signer(kind, name)
            verifier = pki.verifier()
            headers = signer.event_headers(subject, "id-1", payload)
            sig, cert = (v.encode() for v in headers.values())
            began = time.process_time()
            for _ in range(200):
                assert verifier.event_refusal(subject, b"id-1", payload, sig, cert, seq=1,
                                              when=time.time()) is None  # fmt: skip
            costs.append((time.process_time() - began) / 200)
    per_s = routers * costs[0] + nodes / 5 * costs[1]
    return (f"  signatures: {costs[0] * 1e6:.0f} µs per router report, {costs[1] * 1e6:.0f} µs "
            f"per node report; {routers} routers every second and {nodes} nodes every 5 s: "
            f"{per_s * 100:.1f} % of a core")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--models", type=int, default=200)
    ap.add_argument("--routers", type=int, default=8)
    ap.add_argument("--seconds", type=int, default=600)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    st = fleet(args.nodes, args.models)
    load = {m: rng.uniform(5, 100) for m in st.models}
    scaler = Scaler()
    passes: list[float] = []
    decodes: list[float] = []
    sizes: list[int] = []
    decided = 0
    seq = st.last_seq
    for t in range(args.seconds):
        now = 1000.0 + t
        for m in load:
            load[m] = min(max(load[m] * rng.uniform(0.9, 1.1) + rng.uniform(-2, 2), 0), 400)
        for subject, data in reports(st, args.routers, load, now, rng):
            began = time.process_time()
            report = loadreport.decode(data)
            decodes.append(time.process_time() - began)
            sizes.append(len(data))
            scaler.note(subject, report)
        began = time.process_time()
        out = scaler.decide(st, now, epoch=1, basis_seq=seq, unplaceable={}, ids=lambda b: b)
        passes.append(time.process_time() - began)
        for d in out:
            seq += 1
            assert apply(st, d, seq) is None
        decided += len(out)
    passes.sort()
    print(f"{args.nodes} nodes, {args.models} autoscaled models, {args.routers} routers, "
          f"{args.seconds} s of a random-walk load")  # fmt: skip
    print(f"  decision pass (aggregate every report, recommend, decide): median "
          f"{statistics.median(passes) * 1000:.1f} ms, p99 "
          f"{passes[int(len(passes) * 0.99) - 1] * 1000:.1f} ms of CPU, once a second")  # fmt: skip
    size = statistics.median(sizes) / 1024
    decode_ms = statistics.median(decodes) * 1000
    print(f"  one report: {size:.0f} KiB, decoded in {decode_ms:.2f} ms; llmgw-signals "
          f"carries {args.routers * size:.0f} KiB/s, none of it in the log")  # fmt: skip
    node_report = loadreport.encode(loadreport.LoadReport(ts=1.0, endpoints=(
        loadreport.EndpointLoad(endpoint="r1", model="model-1", queue=1, running=8,
                                kv_usage=0.5),)))  # fmt: skip
    print(signature_cost(args.routers, args.nodes, reports(st, args.routers, load, 1.0, rng)[0][1],
                         node_report))  # fmt: skip
    print(f"  scaling decisions: {decided} in {args.seconds} s = "
          f"{decided / args.seconds:.2f} events/s added to the log")  # fmt: skip


if __name__ == "__main__":
    main()

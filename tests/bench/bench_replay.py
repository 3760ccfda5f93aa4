"""`llmgw ctl replay` on a large log: events/s from the stream, and time to a target
with a snapshot near it (issue 7).

Run from the repository root:

    .venv/bin/python tests/bench/bench_replay.py                  # 1,000,000 events
    .venv/bin/python tests/bench/bench_replay.py --events 200000  # quicker

It starts a real nats-server (JetStream, file storage, mutual TLS with the rendered
authorization, the test harness's throwaway CA), publishes a realistic log (64 nodes
of 8 GPUs, 8 models, 256 replicas cycling through restarts: placed, start command,
starting, loading, serving, endpoint up; one heartbeat per event besides) through the
test-only admin identity with pipelined acks, saves a snapshot of the folded state
10,000 events before the end (as the control plane would), then measures, as an
operator identity, through llmgw.ctl.history (what `llmgw ctl replay` runs):

- reading the stream alone (bus.Reader, decode, no fold), and without decoding;
- `replay` from the beginning without snapshots: events/s (goal >= 100,000);
- `replay --to <end>` starting from the snapshot 10,000 events before (goal < 2 s);
- the same as a real `python -m llmgw ctl replay --to N --json` process, end to end;
- `replay --verify` on a second log written by the core's in-memory leader and agents
  (tests/unit/scenarios.py: 64 nodes, 8 models, rounds of drains and restarts), so that
  every decision batch is real: batches re-planned per second, and the CLI end to end.

Events are signed by the identities that own their subjects (llmgw.pki.signing). The
replay rows are measured on each log `--modes` names, in one run: the events unsigned,
read with `accept_unsigned_before` (no signature checks: what reading and folding cost
alone); the signed log with every event's signature verified; and the signed log after a
control identity has attested it as the leader does (llmgw.core.attestation: one pass of
a verifying reader, then `control.log_attested` events), so that ctl checks each event's
digest against the attestation instead of its signature. The `-expired` logs are the same
events with their heartbeats expired, as a fleet's log is (heartbeats live two minutes):
`unsigned-expired` beside `attested-expired` is what signing costs on the same events.

Every run's digest is checked against a local fold of the same events. Wall-clock
rates depend on the load of this (shared, 2-core) machine, where nats-server competes
for the same cores; the replay row also gives events per CPU-second of ctl itself, and
each event's CPU in ctl and in nats-server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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
from llmgw.bus import keys as bus_keys  # noqa: E402
from llmgw.control import attesting  # noqa: E402
from llmgw.control import verify as control_verify  # noqa: E402
from llmgw.core import events, state  # noqa: E402
from llmgw.core.inventory import Gpu  # noqa: E402
from llmgw.core.profile import LaunchSpec, ModelProfile  # noqa: E402
from llmgw.ctl import history  # noqa: E402
from llmgw.pki.identity import Identity  # noqa: E402
from tests.harness import TestNatsServer, TestPki, connect_as  # noqa: E402
from tests.unit import scenarios  # noqa: E402

NODES = 64
GPUS = 8
MODELS = 8
REPLICAS = 256
T0 = 1.8e9


def make_log(n: int) -> list[events.Event]:
    """`n` events that all fold (no refusals): setup, then replica restart cycles + heartbeats."""
    out: list[events.Event] = [
        events.LeaderElected(id="leader-1", ts=T0, leader="control-a", epoch=1)
    ]
    for i in range(NODES):
        out.append(
            events.NodeRegistered(
                id=f"reg-{i}",
                ts=T0,
                node=f"node-{i:02d}",
                address=f"10.0.0.{i}",
                gpus=tuple(
                    Gpu(
                        index=g,
                        uuid=f"GPU-{i}-{g}",
                        name="NVIDIA H100 80GB HBM3",
                        gpu_class="h100-80g",
                        memory_mib=81559,
                        compute_capability="9.0",
                        nvlink_domain=0,
                    )
                    for g in range(GPUS)
                ),
            )
        )
    for m in range(MODELS):
        out.append(
            events.ModelDeclared(
                id=f"model-{m}",
                ts=T0,
                operator="admin",
                profile=ModelProfile(name=f"m{m}", engine="sim", replicas=REPLICAS // MODELS),
            )
        )
    generation = [0] * REPLICAS
    k = 0
    while len(out) < n:
        r = k % REPLICAS
        k += 1
        generation[r] += 1
        g = generation[r]
        node, gpu = f"node-{r % NODES:02d}", r // NODES
        rid, model, port = f"r{r}", f"m{r % MODELS}", 8100 + 2 * gpu
        ts = T0 + k
        cycle: list[events.Event] = [
            events.ReplicaPlaced(
                id=f"p{k}",
                ts=ts,
                epoch=1,
                basis_seq=0,
                replica_id=rid,
                model=model,
                generation=g,
                shards=(events.ShardAssignment(shard=0, node=node, gpus=(gpu,), port=port),),
                reason="bench",
            ),
            events.StartShard(
                id=f"s{k}",
                ts=ts,
                epoch=1,
                node=node,
                replica_id=rid,
                generation=g,
                launch=LaunchSpec(
                    engine="sim", model=model, served_name=model, port=port, gpus=(gpu,)
                ),
            ),
        ]
        for phase in ("starting", "loading", "serving"):
            cycle.append(
                events.ShardStatus(
                    id=f"{phase}{k}",
                    ts=ts,
                    node=node,
                    replica_id=rid,
                    generation=g,
                    phase=phase,  # type: ignore[arg-type]
                    endpoint=f"http://10.0.0.{r % NODES}:{port}" if phase == "serving" else "",
                )
            )
        cycle.append(
            events.EndpointUp(
                id=f"up{k}",
                ts=ts,
                epoch=1,
                replica_id=rid,
                model=model,
                url=f"http://10.0.0.{r % NODES}:{port}",
                node=node,
            )
        )
        for e in list(cycle):
            out.append(e)
            out.append(events.Heartbeat(id=f"hb-{e.id}", ts=ts, node=node, seq=k))
    return out[:n]


async def fill(server: TestNatsServer, log: list[events.Event], *, signed: bool = True) -> float:
    """Store `log` through the admin, each event signed by its subject's owner (or not);
    the seconds the stores took (signing happens before, not counted)."""
    control = await connect_as(server, "control", "bench-control")
    await bus.provision(control.jetstream())
    await control.close()
    admin = await nats.connect(server.url, tls=server.pki.admin_tls(), inbox_prefix="_INBOX.admin")
    js = admin.jetstream()
    signers: dict[str, Any] = {}
    prepared = []
    for e in log:
        subject, payload = events.subject_of(e), events.encode(e)
        headers = {"Nats-Msg-Id": e.id}
        if isinstance(e, events.Heartbeat):
            headers["Nats-TTL"] = "3600s"  # only heartbeats expire, and every one does
        if signed:
            owner = subject if ".node." in subject else subject.rsplit(".", 1)[0]
            signer = signers.get(owner)
            if signer is None:
                signer = signers.setdefault(owner, server.pki.owner_signer(e))
            headers |= signer.event_headers(subject, e.id, payload)
        prepared.append((subject, payload, headers))
    started = time.perf_counter()
    for i in range(0, len(prepared), 5000):
        for subject, payload, headers in prepared[i : i + 5000]:
            await js.publish_async(subject, payload, headers=headers)
        await js.publish_async_completed()
        if i % 100_000 == 0 and i:
            print(f"  published {i:,}", flush=True)
    took = time.perf_counter() - started
    await admin.close()
    return took


def without_heartbeats(n: int) -> list[events.Event]:
    """`n` events of `make_log` with its heartbeats gone (expired, as in a fleet)."""
    return [e for e in make_log(2 * n + 1_000) if not isinstance(e, events.Heartbeat)][:n]


def decision_log(drains: int) -> tuple[list[events.Event], int]:
    """A log the core's own leader wrote: 64 nodes, 8 models, `drains` drain-and-return rounds."""
    sim = scenarios.Sim()
    for i in range(NODES):
        sim.register(f"node-{i:02d}", count=GPUS)
    for m in range(MODELS):
        sim.declare(scenarios.profile(f"m{m}", engine="sim", replicas=24))
    sim.settle()
    for k in range(drains):
        node = f"node-{(k * 7) % NODES:02d}"
        sim.drain(node, grace_s=600)
        sim.settle()
        sim.advance(60)
        sim.settle()
        sim.append(events.NodeUncordoned(id=sim.eid("op"), ts=sim.now, operator="alice", node=node))
        sim.settle()
    assert not sim.rejected, sim.rejected[:3]
    return [e for _, e in sim.records], len(sim.decision_batches)


def run_verify_cli(server: TestNatsServer) -> tuple[float, dict[str, object]]:
    certs = server.pki.certs
    operator = Identity("operator", "bench-op")
    argv = [
        sys.executable, "-m", "llmgw", "ctl", "replay", "--verify", "--json",
        "--server", server.url, "--ca", str(certs.ca_cert), "--cert", str(certs.cert(operator)),
    ]  # fmt: skip
    started = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, cwd=ROOT, text=True)
    assert out.returncode == 0, out.stderr
    return time.perf_counter() - started, json.loads(out.stdout)


class _Recording(bus.Reader):
    """A reader that keeps every raw frame it is handed, to time the intake in process."""

    frames: list[tuple[bytes, bytes, bytes, bytes]]

    def _on_raw(self, subject: bytes, reply: bytes, data: bytes, headers: bytes) -> None:
        self.frames.append((subject, reply, data, headers))
        super()._on_raw(subject, reply, data, headers)


async def intake_in_process(nc: bus.BusClient) -> tuple[float, float]:
    """Microseconds of CPU per message for the reader's intake (order, trust, headers,
    decoding: llmgw.bus.intake) and for the fold, in process on the frames a replay
    received: the part of a replay that is llmgw's own Python, without TLS, the socket and
    the protocol parser, and less at the mercy of the machine's load (best of 5)."""
    attestations = await bus.load_attestations(nc)
    # The frames replay into a fresh reader as one consumer's: a reading that started a new
    # consumer on the way (a gap, a slow server) is read again.
    for _ in range(3):
        reader = _Recording(nc, follow=False, batch=20_000, attestations=attestations)
        reader.frames = []
        async with reader:
            async for _batch in reader.batches():
                pass
        if not reader.resets:
            break
    else:
        raise RuntimeError("every reading of the log started a new consumer on the way")
    frames = [f for f in reader.frames if f[1].startswith(b"$JS.ACK.")]
    intake_s = fold_s = float("inf")
    for _ in range(5):
        fresh = bus.Reader(nc, follow=False, attestations=attestations)
        fresh._outstanding = len(frames)
        on_raw = fresh._on_raw
        started = time.process_time()
        for frame in frames:
            on_raw(*frame)
        intake_s = min(intake_s, time.process_time() - started)
        records, st, apply = fresh._buf, state.ClusterState(), state.apply
        assert len(records) == len(frames) - fresh.undecodable
        started = time.process_time()
        for r in records:
            apply(st, r.event, r.seq, r.time)
        fold_s = min(fold_s, time.process_time() - started)
    return intake_s / len(frames) * 1e6, fold_s / len(frames) * 1e6


class _Undecoded(bus.Reader):
    """A reader that counts each checked message and keeps nothing: what reading and the
    order and trust checks cost alone, without decoding or folding."""

    kept = 0

    def _accept(
        self, seq: int, name: str, data: bytes, size: int, ttl: bytes | None, when: float
    ) -> None:
        self.kept += 1


async def read_checked(nc: bus.BusClient) -> tuple[int, float]:
    """Events read and checked (order, attestation or signature), none decoded."""
    started = time.perf_counter()
    attestations = await bus.load_attestations(nc)
    async with _Undecoded(nc, follow=False, batch=20_000, attestations=attestations) as reader:
        async for _batch in reader.batches():
            pass
    return reader.kept, time.perf_counter() - started


async def read_only(nc: bus.BusClient) -> tuple[int, float]:
    count = 0
    started = time.perf_counter()
    attestations = await bus.load_attestations(nc)
    async with bus.Reader(nc, follow=False, batch=20_000, attestations=attestations) as reader:
        async for batch in reader.batches():
            count += len(batch)
    return count, time.perf_counter() - started


def cpu_seconds(pid: int | None) -> float:
    """User and system CPU seconds a process has used so far (Linux's /proc)."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_cli(
    server: TestNatsServer, to_seq: int, env: dict[str, str] | None = None
) -> tuple[float, dict[str, object]]:
    certs = server.pki.certs
    operator = Identity("operator", "bench-op")
    argv = [
        sys.executable, "-m", "llmgw", "ctl", "replay", "--to", str(to_seq), "--view", "nodes",
        "--json", "--server", server.url, "--ca", str(certs.ca_cert),
        "--cert", str(certs.cert(operator)),
    ]  # fmt: skip
    started = time.perf_counter()
    out = subprocess.run(
        argv,
        capture_output=True,
        check=True,
        cwd=ROOT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    return time.perf_counter() - started, json.loads(out.stdout)


async def attest(server: TestNatsServer, n: int) -> list[events.LogAttested]:
    """What the leader does as it folds: verify every event once, then attest."""
    control = await connect_as(server, "control", "bench-control")
    att = attesting.Attester(within_s=float("inf"), clock=time.time)
    started = time.perf_counter()
    async with bus.Reader(control, follow=False, batch=20_000, attester=att) as reader:
        async for _batch in reader.batches():
            pass
    publisher = bus.Publisher(control.jetstream())
    out: list[events.LogAttested] = []
    while (event := att.take(event_id=f"att-{len(out)}", epoch=1, basis_seq=n)) is not None:
        await publisher.publish(event)
        att.attested(event)
        out.append(event)
    print(f"  attested {n:,} events in {time.perf_counter() - started:.1f} s", flush=True)
    await control.close()
    return out


async def replay_rows(
    pki: TestPki,
    root: Path,
    log: list[events.Event],
    expected: state.ClusterState,
    n: int,
    gap: int,
    signed: bool,
    rows: list[tuple[str, str]],
    attested: bool = False,
) -> None:
    """The replay rows on one log: unsigned (and unchecked), signed (and verified), or
    signed and attested (checked by digest)."""
    server = TestNatsServer(pki, root)
    server.root.mkdir()
    server.start()
    try:
        took = await fill(server, log, signed=signed)
        rows.append(("publish (admin, pipelined acks)", f"{n / took:,.0f} events/s, {took:.1f} s"))
        whole = n
        if attested:
            attestations = await attest(server, n)
            expected, _ = state.fold_records(enumerate([*log, *attestations], start=1))
            whole = n + len(attestations)
            rows.append(("attestations", f"{len(attestations):,} after the log"))
        # A snapshot `gap` events before the end, saved as the control plane does.
        snap_seq = n - gap
        snap_state, _ = state.fold_records(enumerate(log[:snap_seq], start=1))
        control = await connect_as(server, "control", "bench-control")
        store = await bus.SnapshotStore.open(control.jetstream())
        data = state.encode_snapshot(snap_state)
        await store.save(data, snap_seq)
        await control.close()
        rows.append(("snapshot", f"seq {snap_seq:,}, {len(data) / 1e6:.1f} MB"))

        op = await connect_as(server, "operator", "bench-op")
        if not signed:
            unchecked = pki.verifier(accept_unsigned_before=2**62)
            bus_keys.bind(op, bus.Keys(pki.signer("operator", "bench-op"), unchecked))
        count, secs = await read_only(op)
        assert count == whole, count
        rows.append(("read + decode, no fold (bus.Reader)", f"{n / secs:,.0f} events/s"))
        count, secs = await read_checked(op)
        assert count == whole, count
        rows.append(("read + check, no decode, no fold", f"{n / secs:,.0f} events/s"))
        intake_us, fold_us = await intake_in_process(op)
        rows.append(
            (
                "in process, per message: intake / fold",
                f"{intake_us:.2f} / {fold_us:.2f} µs of CPU",
            )
        )
        best, best_cpu, server_us = 0.0, 0.0, float("inf")
        for _ in range(2):
            cpu, server_cpu = time.process_time(), cpu_seconds(server.pid)
            r = await history.rebuild(op, use_snapshots=False)
            cpu = time.process_time() - cpu
            server_cpu = cpu_seconds(server.pid) - server_cpu
            assert r.folded == whole
            assert not r.rejected
            assert state.digest(r.state) == state.digest(expected)
            best = max(best, whole / r.elapsed_s)
            best_cpu = max(best_cpu, whole / cpu)
            server_us = min(server_us, server_cpu / whole * 1e6)
        rows.append(
            (
                "ctl replay from the beginning (fold)",
                f"{best:,.0f} events/s ({best_cpu:,.0f} per ctl CPU-second)",
            )
        )
        rows.append(
            (
                "  CPU per event: ctl / nats-server",
                f"{1e6 / best_cpu:.2f} / {server_us:.2f} µs",
            )
        )
        times = []
        at_n, _ = state.fold_records(enumerate(log, start=1))
        for _ in range(3):
            r = await history.rebuild(op, to_seq=n)
            assert r.snapshot_seq == snap_seq
            assert r.folded == gap
            assert state.digest(r.state) == state.digest(at_n)
            times.append(r.elapsed_s)
        rows.append(
            (
                f"ctl replay --to {n:,}, snapshot {gap:,} before",
                f"{min(times):.3f} s (best of 3)",
            )
        )
        mid = n // 2
        r = await history.rebuild(op, to_seq=mid)
        rows.append((f"ctl replay --to {mid:,} (no snapshot before it)", f"{r.elapsed_s:.2f} s"))
        await op.close()
        env = {} if signed else {"LLMGW_CTL__ACCEPT_UNSIGNED_BEFORE": str(2**62)}
        secs, doc = await asyncio.to_thread(run_cli, server, n, env)
        assert doc["snapshot_seq"] == snap_seq, doc["snapshot_seq"]
        rows.append(("`llmgw ctl replay --to N --json` process, end to end", f"{secs:.2f} s"))
    finally:
        server.close()


async def verify_rows(pki: TestPki, root: Path, drains: int, rows: list[tuple[str, str]]) -> None:
    """replay --verify, on a log whose every batch is a real decision of the leader."""
    log2, batches = decision_log(drains)
    server = TestNatsServer(pki, root)
    server.root.mkdir()
    server.start()
    try:
        await fill(server, log2)
        op = await connect_as(server, "operator", "bench-op")
        pairs = []
        started = time.perf_counter()
        async for batch in history.records(op):
            pairs.extend((r.seq, r.event) for r in batch)
        read_s = time.perf_counter() - started
        started = time.perf_counter()
        differences = control_verify.verify(pairs)
        verify_s = time.perf_counter() - started
        assert differences == [], differences[:2]
        await op.close()
        rows.append(
            (
                f"replay --verify: {len(log2):,} events, {batches:,} decision batches",
                f"read {read_s:.2f} s + re-plan {verify_s:.2f} s "
                f"({batches / verify_s:,.0f} batches/s)",
            )
        )
        secs, doc = await asyncio.to_thread(run_verify_cli, server)
        assert doc["ok"] is True
        rows.append(("`llmgw ctl replay --verify --json` process, end to end", f"{secs:.2f} s"))
    finally:
        server.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--snapshot-gap", type=int, default=10_000)
    parser.add_argument("--drains", type=int, default=200, help="rounds in the --verify log")
    parser.add_argument(
        "--modes",
        default="unsigned,verified,attested,attested-expired",
        help="which logs to replay, comma-separated (a million verified events take minutes)",
    )
    parser.add_argument("--no-verify", action="store_true", help="skip the replay --verify rows")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    n, gap = args.events, args.snapshot_gap
    print(f"load average before: {os.getloadavg()[0]:.2f} (2 = both cores busy)", flush=True)
    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        pki = TestPki(Path(tmp) / "pki")
        # Heartbeats are not attested (a digest kept forever for a message that lives two
        # minutes): a replay verifies those still alive, at most nodes x TTL / interval.
        # The "-expired" logs have their heartbeats expired, as a fleet's has: the first
        # `n` other events of a log twice as long, so that every log replays `n` events.
        modes = {
            "unsigned": ("unsigned, unchecked", False, False, False),
            "unsigned-expired": ("unsigned, unchecked; heartbeats expired", False, False, True),
            "verified": ("signed, every event verified", True, False, False),
            "attested": (
                "signed, attested by the leader; every heartbeat still alive",
                True,
                True,
                False,
            ),
            "attested-expired": (
                "signed, attested by the leader; heartbeats expired",
                True,
                True,
                True,
            ),
        }
        chosen = [m.strip() for m in args.modes.split(",") if m.strip()]
        unknown = sorted(set(chosen) - set(modes))
        if unknown:
            parser.error(f"unknown --modes {unknown}: choose from {', '.join(modes)}")
        logs: dict[bool, list[events.Event]] = {}
        for i, (title, signed, attested, expired) in enumerate(modes[m] for m in chosen):
            if expired not in logs:
                logs[expired] = without_heartbeats(n) if expired else make_log(n)
            events_ = logs[expired]
            expected, refused = state.fold_records(enumerate(events_, start=1))
            assert not refused, refused[:3]
            rows.append(("", f"{title} ({len(events_):,} events)"))
            await replay_rows(
                pki,
                Path(tmp) / f"nats-{i}",
                events_,
                expected,
                len(events_),
                gap,
                signed,
                rows,
                attested,
            )
        if not args.no_verify:
            await verify_rows(pki, Path(tmp) / "nats-verify", args.drains, rows)
    print(f"\nllmgw ctl replay, {n:,} events ({NODES} nodes, {REPLICAS} replicas)")
    width = max(len(a) for a, _ in rows)
    for a, b in rows:
        print(f"  {a.ljust(width)}  {b}" if a else f"{b}:")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    asyncio.run(main())

"""Builders of realistic clusters for the core's tests and benchmarks.

`Sim` is an in-memory log with a leader and well-behaved agents around the
pure core: events get stream sequences, the fold runs on each, the leader's
decisions are appended and folded back (as the control service does), and
simulated agents answer commands with shard status. Nothing here does I/O.
Hardware shapes follow the recorded fixtures (tests/fixtures/hw): an 8x H100
SXM node with one NVLink domain and 8 CX-7 HCAs, L40S PCIe boxes, A100s.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from llmgw.core import events, reconcile, state
from llmgw.core.inventory import Fabric, Gpu, Hca
from llmgw.core.profile import ModelProfile

GPU_NAMES = {
    "h100-80g": ("NVIDIA H100 80GB HBM3", 81559, "9.0"),
    "a100-80g": ("NVIDIA A100-SXM4-80GB", 81920, "8.0"),
    "l40s-45g": ("NVIDIA L40S", 46068, "8.9"),
    "rtx4090-24g": ("NVIDIA GeForce RTX 4090", 24564, "8.9"),
}


def gpus(
    gpu_class: str = "h100-80g",
    count: int = 8,
    *,
    per_domain: int | None = None,
    node: str = "n",
    unhealthy: Iterable[int] = (),
) -> tuple[Gpu, ...]:
    """`count` GPUs of a class; `per_domain` GPUs share each NVLink domain (None: PCIe only)."""
    name, mib, cc = GPU_NAMES[gpu_class]
    bad = set(unhealthy)
    return tuple(
        Gpu(
            index=i,
            uuid=f"GPU-{node}-{i}",
            name=name,
            gpu_class=gpu_class,
            memory_mib=mib,
            compute_capability=cc,
            nvlink_domain=None if per_domain is None else i // per_domain,
            ecc_uncorrected=2 if i in bad else 0,
        )
        for i in range(count)
    )


def fabric(name: str = "ib-a", hcas: Sequence[str] = ("mlx5_0", "mlx5_1")) -> Fabric:
    return Fabric(name=name, kind="infiniband", hcas=tuple(hcas))


def registered(
    node: str,
    *,
    gpu_class: str = "h100-80g",
    count: int = 8,
    per_domain: int | None = 8,
    fabrics: Sequence[Fabric] = (),
    unhealthy: Iterable[int] = (),
    shards: Sequence[events.RunningShard] = (),
    ts: float = 0.0,
    gpu_list: tuple[Gpu, ...] | None = None,
) -> events.NodeRegistered:
    hcas = tuple(Hca(name=h, rate_gbps=400.0) for f in fabrics for h in f.hcas)
    return events.NodeRegistered(
        id=f"reg-{node}-{ts}",
        ts=ts,
        node=node,
        address=f"{node}.internal",
        gpus=gpu_list
        if gpu_list is not None
        else gpus(gpu_class, count, per_domain=per_domain, node=node, unhealthy=unhealthy),
        fabrics=tuple(fabrics),
        hcas=hcas,
        shards=tuple(shards),
        agent_version="test",
    )


def profile(name: str = "llama", **kw: Any) -> ModelProfile:
    kw.setdefault("engine", "vllm")
    kw.setdefault("gpu_class", "h100-80g")
    return ModelProfile(name=name, **kw)


class Sim:
    """A log, a leader and obliging agents, all in memory and all deterministic."""

    def __init__(self, *, epoch: int = 1, config: reconcile.ReconcileConfig | None = None) -> None:
        self.records: list[tuple[int, events.Event]] = []
        self.seq = 0
        self.state = state.ClusterState()
        self.rejected: list[tuple[int, str]] = []
        self.now = 1000.0
        self.epoch = epoch
        self.config = config or reconcile.ReconcileConfig()
        self._n = 0
        self.hb_seq: dict[str, int] = {}
        self.failing: set[tuple[str, int]] = set()
        """(replica id, shard) that fail instead of serving."""
        self.silent: set[str] = set()
        """Nodes whose agents neither heartbeat nor answer."""
        self.answered: int = 0
        self.decision_batches: list[list[events.Event]] = []

    # --- the log

    def eid(self, prefix: str = "e") -> str:
        self._n += 1
        return f"{prefix}-{self._n}"

    def append(self, event: events.Event) -> str | None:
        self.seq += 1
        seq = self.seq
        self.records.append((seq, event))
        reason = state.apply(self.state, event, seq)
        if reason is not None:
            self.rejected.append((seq, reason))
        return reason

    def extend(self, evs: Iterable[events.Event]) -> None:
        for ev in evs:
            self.append(ev)

    # --- operators and nodes

    def declare(self, prof: ModelProfile) -> str | None:
        return self.append(
            events.ModelDeclared(id=self.eid("op"), ts=self.now, operator="alice", profile=prof)
        )

    def change(self, prof: ModelProfile) -> str | None:
        return self.append(
            events.ModelChanged(id=self.eid("op"), ts=self.now, operator="alice", profile=prof)
        )

    def cordon(self, node: str, reason: str = "") -> str | None:
        return self.append(
            events.NodeCordoned(
                id=self.eid("op"), ts=self.now, operator="alice", node=node, reason=reason
            )
        )

    def drain(self, node: str, grace_s: float = 600.0) -> str | None:
        return self.append(
            events.NodeDrainRequested(
                id=self.eid("op"), ts=self.now, operator="alice", node=node, grace_s=grace_s
            )
        )

    def liveness(self, node: str, cls: type[events.ControlEvent]) -> str | None:
        """Record a liveness decision by hand (NodeUnreachable, NodeLost, NodeRecovered)."""
        extra: dict[str, Any] = {} if cls is events.NodeRecovered else {"last_heartbeat": self.now}
        return self.append(
            cls(id=self.eid("ctl"), ts=self.now, epoch=self.epoch, node=node, **extra)
        )

    def register(self, node: str, **kw: Any) -> str | None:
        kw.setdefault("ts", self.now)
        ev = msgspec.structs.replace(registered(node, **kw), id=self.eid("reg"))
        return self.append(ev)

    def heartbeat(self, node: str, health: Sequence[events.GpuHealth] = ()) -> str | None:
        self.hb_seq[node] = self.hb_seq.get(node, 0) + 1
        return self.append(
            events.Heartbeat(
                id=self.eid("hb"), ts=self.now, node=node, seq=self.hb_seq[node], gpus=tuple(health)
            )
        )

    def heartbeats(self) -> None:
        for node in sorted(self.state.nodes):
            if node not in self.silent:
                self.heartbeat(node)

    def status(
        self, node: str, replica_id: str, generation: int, shard: int, phase: str, **kw: Any
    ) -> str | None:
        return self.append(
            events.ShardStatus(
                id=self.eid("st"),
                ts=self.now,
                node=node,
                replica_id=replica_id,
                generation=generation,
                shard=shard,
                phase=phase,  # type: ignore[arg-type]
                **kw,
            )
        )

    # --- the leader and the agents

    def leader(self, now: float | None = None) -> list[events.Event]:
        """One reconcile pass; its decisions are appended to the log and folded back.

        Moving time forward (`now`) lets the agents that are not silent heartbeat first.
        """
        if now is not None and now > self.now:
            self.now = now
            self.heartbeats()
        decisions = reconcile.reconcile(
            self.state,
            self.now,
            epoch=self.epoch,
            basis_seq=self.state.last_seq,
            config=self.config,
        )
        if decisions:
            self.decision_batches.append(list(decisions))
        for d in decisions:
            reason = self.append(d)
            assert reason is None, f"the leader's own decision was refused: {reason}\n{d}"
        return list(decisions)

    def agents(self, decisions: Sequence[events.Event]) -> None:
        """Agents answer the commands among `decisions` (starting -> loading -> serving)."""
        for d in decisions:
            if not isinstance(d, events.Command) or d.node in self.silent:
                continue
            replica = self.state.replicas.get(d.replica_id)
            if replica is None or replica.generation != d.generation:
                continue
            if isinstance(d, events.StartShard):
                self.status(d.node, d.replica_id, d.generation, d.shard, "starting")
                if (d.replica_id, d.shard) in self.failing:
                    self.status(
                        d.node,
                        d.replica_id,
                        d.generation,
                        d.shard,
                        "failed",
                        error="engine exited with status 1",
                        log_tail=("RuntimeError: CUDA out of memory",),
                    )
                    continue
                self.status(d.node, d.replica_id, d.generation, d.shard, "loading")
                self.status(
                    d.node,
                    d.replica_id,
                    d.generation,
                    d.shard,
                    "serving",
                    endpoint=f"http://{d.node}.internal:{d.launch.port}",
                )
            elif isinstance(d, events.DrainShard):
                self.status(d.node, d.replica_id, d.generation, d.shard, "draining")
            elif isinstance(d, events.StopShard):
                shard = replica.shards[d.shard] if d.shard < len(replica.shards) else None
                if shard is not None and shard.phase not in state.TERMINAL:
                    self.status(d.node, d.replica_id, d.generation, d.shard, "stopped")

    def step(self, now: float | None = None) -> list[events.Event]:
        decisions = self.leader(now)
        self.agents(decisions)
        return decisions

    def settle(self, now: float | None = None, rounds: int = 20) -> list[events.Event]:
        """Leader and agents until the leader has nothing more to say; all decisions.

        Moving time forward (`now`) lets the agents that are not silent heartbeat first.
        """
        if now is not None and now > self.now:
            self.now = now
            self.heartbeats()
        out: list[events.Event] = []
        for _ in range(rounds):
            decisions = self.step()
            if not decisions:
                return out
            out.extend(decisions)
        raise AssertionError(f"no fixpoint after {rounds} rounds; last: {out[-5:]}")

    def advance(self, seconds: float, *, heartbeats: bool = True) -> None:
        self.now += seconds
        if heartbeats:
            self.heartbeats()

    # --- views

    def serving(self, model: str | None = None) -> list[state.ReplicaState]:
        return [
            r
            for r in self.state.active_replicas(model)
            if all(s.phase == "serving" for s in r.shards)
        ]

    def durable_records(self) -> list[tuple[int, events.Event]]:
        """The log as a later replay sees it: heartbeats expired (per-message TTL)."""
        return [(s, e) for s, e in self.records if not isinstance(e, events.Heartbeat)]


def cluster(
    nodes: int,
    *,
    gpu_class: str = "h100-80g",
    gpus_per_node: int = 8,
    per_domain: int | None = 8,
    fabrics: int = 1,
    nodes_per_fabric: int | None = None,
    ts: float = 0.0,
) -> list[events.NodeRegistered]:
    """Registrations of `nodes` nodes named node-0000..., spread over `fabrics` IB fabrics."""
    per = nodes_per_fabric or max(1, -(-nodes // max(fabrics, 1)))
    out = []
    for i in range(nodes):
        fab = (fabric(f"ib-{i // per}", [f"mlx5_{k}" for k in range(4)]),) if fabrics else ()
        out.append(
            registered(
                f"node-{i:04d}",
                gpu_class=gpu_class,
                count=gpus_per_node,
                per_domain=per_domain,
                fabrics=fab,
                ts=ts,
            )
        )
    return out

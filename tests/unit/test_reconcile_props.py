"""Hypothesis state machine over the whole core: operators, agents, faults and the leader.

Invariants checked after every step: no GPU hosts two shards; a multi-node
replica never spans fabrics or GPU classes; folding the log again (and the
log without its expired heartbeats) gives the leader's digest; a leader pass,
once folded, is never repeated by the next pass, and passes at a fixed time
reach a fixpoint. At the end, `verify` reproduces every recorded batch.
"""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from llmgw.core import events, reconcile, state

from .scenarios import Sim, fabric, profile
from .strategies import any_event

NODES = ["n0", "n1", "n2", "n3", "n4"]
MODELS = ["alpha", "beta", "gamma"]
CLASSES = ["h100-80g", "l40s-45g"]
FABRICS = ["ib-a", "ib-b"]
CONFIG = reconcile.ReconcileConfig(
    unreachable_after_s=10,
    lost_after_s=30,
    restart_backoff_s=5,
    restart_backoff_max_s=40,
    shard_drain_s=5,
    change_grace_s=60,
)


def key(d: events.Event) -> tuple[Any, ...]:
    """What a decision is about, without its id, time and basis."""
    fields = msgspec.structs.asdict(d)
    for drop in ("id", "ts", "basis_seq", "epoch", "reason", "last_heartbeat", "v"):
        fields.pop(drop, None)
    return (type(d).__name__, msgspec.json.encode(fields))


class Fleet(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sim = Sim(config=CONFIG)

    @initialize(
        shapes=st.lists(
            st.tuples(st.sampled_from(CLASSES), st.sampled_from([4, 8]), st.sampled_from(FABRICS)),
            min_size=2,
            max_size=5,
        ),
        replicas=st.tuples(st.integers(0, 3), st.integers(0, 2)),
    )
    def a_running_cluster(
        self, shapes: list[tuple[str, int, str]], replicas: tuple[int, int]
    ) -> None:
        """Start from a working fleet, so every example exercises faults on real replicas."""
        sim = self.sim
        sim.append(events.LeaderElected(id="lead-1", ts=sim.now, epoch=1, leader="c1"))
        for node, (gpu_class, count, fab) in zip(NODES, shapes, strict=False):
            sim.register(
                node,
                gpu_class=gpu_class,
                count=count,
                per_domain=4,
                fabrics=[fabric(fab, [f"{fab}-hca0", f"{fab}-hca1"])],
            )
        sim.declare(profile("alpha", tensor_parallel=2, replicas=replicas[0], gpu_class=""))
        sim.declare(profile("beta", tensor_parallel=4, nodes=2, replicas=replicas[1], gpu_class=""))
        sim.settle()

    # --- nodes

    @rule(
        node=st.sampled_from(NODES),
        gpu_class=st.sampled_from(CLASSES),
        count=st.sampled_from([2, 4, 8]),
        per_domain=st.sampled_from([None, 2, 4, 8]),
        fab=st.sampled_from([None, *FABRICS]),
        unhealthy=st.sets(st.integers(0, 7), max_size=2),
    )
    def register(
        self,
        node: str,
        gpu_class: str,
        count: int,
        per_domain: int | None,
        fab: str | None,
        unhealthy: set[int],
    ) -> None:
        existing = self.sim.state.nodes.get(node)
        # A returning agent reports what it runs: the shards the log put there.
        shards = []
        if existing is not None:
            for r in self.sim.state.replicas.values():
                for s in r.shards:
                    if s.node == node and not s.released and s.phase in state.RUNNING:
                        shards.append(
                            events.RunningShard(
                                replica_id=r.id,
                                generation=r.generation,
                                shard=s.shard,
                                gpus=s.gpus,
                                phase=s.phase,  # type: ignore[arg-type]
                            )
                        )
            # Re-registration keeps the hardware (a node does not change its GPUs at will).
            gpu_list: tuple[Any, ...] | None = tuple(existing.gpus.values())
            fabrics = list(existing.fabrics)
        else:
            gpu_list = None
            fabrics = [fabric(fab, [f"{fab}-hca0", f"{fab}-hca1"])] if fab else []
        self.sim.silent.discard(node)
        self.sim.register(
            node,
            gpu_class=gpu_class,
            count=count,
            per_domain=per_domain if per_domain is None else min(per_domain, count),
            fabrics=fabrics,
            unhealthy={u for u in unhealthy if u < count},
            shards=shards,
            gpu_list=gpu_list,
        )

    @rule(node=st.sampled_from(NODES), op=st.sampled_from(["cordon", "uncordon", "drain"]))
    def operator_on_node(self, node: str, op: str) -> None:
        if op == "cordon":
            self.sim.cordon(node, "maintenance")
        elif op == "drain":
            self.sim.drain(node, grace_s=30)
        else:
            self.sim.append(
                events.NodeUncordoned(id=self.sim.eid(), ts=self.sim.now, operator="o", node=node)
            )

    @rule(node=st.sampled_from(NODES))
    def agent_dies(self, node: str) -> None:
        self.sim.silent.add(node)

    @rule(node=st.sampled_from(NODES), index=st.integers(0, 7), ecc=st.integers(0, 2))
    def gpu_health(self, node: str, index: int, ecc: int) -> None:
        known = self.sim.state.nodes.get(node)
        if known is not None and node not in self.sim.silent and index in known.gpus:
            self.sim.heartbeat(node, [events.GpuHealth(index=index, ecc_uncorrected=ecc)])

    # --- models

    @rule(
        name=st.sampled_from(MODELS),
        tp=st.sampled_from([1, 2, 4, 8]),
        nodes=st.sampled_from([1, 1, 2]),
        replicas=st.integers(0, 3),
        gpu_class=st.sampled_from(["", *CLASSES]),
        args=st.sampled_from([(), ("--enforce-eager",)]),
    )
    def declare_or_change(
        self, name: str, tp: int, nodes: int, replicas: int, gpu_class: str, args: tuple[str, ...]
    ) -> None:
        prof = profile(
            name,
            tensor_parallel=tp * nodes,
            nodes=nodes,
            replicas=replicas,
            gpu_class=gpu_class,
            engine_args=args,
        )
        if name in self.sim.state.models:
            self.sim.change(prof)
        else:
            self.sim.declare(prof)

    @rule(name=st.sampled_from(MODELS))
    def remove(self, name: str) -> None:
        self.sim.append(
            events.ModelRemoved(id=self.sim.eid(), ts=self.sim.now, operator="o", name=name)
        )

    # --- engines

    @rule(pick=st.integers(0, 50), phase=st.sampled_from(["failed", "stopped"]))
    def engine_dies(self, pick: int, phase: str) -> None:
        live = [
            (r, s)
            for r in sorted(self.sim.state.replicas.values(), key=lambda r: r.id)
            for s in r.shards
            if s.phase in state.RUNNING and s.node not in self.sim.silent
        ]
        if live:
            r, s = live[pick % len(live)]
            self.sim.status(s.node, r.id, r.generation, s.shard, phase, error="engine exited")

    @rule(pick=st.integers(0, 50))
    def engine_keeps_failing(self, pick: int) -> None:
        ids = sorted(self.sim.state.replicas)
        if ids:
            self.sim.failing.add((ids[pick % len(ids)], 0))

    @rule(event=any_event)
    def hostile(self, event: events.Event) -> None:
        if isinstance(event, (events.ControlEvent, events.OperatorEvent)):
            return  # only the leader and operators write those; NATS enforces it
        before = state.digest(self.sim.state)
        reason = self.sim.append(event)
        if reason is not None:
            assert state.digest(self.sim.state) == before
            assert "internal error" not in reason, reason

    # --- time and the leader

    @rule(seconds=st.sampled_from([0.5, 3.0, 6.0, 11.0, 31.0]))
    def time_passes(self, seconds: float) -> None:
        self.sim.advance(seconds)

    @rule()
    def leader_pass(self) -> None:
        sim = self.sim
        decisions = sim.leader()
        if decisions:
            # Idempotent: once folded, nothing the pass decided is decided again.
            again = reconcile.reconcile(
                sim.state, sim.now, epoch=sim.epoch, basis_seq=sim.state.last_seq, config=CONFIG
            )
            repeated = {key(d) for d in decisions} & {key(d) for d in again}
            assert not repeated, repeated
        # At a fixed time, passes reach a fixpoint (agents silent meanwhile).
        for _ in range(8):
            if not sim.leader():
                break
        else:
            raise AssertionError("reconcile does not converge at a fixed time")
        sim.agents(decisions)

    # --- invariants

    @invariant()
    def no_gpu_hosts_two_shards(self) -> None:
        used: dict[tuple[str, int], str] = {}
        for r in self.sim.state.replicas.values():
            for s in r.shards:
                if s.released:
                    continue
                for g in s.gpus:
                    assert (s.node, g) not in used, (
                        f"GPU {g} of {s.node}: {used[(s.node, g)]} and {r.id}"
                    )
                    used[(s.node, g)] = r.id
        for name, node in self.sim.state.nodes.items():
            assert {(name, g): rid for g, rid in node.holders.items()} == {
                k: v for k, v in used.items() if k[0] == name
            }

    @invariant()
    def multi_node_replicas_share_one_fabric_and_class(self) -> None:
        """For every replica that may run (its hardware can change under a failed one)."""
        nodes = self.sim.state.nodes
        for r in self.sim.state.replicas.values():
            if any(s.phase in state.TERMINAL for s in r.shards):
                continue
            on = {s.node for s in r.shards}
            classes = {nodes[s.node].gpus[g].gpu_class for s in r.shards for g in s.gpus}
            assert len(classes) == 1, (r.id, classes)
            if len(on) > 1:
                assert r.fabric
                for n in on:
                    assert any(f.name == r.fabric and f.hcas for f in nodes[n].fabrics)

    @invariant()
    def folding_again_gives_the_same_digest(self) -> None:
        digest = state.digest(self.sim.state)
        again, _ = state.fold_records(self.sim.records)
        assert state.digest(again) == digest
        without_heartbeats, _ = state.fold_records(self.sim.durable_records())
        assert state.digest(without_heartbeats) == digest

    def teardown(self) -> None:
        report = reconcile.verify(self.sim.durable_records(), config=CONFIG)
        assert report.mismatches == [], report.mismatches[:1]


Fleet.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
test_fleet = Fleet.TestCase

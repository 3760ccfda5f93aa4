"""Numbers and times a node or a router writes: what they cost the control plane and the
fleet beyond the writer's own slice."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw import bus
from llmgw.control.folding import Folded
from llmgw.control.metrics import Metrics
from llmgw.control.quota import Meter, NodeQuota
from llmgw.core import events

from .scenarios import Sim


def _fed(folded: Folded, sim: Sim, start: int) -> int:
    """Fold the sim's records from index `start` as the control service reads them."""
    batch = [bus.Record(seq, events.subject_of(ev), sim.now, ev, 200)  # type: ignore[arg-type]
             for seq, ev in sim.records[start:]]  # fmt: skip
    folded.fold(batch)
    return len(sim.records)


def _changes(decisions: list[events.Event]) -> int:
    return sum(isinstance(d, events.GpuHealthChanged) for d in decisions)


@settings(max_examples=10, deadline=None)
@given(beats=st.integers(min_value=30, max_value=120))
def test_heartbeats_that_keep_changing_gpu_health_cost_the_nodes_budget(beats: int) -> None:
    # Heartbeats count against the budget themselves, and each one reporting a GPU's health changed
    # (an uncorrected-ECC count that goes 1, 2, 3, ..., or a flag that flips) made the leader
    # write a durable GpuHealthChanged: one node wrote the log, through the leader, as fast
    # as it sent heartbeats, past its share of the log, and a quarantine did not stop it.
    quota = NodeQuota(window_s=600.0, max_messages=20, max_bytes=10**9)
    meter = Meter(quota)
    folded = Folded(Metrics(), lambda: 1000.0, meter)
    sim = Sim()
    sim.register("n1", count=1)
    sim.register("n2", count=1)
    done = _fed(folded, sim, 0)
    recorded = 0
    for i in range(1, beats + 1):
        sim.heartbeat("n1", [events.GpuHealth(index=0, ecc_uncorrected=i)])
        recorded += _changes(sim.leader())
        done = _fed(folded, sim, done)
    assert recorded == beats  # each change is recorded (a replay's placement needs them)
    # Each heartbeat and each change it made the leader record, and its registration.
    assert meter.usage("n1").messages == 2 * beats + 1
    over = [u.node for u in meter.excessive()]
    assert over == ["n1"]
    sim.append(events.NodeQuarantined(id="q", ts=sim.now, epoch=1, node="n1", reason="r"))
    # Quarantined: its heartbeats still say it lives, but its GPUs' health is no longer
    # recorded at its say-so, while another node's still is.
    for i in range(beats + 1, beats + 30):
        sim.heartbeat("n1", [events.GpuHealth(index=0, ecc_uncorrected=i)])
        assert _changes(sim.leader()) == 0
    assert sim.state.seen["n1"].seq == sim.seq
    sim.heartbeat("n2", [events.GpuHealth(index=0, remap_pending=True)])
    assert _changes(sim.leader()) == 1
    sim.append(events.NodeReleased(id="rel", ts=sim.now, epoch=1, node="n1"))
    sim.heartbeat("n1", [events.GpuHealth(index=0, ecc_uncorrected=7)])
    assert _changes(sim.leader()) == 1


@settings(max_examples=20, deadline=None)
@given(ahead=st.floats(120.0, 2.0**34))
def test_a_failure_dated_far_ahead_holds_no_restart_back(ahead: float) -> None:
    # The backoff counted from the failure's own `ts`: dated in the year 2514 (a node's
    # clock that jumped, or a lie), it held the replica's restart back until then, its
    # healthy shards keeping their GPUs. It counts from the generation's placement then,
    # and a crash loop still backs off.
    from llmgw.core import reconcile

    from .scenarios import profile
    from .test_reconcile import two_nodes

    sim = two_nodes(config=reconcile.ReconcileConfig(restart_backoff_s=5,
                                                     restart_backoff_max_s=60))  # fmt: skip
    sim.declare(profile("m", tensor_parallel=2))
    sim.settle()
    (r,) = sim.state.replicas.values()
    for generation, wait in ((1, 5.0), (2, 10.0)):
        placed = r.placed_ts
        sim.append(events.ShardStatus(id=f"late-{generation}", ts=sim.now + ahead,
                                      node=r.shards[0].node, replica_id=r.id,
                                      generation=generation, shard=0, phase="failed",
                                      error="CUDA error"))  # fmt: skip
        assert r.failed_ts > sim.now + 60  # the fold keeps the node's time
        sim.step()
        assert sim.step(placed + wait - 0.1) == []  # the backoff, from the placement
        restart = sim.leader(placed + wait + 0.1)
        assert [type(d).__name__ for d in restart][:1] == ["ReplicaPlaced"]
        assert r.generation == generation + 1


@settings(max_examples=20, deadline=None)
@given(ahead=st.floats(0.0, 60.0))
def test_a_failure_dated_within_a_minute_ahead_counts_from_its_own_time(ahead: float) -> None:
    from llmgw.core import reconcile

    from .scenarios import profile
    from .test_reconcile import two_nodes

    sim = two_nodes(config=reconcile.ReconcileConfig(restart_backoff_s=5))
    sim.declare(profile("m", tensor_parallel=2))
    sim.settle()
    (r,) = sim.state.replicas.values()
    failed_at = sim.now + ahead
    sim.append(events.ShardStatus(id="near", ts=failed_at, node=r.shards[0].node,
                                  replica_id=r.id, generation=1, shard=0, phase="failed",
                                  error="CUDA error"))  # fmt: skip
    sim.step()
    assert all(type(d).__name__ != "ReplicaPlaced" for d in sim.step(failed_at + 4.9))
    assert [type(d).__name__ for d in sim.leader(failed_at + 5.1)][:1] == ["ReplicaPlaced"]

"""An agent reports a live replica at an older generation (an orphan process): the leader
stops it once, folds its own StopShard, and asks again only after a growing wait."""

from __future__ import annotations

import msgspec
import pytest

from llmgw.core import events, reconcile, state
from llmgw.core.reconcile import ReconcileConfig

from .scenarios import Sim, profile

CFG = ReconcileConfig(orphan_stop_retry_s=30.0, orphan_stop_retry_max_s=120.0)


def restarted_replica() -> tuple[Sim, str]:
    """Node a serves replica R at generation 2, after generation 1 failed."""
    sim = Sim(config=CFG)
    sim.register("a")
    sim.declare(profile("llama"))
    sim.settle()
    (rid,) = sim.state.replicas
    sim.status("a", rid, 1, 0, "failed", error="engine exited")
    sim.settle(now=sim.now + 10)
    replica = sim.state.replicas[rid]
    assert replica.generation == 2
    assert replica.shards[0].phase == "serving"
    return sim, rid


def report_old_generation(sim: Sim, rid: str, old: tuple[int, ...] = (1,)) -> None:
    """Node a reports the replica's current generation serving, and each of `old` too."""
    replica = sim.state.replicas[rid]
    shard = replica.shards[0]
    running = [
        events.RunningShard(replica_id=rid, generation=g, shard=0, gpus=shard.gpus, phase="serving")
        for g in old
    ]
    running.append(
        events.RunningShard(
            replica_id=rid,
            generation=replica.generation,
            shard=0,
            gpus=shard.gpus,
            phase="serving",
            endpoint=shard.endpoint,
        )
    )
    assert sim.register("a", shards=running) is None


def stops(decisions: list[events.Event]) -> list[events.StopShard]:
    return [d for d in decisions if isinstance(d, events.StopShard)]


def test_an_old_generation_is_stopped_once_and_the_fold_accepts_that_stop() -> None:
    sim, rid = restarted_replica()
    report_old_generation(sim, rid)
    (orphan,) = sim.state.nodes["a"].orphans
    assert (orphan.replica_id, orphan.generation) == (rid, 1)
    # Sim.leader asserts that the fold accepts every decision of its own leader.
    (stop,) = stops(sim.leader())
    assert (stop.replica_id, stop.generation, stop.shard, stop.node) == (rid, 1, 0, "a")
    assert orphan.stop_sent
    assert orphan.stops == 1
    assert orphan.stop_sent_at == sim.now
    # The live generation is untouched.
    assert sim.state.replicas[rid].shards[0].phase == "serving"
    assert not sim.state.replicas[rid].shards[0].stop_sent
    for _ in range(20):  # the old leader sent it again on every pass, four a second
        sim.advance(0.25)
        assert stops(sim.leader()) == []


def test_the_stop_is_retried_with_exponential_backoff() -> None:
    sim, rid = restarted_replica()
    report_old_generation(sim, rid)
    t0 = sim.now
    sent: list[float] = []
    for _ in range(int(400 / 0.5)):
        if stops(sim.leader()):
            sent.append(sim.now - t0)
        sim.advance(0.5)
    # Once at once, then after 30 s, 60 s, 120 s, 120 s (the maximum) ...
    assert sent == [0.0, 30.0, 90.0, 210.0, 330.0]
    assert reconcile.verify(sim.durable_records(), config=CFG).ok


def test_its_stopped_status_clears_the_orphan() -> None:
    sim, rid = restarted_replica()
    report_old_generation(sim, rid)
    assert stops(sim.leader())
    assert sim.status("a", rid, 1, 0, "stopped") is None
    assert sim.state.nodes["a"].orphans == []
    assert sim.state.replicas[rid].shards[0].phase == "serving"  # generation 2 serves on
    sim.advance(1000)
    assert stops(sim.leader()) == []


def test_the_live_generations_failure_is_folded_beside_an_old_generations_orphan() -> None:
    """The orphan and the live shard share replica and shard number: a status of the live
    generation must reach the replica, not be taken for the orphan's."""
    sim, rid = restarted_replica()
    report_old_generation(sim, rid)
    assert sim.status("a", rid, 2, 0, "failed", error="CUDA error") is None
    assert sim.state.replicas[rid].shards[0].phase == "failed"
    assert [(o.replica_id, o.generation) for o in sim.state.nodes["a"].orphans] == [(rid, 1)]


def test_registering_again_keeps_the_backoff() -> None:
    sim, rid = restarted_replica()
    report_old_generation(sim, rid)
    assert stops(sim.leader())
    for _ in range(10):
        sim.advance(1)
        report_old_generation(sim, rid)
        assert stops(sim.leader()) == []
    (orphan,) = sim.state.nodes["a"].orphans
    assert orphan.stops == 1


def test_a_stop_for_a_generation_nobody_reported_is_still_refused() -> None:
    sim, rid = restarted_replica()
    stop = events.StopShard(
        id="x", ts=sim.now, epoch=1, node="a", replica_id=rid, generation=1, shard=0
    )
    reason = sim.append(stop)
    assert reason is not None
    assert "generation 1" in reason


def test_an_unknown_replicas_orphan_backs_off_too() -> None:
    sim = Sim(config=CFG)
    ghost = events.RunningShard(
        replica_id="ghost", generation=3, shard=0, gpus=(0,), phase="serving"
    )
    sim.register("a", shards=[ghost])
    first = stops(sim.leader())
    assert [(s.replica_id, s.generation) for s in first] == [("ghost", 3)]
    sim.advance(29)
    assert stops(sim.leader()) == []
    sim.advance(1)
    assert len(stops(sim.leader())) == 1


@pytest.mark.parametrize("end", ["stopped", "failed"])
def test_an_unknown_replicas_orphan_that_ends_either_way_is_forgotten(end: str) -> None:
    """Killed after its grace (failed) or exited cleanly (stopped), its GPU is free again and
    no more stops go to it."""
    sim = Sim(config=CFG)
    ghost = events.RunningShard(
        replica_id="ghost", generation=3, shard=0, gpus=(0,), phase="serving"
    )
    sim.register("a", shards=[ghost])
    assert stops(sim.leader())
    assert sim.status("a", "ghost", 3, 0, end, error="killed") is None
    assert sim.state.nodes["a"].orphans == []
    sim.advance(10_000)
    assert stops(sim.leader()) == []


def test_a_snapshot_from_before_stops_were_counted_waits_too() -> None:
    sim = Sim(config=CFG)
    ghost = events.RunningShard(
        replica_id="ghost", generation=1, shard=0, gpus=(0,), phase="serving"
    )
    sim.register("a", shards=[ghost])
    orphan = sim.state.nodes["a"].orphans[0]
    orphan.stop_sent = True  # as an older llmgw folded it: no count, no time
    st = state.decode_snapshot(state.encode_snapshot(sim.state))
    assert st.nodes["a"].orphans[0].stops == 0
    once = reconcile.reconcile(st, sim.now, epoch=1, config=CFG)
    assert len(stops(once)) == 1  # the time of the old stop is unknown: one more, then backoff


def test_an_orphan_stopped_before_stops_were_counted_still_waits_its_backoff() -> None:
    """A state written before each orphan's stops were counted says only `stop_sent` (and
    when): that is one stop so far, and the next waits its backoff as any second one."""
    sim, rid = restarted_replica()
    report_old_generation(sim, rid)
    (orphan,) = sim.state.nodes["a"].orphans
    orphan.stop_sent, orphan.stop_sent_at, orphan.stops = True, sim.now, 0
    sent = []
    for _ in range(int(CFG.orphan_stop_retry_s / 0.5)):
        outcome = reconcile.plan(sim.state, sim.now, epoch=1, basis_seq=sim.seq, config=CFG)
        sent += stops(outcome.decisions)
        sim.advance(0.5)
    assert sent == []
    outcome = reconcile.plan(sim.state, sim.now, epoch=1, basis_seq=sim.seq, config=CFG)
    assert [s.generation for s in stops(outcome.decisions)] == [1]


def test_a_placement_of_an_older_generation_is_refused_and_changes_nothing() -> None:
    """A deposed leader's ReplicaPlaced of generation 1, folded after generation 2 began, would
    take the replica back to a generation its agent already started and ended."""
    sim, _ = restarted_replica()
    first = next(ev for _, ev in sim.records if isinstance(ev, events.ReplicaPlaced))
    assert first.generation == 1
    before = state.digest(sim.state)
    reason = sim.append(msgspec.structs.replace(first, id="again"))
    assert reason is not None
    assert "older" in reason
    assert state.digest(sim.state) == before


def test_a_stop_of_one_old_generation_counts_for_that_generation_only() -> None:
    """Generations 1 and 2 of a replica at generation 3 both still run: each is stopped,
    once, and each waits its own backoff."""
    sim, rid = restarted_replica()
    sim.status("a", rid, 2, 0, "failed", error="engine exited")
    sim.settle(now=sim.now + 60)
    assert sim.state.replicas[rid].generation == 3
    report_old_generation(sim, rid, (1, 2))
    assert sorted(s.generation for s in stops(sim.leader())) == [1, 2]
    for _ in range(20):
        sim.advance(0.25)
        assert stops(sim.leader()) == []
    assert sorted(o.stops for o in sim.state.nodes["a"].orphans) == [1, 1]

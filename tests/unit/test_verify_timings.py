"""`replay --verify` takes each leader's reconcile timings from the log (LeaderElected).

Timings decide (a drained shard is stopped `shard_drain_s` after its DrainShard), so a
check with the wrong ones reports decisions that the leader made correctly; the leader
records its own, and a log from before that falls back to the config given, and says so.
"""

from __future__ import annotations

import msgspec

from llmgw.control import verify
from llmgw.core import events, reconcile
from tests.unit.scenarios import Sim, profile

SHORT = reconcile.ReconcileConfig(
    unreachable_after_s=2.0, lost_after_s=4.0, shard_drain_s=0.5, stop_grace_s=1.0
)


def drained_log(*, record: bool) -> list[tuple[int, events.Event]]:
    """A leader with SHORT timings places two replicas, then drains a node."""
    sim = Sim(config=SHORT)
    sim.append(
        events.LeaderElected(
            id="leader-1",
            ts=sim.now,
            leader="control-1",
            epoch=1,
            basis_seq=0,
            reconcile=msgspec.structs.asdict(SHORT) if record else {},
        )
    )
    for node in ("a", "b", "c"):
        sim.register(node)
    sim.declare(profile("llama", replicas=2))
    sim.settle()
    sim.drain("a")
    for _ in range(10):
        sim.advance(0.3)
        sim.settle()
    return sim.durable_records()


def test_recorded_timings_reproduce_the_leader_without_a_config() -> None:
    log = drained_log(record=True)
    assert verify.recorded_timings(log).by_epoch == {1: SHORT}
    assert verify.recorded_timings(log).unrecorded == ()
    assert verify.verify(log) == []
    # A config given for old logs does not override what the leader recorded.
    assert verify.verify(log, config=reconcile.ReconcileConfig()) == []


def test_a_log_without_recorded_timings_falls_back_to_the_config_given() -> None:
    log = drained_log(record=False)
    assert verify.recorded_timings(log).unrecorded == (1,)
    # The defaults are not what this leader ran with: its drain looks wrong...
    assert [d.kind for d in verify.verify(log)][:1] == ["decision"]
    # ...and with its config, right.
    assert verify.verify(log, config=SHORT) == []


def test_timings_this_version_cannot_read_are_reported() -> None:
    log = drained_log(record=True)
    seq, first = log[0]
    assert isinstance(first, events.LeaderElected)
    future = msgspec.structs.replace(first, reconcile={**first.reconcile, "warp_factor_s": 9.0})
    found = verify.verify([(seq, future), *log[1:]])
    assert found
    assert found[0].kind == "timings"
    assert "warp_factor_s" in found[0].detail
    assert "llmgw version" in found[0].detail


def test_an_old_leader_elected_without_timings_still_decodes() -> None:
    old = (
        b'{"type":"control.leader_elected","id":"x","ts":1.0,"epoch":2,"basis_seq":0,"leader":"c1"}'
    )
    event = events.decode(old)
    assert isinstance(event, events.LeaderElected)
    assert event.reconcile == {}

"""A node's share of the log: the fold's quarantine rule, placement and views, the meter.

The fold rule is checked against a model of it with Hypothesis: after a NodeQuarantined
(of the current epoch) and until a NodeReleased, exactly the node's registered and shard
events are refused, and nothing else about the fold changes. So the same log folds to
the same digest from zero or from any snapshot, and deleting the ignored messages (what
the leader does) changes no fold.
"""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import example, given, settings
from hypothesis import strategies as st

from llmgw import bus
from llmgw.control.folding import Folded
from llmgw.control.metrics import Metrics
from llmgw.control.quota import Meter, NodeQuota
from llmgw.core import events, placement, reconcile, state, views
from llmgw.ctl import render

from .scenarios import Sim, profile

NODES = ("a", "b", "c")


def serving_sim() -> Sim:
    """Three ready nodes (8 GPUs each) and three serving replicas of one 4-GPU model."""
    sim = Sim()
    sim.append(events.LeaderElected(id="l1", ts=1.0, epoch=1, leader="control-a"))
    for node in NODES:
        sim.register(node)
    sim.declare(profile("llama", tensor_parallel=4, replicas=3))
    sim.settle()
    assert sim.rejected == []
    assert len(sim.serving()) == 3
    return sim


def quarantine(node: str, *, epoch: int = 1, n: int = 0, ts: float = 1000.0) -> events.Event:
    return events.NodeQuarantined(
        id=f"q-{n}", ts=ts, epoch=epoch, node=node, reason="wrote too much", messages=9
    )


def release(node: str, *, epoch: int = 1, n: int = 0, ts: float = 1000.0) -> events.Event:
    return events.NodeReleased(id=f"rel-{n}", ts=ts, epoch=epoch, node=node)


def without_quarantine(st_: state.ClusterState) -> str:
    copy = state.decode_snapshot(state.encode_snapshot(st_))
    copy.quarantined = {}
    return state.digest(copy)


# --------------------------------------------------------------------------- the fold rule


@st.composite
def node_traffic(draw: st.DrawFn, sim: Sim) -> list[events.Event]:
    """Events of the nodes (valid, stale and nonsensical ones), quarantines and releases."""
    replicas = sorted(sim.state.replicas.values(), key=lambda r: r.id)
    out: list[events.Event] = []
    for n in range(draw(st.integers(0, 40))):
        node = draw(st.sampled_from(NODES))
        kind = draw(st.sampled_from(["shard", "shard", "register", "heartbeat", "q", "r"]))
        ts = 1000.0 + n
        if kind == "shard":
            r = draw(st.sampled_from(replicas))
            out.append(
                events.ShardStatus(
                    id=f"s-{n}",
                    ts=ts,
                    node=draw(st.sampled_from([r.shards[0].node, node])),
                    replica_id=r.id,
                    generation=draw(st.sampled_from([r.generation, r.generation + 1])),
                    phase=draw(st.sampled_from(events.SHARD_PHASES)),
                    error=draw(st.sampled_from(["", "boom"])),
                )
            )
        elif kind == "register":
            running = tuple(
                events.RunningShard(
                    replica_id=r.id,
                    generation=r.generation,
                    shard=0,
                    gpus=r.shards[0].gpus,
                    phase="serving",
                )
                for r in replicas
                if r.shards[0].node == node and draw(st.booleans())
            )
            reg = sim.state.nodes[node]
            out.append(
                events.NodeRegistered(
                    id=f"reg-{n}",
                    ts=ts,
                    node=node,
                    address=reg.address,
                    gpus=tuple(reg.gpus[i] for i in sorted(reg.gpus)),
                    shards=running,
                )
            )
        elif kind == "heartbeat":
            out.append(events.Heartbeat(id=f"hb-{n}", ts=ts, node=node, seq=n + 1))
        elif kind == "q":
            out.append(quarantine(node, epoch=draw(st.sampled_from([0, 1, 1])), n=n, ts=ts))
        else:
            out.append(release(node, epoch=draw(st.sampled_from([0, 1, 1])), n=n, ts=ts))
    return out


def _model_ignores(log: list[tuple[int, events.Event]]) -> set[int]:
    """The rule, written the simplest way: the sequences a fold must ignore."""
    quarantined: set[str] = set()
    ignored: set[int] = set()
    for seq, ev in log:
        if isinstance(ev, events.NodeQuarantined) and ev.epoch >= 1:
            quarantined.add(ev.node)
        elif isinstance(ev, events.NodeReleased) and ev.epoch >= 1:
            quarantined.discard(ev.node)
        elif isinstance(ev, events.NodeRegistered | events.ShardStatus) and ev.node in quarantined:
            ignored.add(seq)
    return ignored


BASE = serving_sim()


@settings(max_examples=150, deadline=None)
@given(traffic=node_traffic(BASE), cut=st.integers(0, 60))
def test_the_fold_ignores_exactly_a_quarantined_nodes_later_events_and_is_deterministic(
    traffic: list[events.Event], cut: int
) -> None:
    base = list(BASE.records)
    log = base + [(len(base) + i + 1, ev) for i, ev in enumerate(traffic)]
    folded, rejected = state.fold_records(log)
    again, _ = state.fold_records(log)
    assert state.digest(folded) == state.digest(again)

    # Exactly the model's sequences are refused as a quarantined node's.
    expected = _model_ignores(log)
    by_quarantine = {seq for seq, why in rejected if "is quarantined since seq" in why}
    assert by_quarantine == expected

    # From a snapshot at any point, then the rest: the same digest.
    at = len(base) + min(cut, len(traffic))
    head, _ = state.fold_records(log[:at])
    resumed = state.decode_snapshot(state.encode_snapshot(head))
    resumed, _ = state.fold_records(log[at:], resumed)
    assert state.digest(resumed) == state.digest(folded)

    # Deleting the ignored messages (the leader does) changes no fold.
    kept = [(seq, ev) for seq, ev in log if seq not in expected]
    pruned, _ = state.fold_records(kept)
    assert state.digest(pruned) == state.digest(folded)

    # Quarantine changes nothing else: the log without the quarantine events and without
    # the ignored messages folds to the same state, apart from the quarantines themselves.
    plain = [
        (seq, ev)
        for seq, ev in kept
        if not isinstance(ev, events.NodeQuarantined | events.NodeReleased)
    ]
    unquarantined, _ = state.fold_records(plain)
    assert without_quarantine(folded) == state.digest(unquarantined)

    # Heartbeats of quarantined nodes still count for liveness (the volatile part).
    for node, q in folded.quarantined.items():
        beats = [
            seq
            for seq, ev in log
            if isinstance(ev, events.Heartbeat) and ev.node == node and seq > q.seq
        ]
        if beats:
            assert folded.seen[node].seq == beats[-1]


def test_a_quarantine_and_its_release_fold_into_the_state_and_the_digest() -> None:
    sim = serving_sim()
    before = state.digest(sim.state)
    assert sim.append(quarantine("a")) is None
    q = sim.state.quarantined["a"]
    assert (q.node, q.seq, q.reason) == ("a", sim.seq, "wrote too much")
    assert state.digest(sim.state) != before
    assert sim.append(quarantine("a", n=1)) is None  # a second one changes nothing
    assert sim.state.quarantined["a"].seq == q.seq
    replica = next(r for r in sim.state.replicas.values() if r.shards[0].node == "a")
    reason = sim.status("a", replica.id, replica.generation, 0, "failed", error="x")
    assert reason is not None
    assert "quarantined since seq" in reason
    assert replica.shards[0].phase == "serving"
    assert sim.append(release("a")) is None
    assert sim.state.quarantined == {}
    assert state.digest(sim.state) == before
    assert sim.status("a", replica.id, replica.generation, 0, "failed", error="x") is None
    assert replica.shards[0].phase == "failed"
    reason = sim.append(release("a", n=1))
    assert reason is not None
    assert "not quarantined" in reason


def test_a_deposed_leaders_quarantine_is_refused() -> None:
    sim = serving_sim()
    sim.append(events.LeaderElected(id="l2", ts=1.0, epoch=2, leader="x"))
    reason = sim.append(quarantine("a", epoch=1))
    assert reason is not None
    assert "deposed" in reason
    assert sim.state.quarantined == {}


def test_a_node_that_never_registered_can_be_quarantined_and_its_registration_is_ignored() -> None:
    sim = serving_sim()
    assert sim.append(quarantine("ghost")) is None
    reason = sim.register("ghost")
    assert reason is not None
    assert "quarantined" in reason
    assert "ghost" not in sim.state.nodes
    (row,) = [r for r in views.node_rows(sim.state, 1000.0) if r["name"] == "ghost"]
    assert row["state"] == "unregistered,quarantined"
    assert "ghost" in render.nodes_table(views.node_rows(sim.state, 1000.0))


def test_snapshots_keep_quarantines() -> None:
    sim = serving_sim()
    sim.append(quarantine("b"))
    copy = state.decode_snapshot(state.encode_snapshot(sim.state))
    assert copy.quarantined == sim.state.quarantined
    assert state.digest(copy) == state.digest(sim.state)


def test_verify_treats_quarantines_as_observations() -> None:
    sim = serving_sim()
    sim.append(quarantine("a"))
    sim.advance(5)
    sim.append(release("a", ts=sim.now))
    report = reconcile.verify(sim.records, config=sim.config)
    assert report.mismatches == []
    assert report.observations >= 2


def test_a_quarantined_nodes_gpu_health_is_recorded_only_after_its_release() -> None:
    """Each change recorded is a durable event written for the node: while quarantined it
    must not go on writing the log through the leader's observations."""
    sim = serving_sim()
    sim.append(quarantine("a"))
    sick = (events.GpuHealth(index=0, ecc_uncorrected=3),)
    sim.heartbeat("a", sick)
    assert sim.leader() == []
    sim.append(release("a", ts=sim.now))
    sim.heartbeat("a", sick)
    (changed,) = sim.leader()
    assert isinstance(changed, events.GpuHealthChanged)
    assert changed.node == "a"


# --------------------------------------------------------------------------- placement, views


def test_a_quarantined_node_gets_no_replicas_and_says_why() -> None:
    sim = Sim()
    for node in NODES:
        sim.register(node)
    sim.append(quarantine("b"))
    sim.declare(profile("big", tensor_parallel=8, replicas=3))
    sim.settle()
    nodes = {r.shards[0].node for r in sim.state.active_replicas("big")}
    assert nodes == {"a", "c"}
    explained = placement.explain(sim.state, "big", sim.now)
    verdict = {v.node: v.reason for v in explained.nodes}
    assert verdict["b"].startswith("quarantined (wrote too much)")
    outcome = reconcile.reconcile_detail(
        sim.state, sim.now, epoch=1, basis_seq=sim.state.last_seq, config=sim.config
    )
    assert "quarantined: 1" in outcome.unplaceable["big"]
    (row,) = [r for r in views.node_rows(sim.state, sim.now) if r["name"] == "b"]
    assert row["quarantined"]
    assert row["quarantine_reason"] == "wrote too much"
    assert row["state"] == "ready,quarantined"
    assert "quarantined: wrote too much" in render.nodes_table([row])


# --------------------------------------------------------------------------- the service's fold


def _record(seq: int, ev: events.Event, size: int = 100, at: float = 1000.0) -> bus.Record:
    return bus.Record(seq, events.subject_of(ev), at, ev, size)  # type: ignore[arg-type]


def _serving_fold(*, leader: bool, max_messages: int = 3) -> tuple[Meter, Folded, int]:
    """A meter and the control plane's fold of `serving_sim`'s log (as the leader, which
    collects what it deletes, or a standby), and that log's last sequence."""
    meter = Meter(NodeQuota(window_s=60, max_messages=max_messages, max_bytes=10**9))
    folded = Folded(Metrics(), lambda: 1000.0, meter)
    folded.collect_ignored = leader
    sim = serving_sim()
    folded.fold([_record(seq, ev, at=999.0) for seq, ev in sim.records])
    return meter, folded, sim.seq


def _beats(node: str, first_seq: int, count: int) -> list[bus.Record]:
    return [
        _record(first_seq + i, events.Heartbeat(id=f"hb-{i}", ts=1000.0, node=node, seq=i), 40)
        for i in range(count)
    ]


def test_folded_measures_node_messages_and_collects_what_the_fold_ignored() -> None:
    meter, folded, seq = _serving_fold(leader=True)
    replica = next(r for r in folded.state.replicas.values() if r.shards[0].node == "a")
    flood: list[bus.Record] = [_record(seq + 1, quarantine("a"))]
    for i in range(5):
        ev = events.ShardStatus(
            id=f"f-{i}",
            ts=1000.0,
            node="a",
            replica_id=replica.id,
            generation=replica.generation,
            phase="serving",
        )
        flood.append(_record(seq + 2 + i, ev, size=1000))
    beat = events.Heartbeat(id="hb", ts=1000.0, node="a", seq=1)
    flood.append(_record(seq + 7, beat, size=50))
    other = events.Heartbeat(id="hb-b", ts=1000.0, node="b", seq=1)
    flood.append(_record(seq + 8, other, size=50))
    before = meter.usage("a")
    folded.fold(flood)
    # The fold ignored the five reports; the heartbeat it folded (liveness) may go too,
    # since heartbeats are in no digest. Another node's heartbeat stays.
    assert folded.ignored == [*(seq + 2 + i for i in range(5)), seq + 7]
    assert folded.ignored_total == 5
    usage = meter.usage("a")
    assert usage.bytes - before.bytes == 5 * 1000 + 50
    assert usage.messages - before.messages == 6  # the heartbeat counts against the budget
    assert folded.state.seen["a"].seq == seq + 7  # and still says the node lives


def test_a_standby_measures_heartbeats_but_collects_nothing() -> None:
    meter, folded, seq = _serving_fold(leader=False)
    before = meter.usage("a").messages
    folded.fold([_record(seq + 1, quarantine("a")), *_beats("a", seq + 2, 4)])
    assert folded.ignored == []
    assert meter.usage("a").messages - before == 4


def test_the_heartbeats_of_a_quarantined_node_that_never_registered_go_too() -> None:
    """A node certificate whose node never registered (or the node quarantined before it
    did: its registrations are then ignored) had every heartbeat refused by the fold, so
    none was "folded": the leader kept each for its TTL, up to an hour, however many it
    wrote after its quarantine, and logged a line for each. No fold uses them either."""
    meter, folded, seq = _serving_fold(leader=True)
    beats = _beats("x", seq + 2, 4)
    register = events.NodeRegistered(
        id="reg-x", ts=1000.0, node="x", address="10.0.0.9", gpus=(), agent_version="t"
    )
    rejected = folded.rejected
    folded.fold([_record(seq + 1, quarantine("x")), *beats, _record(seq + 6, register)])
    assert folded.ignored == [seq + 2, seq + 3, seq + 4, seq + 5, seq + 6]
    assert "x" not in folded.state.nodes
    assert "x" not in folded.state.seen
    assert folded.rejected - rejected == 5
    assert meter.usage("x").messages == 5
    # Another node that never registered, not quarantined: its heartbeats stay.
    stray = events.Heartbeat(id="hb-y", ts=1000.0, node="y", seq=1)
    folded.fold([_record(seq + 7, stray)])
    assert folded.ignored[-1] == seq + 6


def _skipped(seq: int, subject: str, size: int = 300, at: float = 1000.0) -> bus.Skipped:
    return bus.Skipped(seq=seq, subject=subject, time=at, error="bad", size=size)


def test_messages_no_reader_accepts_count_against_their_nodes_budget() -> None:
    """Undecodable or refused messages were counted nowhere but `undecodable`: a node wrote
    as much of them as the server took, and no quarantine followed."""
    meter = Meter(NodeQuota(window_s=60, max_messages=50, max_bytes=10**9))
    folded = Folded(Metrics(), lambda: 1000.0, meter)
    for i in range(60):
        folded.note_skipped(_skipped(i + 1, f"llmgw.events.node.a.kind-{i % 3}", size=10 + i))
    folded.note_skipped(_skipped(70, "llmgw.events.node.b.heartbeat.deeper.still"))
    folded.note_skipped(_skipped(71, "llmgw.events.control.decision"))
    folded.note_skipped(_skipped(72, "llmgw.events.operator.alice.model"))
    folded.note_skipped(_skipped(73, "llmgw.cmd.a"))
    folded.note_skipped(_skipped(74, "llmgw.events.node.a"))  # not one of a's: no such token
    assert folded.undecodable == 65
    assert meter.usage("a").messages == 60
    assert meter.usage("a").bytes == sum(10 + i for i in range(60))
    assert meter.usage("a").since_seq == 1
    assert meter.usage("b").messages == 1
    assert [u.node for u in meter.excessive()] == ["a"]
    assert folded.ignored == []  # a is not quarantined (yet): nothing to delete


def test_the_leader_collects_a_quarantined_nodes_refused_messages_for_deletion() -> None:
    _, folded, seq = _serving_fold(leader=True, max_messages=5)
    folded.note_skipped(_skipped(seq + 1, "llmgw.events.node.a.shard"))  # before: stays
    folded.fold([_record(seq + 2, quarantine("a"))])
    folded.note_skipped(_skipped(seq + 3, "llmgw.events.node.a.shard"))
    folded.note_skipped(_skipped(seq + 4, "llmgw.events.node.b.shard"))  # b is not: stays
    folded.note_skipped(_skipped(seq + 5, "llmgw.events.node.a.anything.at.all"))
    assert folded.ignored == [seq + 3, seq + 5]
    folded.fold([_record(seq + 6, release("a"))])
    folded.note_skipped(_skipped(seq + 7, "llmgw.events.node.a.shard"))
    assert folded.ignored == [seq + 3, seq + 5]


# --------------------------------------------------------------------------- the meter


def test_the_meter_flags_a_node_over_its_budget_and_forgets_the_past() -> None:
    meter = Meter(NodeQuota(window_s=60, max_messages=10, max_bytes=1000))
    for i in range(10):
        meter.observe("a", i + 1, 100.0 + i, 10)
    meter.observe("b", 100, 100.0, 2000)
    assert [u.node for u in meter.excessive()] == ["b"]
    meter.observe("a", 11, 110.0, 10)
    over = {u.node: u for u in meter.excessive()}
    assert sorted(over) == ["a", "b"]
    assert over["a"].messages == 11
    assert over["a"].since_seq == 1
    assert "11 messages" in meter.reason(over["a"])
    meter.observe("c", 200, 200.0, 1)  # time moves on: a and b fall out of the window
    assert meter.excessive() == []
    assert meter.usage("a").messages == 0


def test_a_quarantined_node_is_calm_only_after_a_whole_window_under_the_budget() -> None:
    meter = Meter(NodeQuota(window_s=60, max_messages=5, max_bytes=10**6))
    q = state.Quarantine(node="a", reason="", seq=1, ts=100.0)
    for i in range(20):
        meter.observe("a", i + 1, 100.0 + i, 1)
    assert not meter.calm("a", q)
    meter.observe("b", 50, 150.0, 1)
    assert not meter.calm("a", q)  # not a whole window since the quarantine yet
    meter.observe("b", 51, 165.0, 1)
    assert not meter.calm("a", q)  # a window old, but its flood is still in the window
    meter.observe("b", 52, 185.0, 1)
    assert meter.calm("a", q)


def test_a_quarantined_node_waits_a_whole_window_even_once_its_flood_left_it() -> None:
    """The leader quarantined the node late (at 170, for a flood at 100-119 in a window of
    60): by 185 the flood is out of the window, but the node is released only a whole window
    after its quarantine, or a node writing just over its budget would be quarantined and
    released in turn."""
    meter = Meter(NodeQuota(window_s=60, max_messages=5, max_bytes=10**6))
    q = state.Quarantine(node="a", reason="", seq=1, ts=170.0)
    for i in range(20):
        meter.observe("a", i + 1, 100.0 + i, 1)
    meter.observe("b", 50, 185.0, 1)
    assert meter.usage("a").messages == 0
    assert not meter.calm("a", q)
    meter.observe("b", 51, 230.0, 1)
    assert meter.calm("a", q)


def test_a_flood_in_one_instant_keeps_one_bucket() -> None:
    """Memory per node is bounded whatever the flood: messages of one bucket's time are
    counted in that bucket, not each in one of its own."""
    meter = Meter(NodeQuota(window_s=60, max_messages=10, max_bytes=10**9))
    for i in range(5_000):
        meter.observe("a", i + 1, 100.0 + (i % 3) * 0.1, 10)
    assert len(meter._nodes["a"].buckets) == 1  # the window's buckets, per node
    assert meter.usage("a").messages == 5_000


@settings(max_examples=200, deadline=None)
@given(
    now=st.integers(0, 100_000),
    ages=st.lists(st.integers(0, 1200) | st.integers(590, 610), max_size=50),
    window=st.sampled_from([10.0, 60.0, 600.0]),
)
@example(now=50, ages=[603], window=60.0)  # 60.3 s old, in the bucket the window starts in
def test_the_meter_never_counts_a_message_older_than_the_window(
    now: int, ages: list[int], window: float
) -> None:
    """What a node wrote a whole window ago or more never counts towards its quarantine:
    the buckets may forget a message early (by a bucket at most), never keep one late.
    (`ages` in 600ths of the window, many near a whole one.)"""
    meter = Meter(NodeQuota(window_s=window, max_messages=10**6, max_bytes=10**9))
    end = now / 100 + 2 * window
    times = [*sorted(end - window * age / 600 for age in ages), end]
    for i, t in enumerate(times):
        meter.observe("a", i + 1, t, 7)
    assert meter.usage("a").messages <= sum(1 for t in times if t > end - window)


@settings(max_examples=100, deadline=None)
@given(
    times=st.lists(st.floats(0, 1000, allow_nan=False), min_size=1, max_size=200),
    window=st.sampled_from([10.0, 60.0, 600.0]),
)
def test_the_meter_counts_the_window_to_one_bucket(times: list[float], window: float) -> None:
    meter = Meter(NodeQuota(window_s=window, max_messages=10**6, max_bytes=10**9))
    ordered = sorted(times)
    for i, t in enumerate(ordered):
        meter.observe("a", i + 1, t, 7)
    now = ordered[-1]
    usage = meter.usage("a")
    width = window / 60
    surely_in = sum(1 for t in ordered if t > now - window + width)
    maybe_in = sum(1 for t in ordered if t > now - window - width)
    assert surely_in <= usage.messages <= maybe_in
    assert usage.bytes == 7 * usage.messages


def test_config_rejects_a_budget_of_nothing() -> None:
    from llmgw.control import config

    cfg = msgspec.convert({"name": "c1", "node_quota": {"max_messages": 0}}, config.ControlConfig)
    problems: list[Any] = config.validate(cfg)
    assert any("node_quota" in p for p in problems)


def test_ctl_events_says_who_was_quarantined_and_why() -> None:
    from llmgw.ctl import eventlines

    line = eventlines.summary(quarantine("gpu-07"))
    assert line == "gpu-07 quarantined: wrote too much"
    assert eventlines.summary(release("gpu-07")) == "gpu-07 released from quarantine"
    assert eventlines.nodes_of(quarantine("gpu-07")) == {"gpu-07"}

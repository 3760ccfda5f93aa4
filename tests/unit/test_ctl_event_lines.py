"""`llmgw ctl events` and `replay --timeline` (llmgw.ctl.eventlines): what each line says
and which events a node, replica or model's timeline keeps. Pure."""

from __future__ import annotations

import msgspec

from llmgw.core import events
from llmgw.ctl import eventlines


def _placed(rid: str, *, replaces: str = "", nodes: tuple[str, ...] = ("node-b",)) -> events.Event:
    shards = tuple(events.ShardAssignment(shard=i, node=n, gpus=(i,)) for i, n in enumerate(nodes))
    return events.ReplicaPlaced(id=f"p-{rid}", ts=0, replica_id=rid, model="m",
                                replaces=replaces, shards=shards)  # fmt: skip


def test_a_shard_line_says_where_it_serves_and_why_it_failed() -> None:
    up = events.ShardStatus(id="s", ts=0, node="node-a", replica_id="r1", generation=2,
                            phase="serving", endpoint="http://10.0.0.1:8000")  # fmt: skip
    assert eventlines.summary(up) == "node-a r1/0 g2 serving http://10.0.0.1:8000"
    failed = events.ShardStatus(id="s", ts=0, node="node-a", replica_id="r1", generation=2,
                                phase="failed", error="CUDA out of memory")  # fmt: skip
    assert eventlines.summary(failed) == "node-a r1/0 g2 failed: CUDA out of memory"


def test_lost_and_unreachable_nodes_are_told_apart() -> None:
    lost = events.NodeLost(id="l", ts=0, node="node-a", last_heartbeat=0)
    gone = events.NodeUnreachable(id="u", ts=0, node="node-a", last_heartbeat=0)
    assert eventlines.summary(lost) == "node-a lost"
    assert eventlines.summary(gone) == "node-a unreachable"


def test_commands_say_what_they_start_and_where() -> None:
    stop = events.StopShard(id="c", ts=0, node="node-a", replica_id="r1", generation=3)
    assert eventlines.summary(stop) == "stop r1/0 g3 on node-a"
    drain = events.DrainShard(id="c", ts=0, node="node-a", replica_id="r1", generation=3)
    assert eventlines.summary(drain) == "drain r1/0 g3 on node-a"


def test_an_attestation_counts_its_runs_inclusively() -> None:
    attested = events.LogAttested(id="a", ts=0, epoch=1, first_seq=10, last_seq=30,
                                  accepted=((10, 19), (21, 30)), refused=((20, 20),))  # fmt: skip
    assert eventlines.summary(attested) == "attested 10..30: 20 accepted, 1 refused"
    # Attestations written now hold their runs in `payload_accepted` (a digest of the
    # subject and payload alone).
    now = msgspec.structs.replace(attested, accepted=(), payload_accepted=attested.accepted)
    assert eventlines.summary(now) == "attested 10..30: 20 accepted, 1 refused"


def test_a_node_is_touched_by_what_its_subject_names_and_where_replicas_land() -> None:
    hb = events.Heartbeat(id="h", ts=0, node="")
    assert eventlines.touches(hb, "node-a", "llmgw.events.node.node-a.heartbeat")
    assert not eventlines.touches(hb, "node-a")
    placed = _placed("r2", nodes=("node-b", "node-c"))
    assert eventlines.nodes_of(placed) == {"node-b", "node-c"}


def test_a_replica_is_touched_by_its_replacement_and_by_a_node_that_runs_it() -> None:
    assert eventlines.replicas_of(_placed("r2", replaces="r1")) == {"r1", "r2"}
    registered = events.NodeRegistered(
        id="r", ts=0, node="node-a", address="10.0.0.1",
        shards=(events.RunningShard(replica_id="r7", generation=1, shard=0, gpus=(0,),
                                    phase="serving"),),
    )  # fmt: skip
    assert eventlines.touches(registered, "r7")
    assert eventlines.touches(registered, "node-a")


def test_a_models_timeline_keeps_its_replicas_events_and_its_removal() -> None:
    timeline = eventlines.Timeline("m")
    assert timeline.touches(_placed("r2"))
    status = events.ShardStatus(id="s", ts=0, node="node-b", replica_id="r2", generation=1,
                                phase="serving")  # fmt: skip
    other = events.ShardStatus(id="s", ts=0, node="node-b", replica_id="r9", generation=1,
                               phase="serving")  # fmt: skip
    assert timeline.touches(status)  # r2 is m's: the placement said so
    assert not timeline.touches(other)
    removed = events.ModelRemoved(id="x", ts=0, operator="alice", name="m")
    assert eventlines.model_of(removed) == "m"
    assert timeline.touches(removed)


def test_a_type_filter_takes_a_tag_a_family_a_kind_or_a_prefix() -> None:
    assert eventlines.matches_tag("node.heartbeat", "node.heartbeat")
    assert eventlines.matches_tag("node.heartbeat", "node")
    assert eventlines.matches_tag("node.heartbeat", "heartbeat")
    assert eventlines.matches_tag("operator.node_cordoned", "operator.")
    assert not eventlines.matches_tag("node.heartbeat", "heart")
    assert not eventlines.matches_tag("node.heartbeat", "no")
    assert not eventlines.matches_tag("operator.node_cordoned", "node")

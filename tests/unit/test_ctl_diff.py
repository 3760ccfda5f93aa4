"""`llmgw ctl replay --diff`'s changes (llmgw.ctl.changes): every kind of difference an
operator looks for after an incident is reported, once, on its own line. Pure: the two
states are a fleet's, one altered as the log would have altered it."""

from __future__ import annotations

import msgspec

from llmgw.core import state
from llmgw.ctl import changes, history
from tests.unit import scenarios


def _fleet() -> scenarios.Sim:
    sim = scenarios.Sim()
    sim.register("node-a", count=2)
    sim.register("node-b", count=2)
    sim.declare(scenarios.profile("m", engine="sim", gpu_class=""))
    sim.settle()
    return sim


def _found(a: state.ClusterState, b: state.ClusterState) -> set[tuple[str, str, str]]:
    return {(c.scope, c.key, c.field) for c in changes.diff(a, b)}


def test_a_nodes_liveness_gpu_health_and_gpus_are_each_a_change() -> None:
    sim = _fleet()
    a = sim.state
    b = history.copy_state(a)
    node = b.nodes["node-b"]
    node.liveness = "unreachable"
    node.gpus[0] = msgspec.structs.replace(node.gpus[0], ecc_uncorrected=2)
    del node.gpus[1]
    assert _found(a, b) == {
        ("node", "node-b", "liveness"),
        ("node", "node-b", "unhealthy_gpus"),
        ("node", "node-b", "gpus"),
    }
    (gpus,) = [c for c in changes.diff(a, b) if c.field == "gpus"]
    assert (gpus.before, gpus.after) == ([0, 1], [0])
    (health,) = [c for c in changes.diff(a, b) if c.field == "unhealthy_gpus"]
    assert health.before == {}
    assert health.after == {0: list(node.gpus[0].health_problems)}
    assert health.after[0]


def test_a_node_added_or_removed_says_its_gpus_and_address() -> None:
    sim = _fleet()
    b = history.copy_state(sim.state)
    gone = b.nodes.pop("node-b")
    (removed,) = [c for c in changes.diff(sim.state, b) if c.scope == "node"]
    assert (removed.key, removed.field) == ("node-b", "removed")
    assert removed.before == f"2 GPUs at {gone.address}"
    assert removed.render() == f"- node node-b  2 GPUs at {gone.address}"
    (added,) = [c for c in changes.diff(b, sim.state) if c.scope == "node"]
    assert (added.field, added.after, added.before) == ("added", removed.before, None)
    assert added.render().startswith("+ node node-b  2 GPUs")


def test_a_replica_retired_and_its_shards_phase_are_changes() -> None:
    sim = _fleet()
    a = sim.state
    b = history.copy_state(a)
    (replica,) = [r for r in b.replicas.values() if not r.retired]
    replica.retired = True
    replica.shards[0].phase = "stopped"
    assert _found(a, b) == {
        ("replica", replica.id, "retired"),
        ("shard", f"{replica.id}/0", "phase"),
    }
    (retired,) = [c for c in changes.diff(a, b) if c.field == "retired"]
    assert retired.render() == f"~ replica {replica.id}: retired false -> true"


def test_an_endpoint_moved_and_a_new_leader_are_changes() -> None:
    sim = _fleet()
    a = sim.state
    b = history.copy_state(a)
    (rid,) = b.endpoints
    b.endpoints[rid] = msgspec.structs.replace(b.endpoints[rid], url="http://10.0.0.9:8000")
    b.leader, b.epoch = "control-b", a.epoch + 1
    found = changes.diff(a, b)
    assert {(c.scope, c.key, c.field) for c in found} == {
        ("endpoint", rid, "url"),
        ("cluster", "leader", "epoch"),
    }
    (leader,) = [c for c in found if c.scope == "cluster"]
    assert leader.before == f"{a.leader or '-'} (epoch {a.epoch})"
    assert leader.after == f"control-b (epoch {a.epoch + 1})"
    # The same epoch, another leader: a change too.
    c = history.copy_state(a)
    c.leader = "control-c"
    assert _found(a, c) == {("cluster", "leader", "epoch")}


def test_a_models_revision_and_profile_fields_are_changes() -> None:
    sim = _fleet()
    a = sim.state
    b = history.copy_state(a)
    model = b.models["m"]
    model.revision += 1
    model.profile = msgspec.structs.replace(model.profile, replicas=3)
    assert _found(a, b) == {("model", "m", "revision"), ("model", "m", "replicas")}
    c = history.copy_state(a)
    del c.models["m"]
    (removed,) = [x for x in changes.diff(a, c) if x.scope == "model"]
    assert removed.render() == f"- model m  1 replicas, revision {a.models['m'].revision}"


def test_a_gpu_replaced_by_another_is_a_change_of_gpus() -> None:
    sim = _fleet()
    b = history.copy_state(sim.state)
    node = b.nodes["node-b"]
    node.gpus[3] = msgspec.structs.replace(node.gpus.pop(1), index=3)
    (gpus,) = changes.diff(sim.state, b)
    assert (gpus.key, gpus.field, gpus.before, gpus.after) == ("node-b", "gpus", [0, 1], [0, 3])


def test_a_shard_moved_to_other_gpus_shows_them_as_lists() -> None:
    sim = _fleet()
    b = history.copy_state(sim.state)
    (replica,) = [r for r in b.replicas.values() if not r.retired]
    before = list(replica.shards[0].gpus)
    replica.shards[0].gpus = (7,)
    (moved,) = changes.diff(sim.state, b)
    assert (moved.before, moved.after) == (before, [7])
    assert moved.render() == f"~ shard {replica.id}/0: gpus {before} -> [7]"

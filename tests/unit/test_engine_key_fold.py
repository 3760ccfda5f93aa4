"""The engine key through the pure core: ShardStatus -> shard state -> EndpointUp -> router.

The key of a generation's engine comes with its serving status, is kept on the shard (and
in snapshots), is copied by the leader into EndpointUp, and goes with the generation: a
restarted engine's endpoint carries the new engine's key, never the old one's.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core import events, state
from llmgw.router.feed import wanted
from tests.unit.scenarios import Sim, profile


def started(sim: Sim) -> list[events.StartShard]:
    return [d for d in sim.leader() if isinstance(d, events.StartShard)]


def serve(sim: Sim, start: events.StartShard, key: str) -> None:
    for phase in ("starting", "loading"):
        sim.status(start.node, start.replica_id, start.generation, start.shard, phase)
    sim.status(
        start.node,
        start.replica_id,
        start.generation,
        start.shard,
        "serving",
        endpoint=f"http://{start.node}.internal:{start.launch.port}",
        api_key=key,
    )


def ups(decisions: list[events.Event]) -> list[events.EndpointUp]:
    return [d for d in decisions if isinstance(d, events.EndpointUp)]


def test_the_serving_key_reaches_endpoint_up_and_the_routers_table() -> None:
    sim = Sim()
    sim.register("n1")
    sim.declare(profile("m", replicas=1))
    (start,) = started(sim)
    serve(sim, start, "key-g1")
    assert sim.rejected == []
    shard = sim.state.replicas[start.replica_id].shards[0]
    assert shard.api_key == "key-g1"
    (up,) = ups(sim.leader())
    assert up.api_key == "key-g1"
    assert sim.state.endpoints[start.replica_id].api_key == "key-g1"
    url, model, draining, key, _node = wanted(sim.state).endpoints[start.replica_id]
    assert (model, draining, key) == ("m", False, "key-g1")
    assert url == up.url
    # Snapshots keep it: a router or control plane starting from one still knows it.
    again = state.decode_snapshot(state.encode_snapshot(sim.state))
    assert again.endpoints[start.replica_id].api_key == "key-g1"
    assert again.replicas[start.replica_id].shards[0].api_key == "key-g1"
    assert state.digest(again) == state.digest(sim.state)


def test_a_restarted_generation_serves_with_its_own_key_only() -> None:
    sim = Sim()
    sim.register("n1")
    sim.declare(profile("m", replicas=1))
    (start,) = started(sim)
    serve(sim, start, "key-g1")
    sim.leader()
    sim.status(start.node, start.replica_id, start.generation, 0, "failed", error="exit 1")
    sim.leader()  # endpoint down; the restart waits for its backoff
    restart: list[events.StartShard] = []
    for _ in range(60):
        sim.advance(1.0)
        restart = started(sim)
        if restart:
            break
    (second,) = restart
    assert second.generation == start.generation + 1
    shard = sim.state.replicas[start.replica_id].shards[0]
    assert shard.api_key == ""  # the old engine's key went with its generation
    assert start.replica_id not in sim.state.endpoints
    # A late status of the old generation cannot bring its key back.
    sim.status(start.node, start.replica_id, start.generation, 0, "serving", api_key="key-g1")
    assert shard.api_key == ""
    serve(sim, second, "key-g2")
    (up,) = ups(sim.leader())
    assert up.api_key == "key-g2"


def test_an_engine_started_without_a_key_is_routed_without_one() -> None:
    """Events written before keys existed decode with an empty key: no header is sent."""
    sim = Sim()
    sim.register("n1")
    sim.declare(profile("m", replicas=1))
    (start,) = started(sim)
    serve(sim, start, "")
    (up,) = ups(sim.leader())
    assert up.api_key == ""
    old = events.encode(up).replace(b',"api_key":""', b"")
    assert b"api_key" not in old
    assert events.decode(old) == up


@settings(max_examples=50, deadline=None)
@given(key=st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=80))
def test_any_key_survives_the_events_encoding(key: str) -> None:
    ev = events.ShardStatus(
        id="s", ts=1.0, node="n1", replica_id="r", generation=1, phase="serving", api_key=key
    )
    assert events.decode(events.encode(ev)) == ev

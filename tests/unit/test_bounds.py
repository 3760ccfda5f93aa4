"""Bounded input: whatever JSON a writer sends decodes to an event everything downstream
handles (the fold, the digest, snapshots, the admin API's views, ctl's tables, the
reconciler), or fails in `events.decode` with DecodeError; never anything else."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw import config
from llmgw.core import events, limits, reconcile, state, tenancy, views
from llmgw.ctl import render

from .scenarios import Sim, fabric, profile, registered
from .strategies import any_event

# Values a hostile or broken writer might put anywhere in an event.
HOSTILE: list[Any] = [
    2**70,
    -(2**70),
    2**64,
    2**63,
    2**63 - 1,
    2**53 + 1,
    2**31,
    -1,
    0,
    1e308,
    -1e308,
    1e-320,
    -0.0,
    True,
    None,
    "",
    "x" * 300,
    "y" * 20_000,
    "\x00\u202e\ud7ff",
    [],
    {},
    [0] * 300,
    ["z"] * 2000,
    {"k": "v" * 10},
]
hostile_values = st.one_of(
    st.sampled_from(HOSTILE),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.lists(st.integers(-3, 300), max_size=5),
)


def base_sim() -> Sim:
    """Two nodes, a model serving one replica on each, a drain on neither: a live fleet."""
    sim = Sim()
    sim.register("a", fabrics=[fabric("ib-a", ["mlx5_0"])])
    sim.register("b", fabrics=[fabric("ib-a", ["mlx5_1"])])
    sim.declare(profile("llama", replicas=2, tensor_parallel=2))
    sim.settle()
    assert len(sim.serving("llama")) == 2
    return sim


BASE = base_sim()
BASE_SNAPSHOT = state.encode_snapshot(BASE.state)
REPLICA = sorted(BASE.state.replicas)[0]
REPLICA_NODE = BASE.state.replicas[REPLICA].shards[0].node


def templates() -> list[events.Event]:
    """Events aimed at what the base state holds, so a mutation reaches the fold's logic."""
    r = BASE.state.replicas[REPLICA]
    shard = r.shards[0]
    running = events.RunningShard(
        replica_id=REPLICA,
        generation=r.generation,
        shard=0,
        gpus=shard.gpus,
        phase="serving",
        endpoint="http://a.internal:8100",
    )
    reg = registered(REPLICA_NODE, fabrics=[fabric("ib-a", ["mlx5_0"])], shards=[running])
    common: dict[str, Any] = {"id": "t", "ts": 2000.0}
    ctl: dict[str, Any] = {**common, "epoch": 1, "basis_seq": BASE.state.last_seq}
    return [
        msgspec.structs.replace(reg, ts=2000.0),
        events.Heartbeat(
            **common, node=REPLICA_NODE, seq=9, gpus=(events.GpuHealth(index=0, ecc_uncorrected=1),)
        ),
        events.ShardStatus(
            **common,
            node=REPLICA_NODE,
            replica_id=REPLICA,
            generation=r.generation,
            phase="failed",
            error="boom",
            log_tail=("a", "b"),
            pid=123,
        ),
        events.ModelChanged(
            **common, operator="alice", profile=profile("llama", replicas=3, max_model_len=8)
        ),
        events.NodeDrainRequested(**common, operator="alice", node=REPLICA_NODE, grace_s=5.0),
        events.NodeCordoned(**common, operator="alice", node=REPLICA_NODE, reason="r"),
        events.GpuHealthChanged(
            **ctl, node=REPLICA_NODE, gpus=(events.GpuHealth(index=1, foreign_memory_mib=5),)
        ),
        events.NodeUnreachable(**ctl, node=REPLICA_NODE, last_heartbeat=1500.0),
        events.NodeLost(**ctl, node=REPLICA_NODE, last_heartbeat=1500.0),
        events.ReplicaPlaced(
            **ctl,
            replica_id="r-new",
            model="llama",
            shards=(events.ShardAssignment(shard=0, node="b", gpus=(6, 7), port=8200),),
        ),
        events.StopShard(
            **ctl, node=REPLICA_NODE, replica_id=REPLICA, generation=r.generation, grace_s=3.0
        ),
        events.DrainShard(
            **ctl, node=REPLICA_NODE, replica_id=REPLICA, generation=r.generation, grace_s=3.0
        ),
        events.EndpointUp(**ctl, replica_id=REPLICA, model="llama", url="http://x:1"),
        events.LeaderElected(**{**ctl, "epoch": 2}, leader="control-2"),
    ]


TEMPLATES = templates()


def _paths(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every position in a JSON tree (the root's `type` excepted: that picks the class)."""
    out = [path] if path else []
    if isinstance(node, dict):
        for k, v in node.items():
            if not (path == () and k == "type"):
                out += _paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*path, i))
    return out


def _set(tree: Any, path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


@st.composite
def hostile_json(draw: st.DrawFn) -> bytes:
    """A valid event with a few of its values (or whole sub-trees) replaced, or a key added."""
    event = draw(st.sampled_from(TEMPLATES) | any_event)
    tree = msgspec.to_builtins(event)
    paths = _paths(tree)
    for _ in range(draw(st.integers(1, 3))):
        if paths and draw(st.booleans()):
            path = draw(st.sampled_from(paths))
            # (an earlier replacement may have removed that position)
            with contextlib.suppress(KeyError, IndexError, TypeError):
                _set(tree, path, draw(hostile_values))
        else:
            key = draw(st.sampled_from(["x", "gpus", "v", "memory_mib", "epoch", "shards"]))
            tree[key] = draw(hostile_values)
    return json.dumps(tree).encode()


def check_downstream(event: events.AnyEvent) -> None:
    """Everything that reads a folded state, after folding `event` into a live fleet."""
    st_ = state.decode_snapshot(BASE_SNAPSHOT)
    reason = state.apply(st_, event, st_.last_seq + 1)
    assert reason is None or isinstance(reason, str)
    digest = state.digest(st_)
    again = state.decode_snapshot(state.encode_snapshot(st_))
    assert state.digest(again) == digest
    now = 2100.0
    nodes = views.node_rows(st_, now)
    replicas = views.replica_rows(st_)
    models = views.model_rows(st_, now)
    msgspec.json.encode([nodes, replicas, models, views.endpoint_rows(st_)])  # the admin API
    render.nodes_table(nodes)
    render.replicas_table(replicas)
    render.models_table(models)
    for decision in reconcile.reconcile(st_, now, epoch=max(st_.epoch, 1)):
        # The leader's own decisions must decode in every reader, or nothing obeys them.
        assert events.decode(events.encode(decision)) == decision


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_json())
def test_any_json_a_writer_sends_is_handled_downstream_or_refused_at_decode(raw: bytes) -> None:
    try:
        event = events.decode(raw)
    except events.DecodeError:
        return
    check_downstream(event)


@settings(max_examples=100, deadline=None)
@given(any_event)
def test_every_valid_event_folds_encodes_and_renders(event: events.AnyEvent) -> None:
    check_downstream(events.decode(events.encode(event)))


def _registration(**gpu: Any) -> bytes:
    tree = msgspec.to_builtins(registered("evil", count=1))
    tree["gpus"][0].update(gpu)
    return json.dumps(tree).encode()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("memory_mib", 2**70),
        ("memory_mib", limits.MAX_MEMORY_MIB + 1),
        ("memory_mib", -1),
        ("index", 256),
        ("index", -1),
        ("ecc_uncorrected", 2**64),
        ("nvlink_domain", 2**40),
        ("name", "n" * 10_000),
    ],
)
def test_an_out_of_range_gpu_is_refused_at_decode(field: str, value: Any) -> None:
    with pytest.raises(events.DecodeError, match=field):
        events.decode(_registration(**{field: value}))


def test_the_largest_values_in_range_still_decode_and_fold() -> None:
    event = events.decode(_registration(memory_mib=limits.MAX_MEMORY_MIB, index=255))
    assert isinstance(event, events.NodeRegistered)
    assert event.gpus[0].memory_mib == 2**24
    check_downstream(event)


@pytest.mark.parametrize(
    "patch",
    [
        {"ts": 1e300},
        {"ts": -5.0},
        {"id": "i" * 1000},
        {"epoch": 2**53 + 1},
        {"basis_seq": -1},
        {"grace_s": 1e12},
        {"generation": 2**63},
        {"shard": 5000},
        {"reason": "r" * (limits.MAX_TEXT + 1)},
    ],
)
def test_out_of_range_fields_of_a_command_are_refused(patch: dict[str, Any]) -> None:
    tree = msgspec.to_builtins(TEMPLATES[10])  # StopShard
    tree.update(patch)
    with pytest.raises(events.DecodeError):
        events.decode(json.dumps(tree).encode())


def test_collections_are_bounded() -> None:
    tree = msgspec.to_builtins(TEMPLATES[2])  # ShardStatus
    tree["log_tail"] = ["line"] * (limits.MAX_LOG_LINES + 1)
    with pytest.raises(events.DecodeError, match="log_tail"):
        events.decode(json.dumps(tree).encode())
    tree["log_tail"] = ["l" * (limits.MAX_LINE + 1)]
    with pytest.raises(events.DecodeError, match="log_tail"):
        events.decode(json.dumps(tree).encode())
    reg = msgspec.to_builtins(TEMPLATES[0])
    reg["shards"] = reg["shards"] * (limits.MAX_SHARDS + 1)
    with pytest.raises(events.DecodeError, match="shards"):
        events.decode(json.dumps(reg).encode())
    declared = msgspec.to_builtins(TEMPLATES[3])
    declared["profile"]["env"] = {f"K{i}": "v" for i in range(limits.MAX_ENV + 1)}
    with pytest.raises(events.DecodeError, match="env"):
        events.decode(json.dumps(declared).encode())
    declared["profile"]["env"] = {}
    declared["profile"]["engine_args"] = ["--enforce-eager"] * (limits.MAX_LIST + 1)
    with pytest.raises(events.DecodeError, match="engine_args"):
        events.decode(json.dumps(declared).encode())


def test_an_old_version_is_bounded_too() -> None:
    """The upcaster path (v1 ShardStatus) validates against the same bounds."""
    raw = {
        "type": "node.shard",
        "v": 1,
        "id": "x",
        "ts": 1.0,
        "node": "a",
        "replica_id": "r",
        "generation": 2**70,
        "phase": "failed",
        "log": "boom",
    }
    with pytest.raises(events.DecodeError, match="generation"):
        events.decode(json.dumps(raw).encode())


def test_a_decision_quoting_a_long_error_stays_within_bounds() -> None:
    sim = base_sim()
    r = sim.state.replicas[REPLICA]
    sim.status(r.shards[0].node, REPLICA, r.generation, 0, "failed", error="e" * limits.MAX_TEXT)
    decisions = sim.leader()
    assert decisions
    for d in decisions:
        assert events.decode(events.encode(d)) == d


@given(key=st.text(max_size=300))
def test_an_engine_key_decodes_exactly_when_a_request_head_can_carry_it(key: str) -> None:
    # Routers write the key into the head of every request to the engine: a character
    # outside visible ASCII failed each of them (latin-1 cannot encode it, and a space or
    # control would split the header), so the node's report is refused at decode instead.
    up = events.EndpointUp(id="u", ts=1.0, epoch=1, replica_id="r-1", model="m",
                           url="http://10.0.0.1:8000", node="node-a", api_key=key)  # fmt: skip
    status = events.ShardStatus(id="s", ts=1.0, node="node-a", replica_id="r-1", generation=1,
                                phase="serving", api_key=key)  # fmt: skip
    fits = len(key) <= limits.MAX_NAME and all("!" <= c <= "~" for c in key)
    for event in (up, status):
        data = events.encode(event)
        if fits:
            assert events.decode(data) == event
        else:
            with pytest.raises(events.DecodeError, match="api_key"):
                events.decode(data)


@pytest.mark.parametrize(
    ("kind", "good"),
    [
        (limits.EngineKey, "k3y_-"),
        (tenancy.Digest, "0" * 64),
        (tenancy.KeySettings, None),
        (config.LogLevel, "info"),
    ],
)
def test_a_whole_value_pattern_refuses_a_trailing_newline(kind: Any, good: str | None) -> None:
    # msgspec searches with Python's `re`, whose `$` matches before a final newline too:
    # "info\n", a key digest or a key's name with one passed (limits.WHOLE_END).
    def doc(value: str) -> object:
        return {"name": value} if good is None else value

    value = "alice" if good is None else good
    assert msgspec.convert(doc(value), kind) is not None
    with pytest.raises(msgspec.ValidationError, match="regex"):
        msgspec.convert(doc(value + "\n"), kind)

"""`llmgw ctl` against a real nats-server, a control plane and agents: views, drain, history.

The control plane runs in-process (ControlService, short timings); agents are the
control kit's simulated nodes (node identities on the wire). `ctl` runs in-process
through its typer app (so `--verify` can be shown a deliberately altered placement
rule by monkeypatching this process), and as a real subprocess where exit codes and
streaming output matter. Every `--json` output is parsed back.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from llmgw import bus
from llmgw.control.service import ControlService
from llmgw.core import events, placement
from llmgw.core.reconcile import ReconcileConfig
from tests.harness import TestNatsServer, connect_as, wait_for
from tests.integration.control_kit import (
    SimAgent,
    control_config,
    model,
    read_log,
    running,
    write_config,
)
from tests.integration.ctl_kit import Ctl


def serving(svc: ControlService, name: str) -> int:
    return sum(1 for r in svc.state.active_replicas(name) if r.id in svc.state.endpoints)


class Fleet:
    def __init__(self, server: TestNatsServer, svc: ControlService, config: Path) -> None:
        self.server = server
        self.svc = svc
        self.config = config
        self.agents: dict[str, SimAgent] = {}


@pytest.fixture
async def fleet(nats_server: TestNatsServer, tmp_path: Path) -> AsyncIterator[Fleet]:
    """A control plane declaring m1 (one replica) and two nodes with two GPUs each."""
    cfg = control_config(nats_server, "control-a", models=(model("m1", replicas=1),))
    path = write_config(cfg, tmp_path / "control.yaml")
    async with running(ControlService(cfg)) as svc:
        f = Fleet(nats_server, svc, path)
        try:
            for n in ("node-a", "node-b"):
                f.agents[n] = await SimAgent(nats_server, n, gpus=2).start()
            await wait_for(lambda: serving(svc, "m1") == 1, 15, "m1 serving")
            yield f
        finally:
            for agent in f.agents.values():
                await agent.close()


async def settled(f: Fleet) -> int:
    """Wait until the control plane has folded the whole log; its last sequence."""
    nc = await connect_as(f.server, "router", "probe")
    try:
        last = 0

        async def folded_all() -> bool:
            nonlocal last
            log = await read_log(nc)
            last = log[-1].seq
            return f.svc.state.last_seq == last

        await wait_for(folded_all, 10, "the control plane folding the whole log", every_s=0.2)
        return last
    finally:
        await bus.close(nc)


async def test_views_drain_and_replay_across_it(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctl = Ctl(fleet.server)
    nodes = (await ctl("nodes", "--json")).json()
    assert [n["name"] for n in nodes] == ["node-a", "node-b"]
    for n in nodes:
        assert n["liveness"] == "ready"
        assert not n["draining"]
        assert not n["cordoned"]
        assert n["gpu_classes"]["h100-80g"]["total"] == 2
        assert n["heartbeat_age_s"] is not None
        assert n["heartbeat_age_s"] < 5
    (replica,) = (await ctl("replicas", "--model", "m1", "--json")).json()
    holder = replica["shards"][0]["node"]
    other = "node-b" if holder == "node-a" else "node-a"
    assert replica["phase"] == "serving"
    assert replica["endpoint"]
    by_name = {n["name"]: n for n in nodes}
    assert by_name[holder]["gpu_classes"]["h100-80g"]["used"] == 1
    assert by_name[holder]["replicas"] == [replica["id"]]
    (m1,) = (await ctl("models", "--json")).json()
    assert (m1["name"], m1["replicas_serving"], m1["replicas_wanted"]) == ("m1", 1, 1)
    explained = (await ctl("explain-placement", "m1", "--json")).json()
    assert {v["node"] for v in explained["nodes"]} == {"node-a", "node-b"}
    assert explained["placement"] is not None
    table = await ctl("nodes")
    assert table.code == 0
    assert "NODE" in table.stdout
    assert holder in table.stdout

    before_seq = await settled(fleet)
    before_time = time.time()
    await asyncio.sleep(0.05)

    dry = (await ctl("drain", holder, "--dry-run", "--json")).json()
    assert [m["replica"] for m in dry["moves"]] == [replica["id"]]
    assert dry["moves"][0]["to"].startswith(f"{other}:")
    assert dry["published"] is None
    drained = await ctl("drain", holder, "--grace", "30", "--wait", "--timeout", "30", "--json")
    doc = drained.json()
    assert doc["progress"]["done"]
    assert doc["progress"]["replaced"] == 1
    assert doc["published"]["operator"] == "alice"
    assert "draining" in drained.stderr  # progress lines

    after_seq = await settled(fleet)
    await asyncio.sleep(0.05)
    after_time = time.time()

    # The past, as it was: before the drain, the node served the replica.
    then = (await ctl("replay", "--at", f"@{before_time}", "--json")).json()
    node_then = {n["name"]: n for n in then["nodes"]}[holder]
    assert not node_then["draining"]
    assert node_then["replicas"] == [replica["id"]]
    now = (await ctl("replay", "--at", f"@{after_time}", "--json")).json()
    node_now = {n["name"]: n for n in now["nodes"]}[holder]
    assert node_now["draining"]
    assert node_now["replicas"] == []
    (moved,) = [r for r in now["replicas"] if r["model"] == "m1"]
    assert moved["shards"][0]["node"] == other
    assert moved["replaces"] == replica["id"]
    by_seq = (await ctl("replay", "--to", str(before_seq), "--json")).json()
    assert by_seq["digest"] == then["digest"]

    # --diff across the drain: exactly the drain's changes.
    diff = (await ctl("replay", "--diff", str(before_seq), str(after_seq), "--json")).json()
    got = {(c["scope"], c["key"], c["field"]) for c in diff["changes"]}
    assert got == {
        ("node", holder, "draining"),
        ("node", holder, "drain_grace_s"),
        ("replica", replica["id"], "removed"),
        ("replica", moved["id"], "added"),
        ("endpoint", replica["id"], "removed"),
        ("endpoint", moved["id"], "added"),
    }, diff["changes"]
    text = await ctl("replay", "--diff", str(before_seq), str(after_seq))
    assert f"~ node {holder}: draining false -> true" in text.stdout

    # Timelines: the moved replica's whole life, and the drained node's.
    life = (await ctl("replay", "--timeline", replica["id"], "--json")).json()
    kinds = [e["type"] for e in life]
    assert kinds[0] == "control.replica_placed"
    assert "cmd.start_shard" in kinds
    assert "control.replica_retired" in kinds
    assert kinds.count("control.replica_placed") == 2  # itself, and its replacement's
    node_life = (await ctl("replay", "--timeline", holder, "--json")).json()
    assert "operator.node_drain_requested" in [e["type"] for e in node_life]

    # --verify: today's code reproduces every recorded decision...
    ok = await ctl("replay", "--verify", "--control-config", str(fleet.config), "--json")
    report = ok.json()
    assert report["ok"]
    assert report["differences"] == []
    assert report["decision_batches"] >= 3
    # The leader recorded the (short) timings it decides with: no config file needed, and
    # none can mislead the check.
    recorded = (await ctl("replay", "--verify", "--json")).json()
    assert recorded["ok"], recorded["differences"]
    assert recorded["timings"]["recorded_epochs"] == [fleet.svc.epoch]
    assert recorded["timings"]["unrecorded_epochs"] == []
    plain = await ctl("replay", "--verify")
    assert plain.code == 0
    assert "timings each leader recorded in the log" in plain.stdout

    # ...and a deliberately altered placement rule is flagged: never place on the node
    # that got the first replica.
    real_unusable = placement._unusable

    def altered(node: object, now: float | None = None) -> str:
        if getattr(node, "name", "") == holder:
            return "altered rule"
        return real_unusable(node, now)  # type: ignore[arg-type]

    monkeypatch.setattr(placement, "_unusable", altered)
    flagged = await ctl("replay", "--verify", "--control-config", str(fleet.config), "--json")
    assert flagged.code == 1
    report = json.loads(flagged.stdout)
    assert not report["ok"]
    assert report["differences"]
    assert any(holder in d["detail"] for d in report["differences"])
    human = await ctl("replay", "--verify", "--control-config", str(fleet.config))
    assert human.code == 1
    assert "would now be decided differently" in human.stdout


async def test_replay_starts_from_the_newest_snapshot_before_the_target(fleet: Fleet) -> None:
    ctl = Ctl(fleet.server)
    snap_seq = await fleet.svc.snapshot_now()
    operator = await connect_as(fleet.server, "operator", "alice")
    await bus.Publisher(operator.jetstream()).publish(
        events.NodeCordoned(id="c-1", ts=time.time(), operator="alice", node="node-a")
    )
    await operator.close()
    last = await settled(fleet)
    fast = (await ctl("replay", "--json")).json()
    assert fast["snapshot_seq"] == snap_seq
    # The fleet keeps writing (the leader's attestations): compared at ctl's own end.
    assert fast["seq"] >= last
    assert fast["folded"] == fast["seq"] - snap_seq
    full = (await ctl("replay", "--no-snapshots", "--to", str(fast["seq"]), "--json")).json()
    assert full["snapshot_seq"] == 0
    assert full["digest"] == fast["digest"]
    before = (await ctl("replay", "--to", str(snap_seq - 1), "--json")).json()
    assert before["snapshot_seq"] < snap_seq
    text = await ctl("replay", "--view", "nodes")
    assert f"snapshot at seq {snap_seq}" in text.stdout
    assert "cordoned" in text.stdout


async def test_status_compares_with_the_control_plane_and_tables_read_well(fleet: Fleet) -> None:
    ctl = Ctl(fleet.server)
    last = await settled(fleet)
    doc = (await ctl("status", "--control", fleet.svc.admin_url, "--json")).json()
    # The fleet keeps writing (the leader's attestations, the agents' reports): ctl's fold
    # reaches at least the end the test saw, and the control plane is compared with ctl's
    # fold at the control plane's own sequence.
    assert doc["seq"] >= last
    assert (doc["nodes"], doc["models"], doc["replicas"], doc["endpoints"]) == (2, 1, 1, 1)
    assert doc["leader"] == "control-a"
    control = doc["control"]
    assert control["instance"] == "control-a"
    assert control["leading"] is True
    assert control["digest_agrees"] is True
    assert control["folded_seq"] >= last
    if control["folded_seq"] == doc["seq"]:
        assert control["digest"] == doc["digest"]
    text = await ctl("status", "--control", fleet.svc.admin_url)
    assert "control plane control-a (leading)" in text.stdout
    assert "same state as this fold" in text.stdout
    down = await ctl("status", "--control", "http://127.0.0.1:1")
    assert down.code == 1
    assert "did not answer" in down.stderr
    # Without --control, only the log.
    assert (await ctl("status", "--json")).json()["control"] is None

    models = await ctl("models")
    assert "SERVING/ACTIVE/WANTED" in models.stdout
    assert "1/1/1" in models.stdout
    replicas = await ctl("replicas")
    assert "serving" in replicas.stdout
    assert "REPLICA" in replicas.stdout
    explained = await ctl("explain-placement", "m1")
    assert explained.stdout.startswith("model m1: a new replica lands on")
    lines = (await ctl("events", "--type", "control")).stdout.splitlines()
    assert any("control.leader_elected" in x and "control-a leads (epoch 1)" in x for x in lines)


async def test_a_drain_with_nowhere_to_go_waits_until_called_off(fleet: Fleet) -> None:
    ctl = Ctl(fleet.server)
    (replica,) = (await ctl("replicas", "--json")).json()
    holder = replica["shards"][0]["node"]
    other = "node-b" if holder == "node-a" else "node-a"
    assert (await ctl("cordon", other, "--reason", "maintenance")).code == 0
    plan = (await ctl("drain", holder, "--dry-run", "--json")).json()
    assert plan["moves"][0]["to"] == ""
    assert "cordoned: 1" in plan["moves"][0]["why_not"]
    # A real process: CliRunner swaps sys.stdout, so two cannot run at once in-process.
    waiting = asyncio.create_task(ctl.subprocess("drain", holder, "--wait", "--timeout", "30"))
    await wait_for(
        lambda: fleet.svc.state.nodes[holder].draining, 30, f"{holder} draining in the fold"
    )
    await asyncio.sleep(0.5)
    assert not waiting.done()
    assert (await ctl("uncordon", holder)).code == 0
    result = await asyncio.wait_for(waiting, 15)
    assert result.code == 1
    assert "called off" in result.stderr
    assert "0/1 replaced" in result.stderr


async def test_drain_wait_follows_a_log_that_stays_quiet_for_seconds(
    nats_server: TestNatsServer,
) -> None:
    """`ctl drain --wait` reads the log in one-second steps; a quiet second (no heartbeat,
    no decision while the replacement loads) must not end its reading of the log."""
    slow = ReconcileConfig(unreachable_after_s=60, lost_after_s=120, shard_drain_s=0.5)
    cfg = control_config(nats_server, "control-a", models=(model("m1"),), reconcile=slow)
    agents: list[SimAgent] = []
    async with running(ControlService(cfg)) as svc:
        try:
            agents.append(await SimAgent(nats_server, "node-a", heartbeat_s=30).start())
            await wait_for(lambda: serving(svc, "m1") == 1, 15, "m1 serving on node-a")
            # The replacement serves 4 s after it loads: four quiet seconds in the log.
            node_b = SimAgent(nats_server, "node-b", heartbeat_s=30, serve_after_s=4.0)
            agents.append(await node_b.start())
            await wait_for(lambda: "node-b" in svc.state.nodes, 15, "node-b registered")
            ctl = Ctl(nats_server)
            drained = await ctl.subprocess(
                "drain", "node-a", "--grace", "60", "--wait", "--timeout", "60", "--json"
            )
            assert drained.code == 0, drained
            assert "Traceback" not in drained.stderr, drained.stderr
            doc = drained.json()
            assert doc["progress"]["done"], doc
            assert doc["progress"]["replaced"] == 1, doc
        finally:
            for agent in agents:
                await agent.close()

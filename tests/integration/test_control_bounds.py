"""A node sends out-of-range numbers to a real `llmgw control` process: refused at decode.

A GPU with `memory_mib: 2**70` once crashed the control plane (OverflowError in
/v1/state, `ctl status` and the snapshot), and again after each restart. Now the
message fails to decode: the control counts it, logs it with its sequence, keeps
leading; /v1/state answers, a snapshot is written, and a restart folds fine.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import pytest

from llmgw.control.config import SnapshotConfig
from llmgw.core import events, subjects
from tests.harness import TestNatsServer, connect_as, signed_headers, wait_for
from tests.integration.control_kit import SimAgent, sim_gpus
from tests.integration.ctl_kit import Ctl
from tests.integration.test_control_failover import ControlProc

pytestmark = pytest.mark.slow


def registration(node: str, **gpu0: Any) -> dict[str, Any]:
    reg = events.NodeRegistered(
        id=f"reg-{node}-{len(gpu0)}-{sorted(gpu0)}",
        ts=1_780_000_000.0,
        node=node,
        address="127.0.0.1",
        gpus=sim_gpus(2),
    )
    tree: dict[str, Any] = msgspec.to_builtins(reg)
    tree["gpus"][0].update(gpu0)
    return tree


def hostile(node: str) -> list[tuple[str, dict[str, Any]]]:
    """(subject, message) pairs: valid JSON, valid shapes, numbers no real node has."""
    reg = subjects.node_event(node, "registered")
    out = [
        (reg, registration(node, memory_mib=2**70)),
        (reg, registration(node, index=2**40)),
        (reg, registration(node, ecc_uncorrected=-(2**70))),
        (reg, {**registration(node), "ts": 1e300}),
    ]
    shards = registration(node)
    shards["shards"] = [
        {"replica_id": "x", "generation": 2**64, "shard": 0, "gpus": [0], "phase": "serving"}
    ]
    out.append((reg, shards))
    beat = msgspec.to_builtins(events.Heartbeat(id="hb-evil", ts=1.0, node=node, seq=1))
    beat["seq"] = 2**63
    out.append((subjects.node_event(node, "heartbeat"), beat))
    return out


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


async def test_out_of_range_registrations_are_refused_and_the_control_plane_carries_on(
    nats_server: TestNatsServer, tmp_path: Path
) -> None:
    snapshots = SnapshotConfig(every_events=5, every_s=0.5)
    plane = ControlProc(nats_server, "control-a", tmp_path, snapshot=snapshots)
    agent: SimAgent | None = None
    evil = await connect_as(nats_server, "node", "node-evil")
    try:
        await wait_for(lambda: plane.state()["leading"], 20, "control-a leading", every_s=0.1)
        agent = await SimAgent(nats_server, "node-a", gpus=2).start()
        js = evil.jetstream()
        seqs = []
        for n, (subject, message) in enumerate(hostile("node-evil")):
            payload = json.dumps(message).encode()
            # Signed by node-evil itself: what it may write, checked for its bounds.
            headers = signed_headers(evil, subject, payload, f"evil-{n}")
            ack = await js.publish(subject, payload, headers=headers)
            seqs.append(ack.seq)

        async def refused_all() -> bool:
            st = await plane.astate()
            return bool(st["undecodable"] >= len(seqs) and st["folded_seq"] >= max(seqs))

        await wait_for(refused_all, 20, "every hostile message refused", every_s=0.2)
        st = await plane.astate()
        assert st["leading"] is True
        assert st["nodes"] == 1  # node-evil never registered
        assert metric(plane.url, "llmgw_control_events_undecodable_total") >= len(seqs)
        text = plane.log_text()
        for seq in seqs:
            line = next(
                (ln for ln in text.splitlines() if "bus.undecodable" in ln and f"{seq}" in ln),
                None,
            )
            assert line is not None, f"seq {seq} not logged as undecodable:\n{text[-3000:]}"
        assert "OverflowError" not in text

        # The two replicas of m1 still get placed on the honest node and serve.
        async def serving() -> bool:
            return bool((await plane.astate())["replicas"] == 2)

        await wait_for(serving, 20, "m1's two replicas placed", every_s=0.2)

        async def snapshotted() -> bool:
            return int((await plane.astate())["snapshot_seq"]) >= max(seqs)

        await wait_for(snapshotted, 20, "a snapshot after the hostile messages", every_s=0.2)
        # ctl folds the same log, renders and compares with the control plane.
        ctl = Ctl(nats_server)
        status = await ctl("status", "--control", plane.url, "--json")
        doc = status.json()
        assert doc["control"]["digest_agrees"] is True  # (ctl folds from the snapshot)
        assert doc["leader_state"] == "leading"
        # A replay to the hostile messages folds through them (skipping them) too.
        replayed = (await ctl("replay", "--to", str(max(seqs)), "--json")).json()
        assert "node-evil" not in {n["name"] for n in replayed["nodes"]}
        nodes = await ctl("nodes")
        assert nodes.code == 0
        assert "node-evil" not in nodes.stdout
        folded = (await plane.astate())["folded_seq"]
    finally:
        plane.stop()
    # A restart loads the snapshot and folds the tail, the hostile messages included.
    again = ControlProc(nats_server, "control-a", tmp_path, snapshot=snapshots)
    try:
        await wait_for(lambda: again.state()["leading"], 20, "control-a leading again", every_s=0.1)
        st = again.state()
        assert st["folded_seq"] >= folded
        assert "snapshot_loaded" in again.log_text()
        assert st["nodes"] == 1
        assert st["replicas"] == 2
        # Its fold (snapshot + tail) is the state ctl folds from the log.
        status = await Ctl(nats_server)("status", "--control", again.url, "--json")
        assert status.json()["control"]["digest_agrees"] is True
    finally:
        again.stop()
        if agent is not None:
            await agent.close()
        await evil.close()

"""`llmgw ctl` against the real services: `llmgw control` and two `llmgw agent` processes
whose replicas are real `llmgw sim` engines, all on one real nats-server.

The must-shows of issue 7 on the real fleet: the views parse back from `--json`; a
drain followed with `--wait` moves the replica (its replacement answers HTTP);
`replay --at` before the drain shows the node as it was and after it drained;
`--diff` across the drain lists exactly the drain's changes; `--verify` finds no
difference with the control plane's own reconcile timings, and flags a placement
rule altered in this process (ctl runs in-process; the services are subprocesses).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from llmgw import pidfiles
from llmgw.core import placement
from tests.harness import TestNatsServer
from tests.integration import agent_kit
from tests.integration.control_kit import control_config, model, write_config
from tests.integration.ctl_kit import ROOT, Ctl

pytestmark = pytest.mark.slow


class Services:
    def __init__(self, control_config: Path) -> None:
        self.control_config = control_config
        self.control: asyncio.subprocess.Process | None = None
        self.agents: list[agent_kit.AgentProcess] = []
        self.state_dirs: list[Path] = []


@pytest.fixture
async def services(nats_server: TestNatsServer, tmp_path: Path) -> AsyncIterator[Services]:
    cfg = control_config(nats_server, "control-a", models=(model("m1", replicas=1),))
    s = Services(write_config(cfg, tmp_path / "control.yaml"))
    try:
        s.control = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "llmgw",
            "control",
            "--config",
            str(s.control_config),
            stdout=subprocess.PIPE,
            stderr=(tmp_path / "control.log").open("wb"),
            cwd=ROOT,
        )
        assert s.control.stdout is not None
        line = (await asyncio.wait_for(s.control.stdout.readline(), 30)).decode()
        assert line.startswith("llmgw control control-a admin http://"), line
        # Each node on its own loopback address, as on separate hosts: placement gives
        # ports per node, so two nodes on one address would both be given port 8100.
        for node, address in (("node-a", "127.0.0.2"), ("node-b", "127.0.0.3")):
            state_dir = tmp_path / node
            s.state_dirs.append(state_dir)
            settings = agent_kit.agent_settings(
                nats_server,
                node,
                state_dir,
                sim_gpus="2xh100-80g",
                address=address,
                engine_host=address,
            )
            path = agent_kit.write_config(tmp_path / f"{node}.yaml", settings)
            agent = agent_kit.AgentProcess(path, tmp_path / f"{node}.log")
            s.agents.append(agent)
            await asyncio.to_thread(agent.start)
        yield s
    finally:
        for agent in s.agents:
            await asyncio.to_thread(agent.terminate)
        if s.control is not None and s.control.returncode is None:
            s.control.terminate()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(s.control.wait(), 15)
            if s.control.returncode is None:
                s.control.kill()
                await s.control.wait()
        for state_dir in s.state_dirs:
            agent_kit.kill_engines(state_dir)


async def poll(ctl: Ctl, args: tuple[str, ...], check: Any, within_s: float, what: str) -> Any:
    deadline = time.monotonic() + within_s
    while True:
        result = await ctl(*args)
        # Until the control plane has declared its config file's models, `--model m1`
        # is refused as unknown (exit 2): that is "not yet", not a failure.
        doc: Any = result.json() if result.code == 0 else result.stderr
        if result.code == 0 and check(doc):
            return doc
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {within_s} s; last: {doc}")
        await asyncio.sleep(0.5)


def engine_key(state_dirs: list[Path], replica_id: str) -> str:
    """The replica's engine key, from its agent's pid file (it answers nobody without it)."""
    for state_dir in state_dirs:
        for _, record in pidfiles.load_all(state_dir):
            if record is not None and record.replica_id == replica_id and record.shard == 0:
                return record.launch.api_key
    return ""


async def answers(
    ctl: Ctl, replica_id: str, state_dirs: list[Path], within_s: float = 60
) -> list[str]:
    """The model list of the replica's engine, through its current endpoint.

    Retried: placement's ports (8100...) are fixed, so on a machine shared with other
    test runs an engine can lose its port and be restarted by the control plane.
    """
    deadline = time.monotonic() + within_s
    while True:
        rows = (await ctl("replicas", "--json")).json()
        url = next((r["endpoint"] for r in rows if r["id"] == replica_id), None)
        if url:
            try:
                bearer = {"Authorization": f"Bearer {engine_key(state_dirs, replica_id)}"}
                async with (
                    aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http,
                    http.get(f"{url}/v1/models", headers=bearer) as resp,
                ):
                    if resp.status != 200:
                        raise aiohttp.ClientError(f"status {resp.status}")
                    return [m["id"] for m in (await resp.json())["data"]]
            except (aiohttp.ClientError, TimeoutError):
                pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{replica_id} answered at no endpoint within {within_s} s")
        await asyncio.sleep(0.5)


async def test_ctl_drains_replays_diffs_and_verifies_the_real_fleet(
    nats_server: TestNatsServer, services: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctl = Ctl(nats_server)
    (replica,) = await poll(
        ctl,
        ("replicas", "--model", "m1", "--json"),
        lambda rows: len(rows) == 1 and rows[0]["endpoint"] and rows[0]["phase"] == "serving",
        90,
        "m1 serving on a real sim engine",
    )
    assert await answers(ctl, replica["id"], services.state_dirs) == ["m1"]
    holder = replica["shards"][0]["node"]
    other = "node-b" if holder == "node-a" else "node-a"
    nodes = {n["name"]: n for n in (await ctl("nodes", "--json")).json()}
    assert set(nodes) == {"node-a", "node-b"}
    assert nodes[holder]["gpu_classes"]["h100-80g"]["used"] == 1
    assert nodes[other]["gpu_classes"]["h100-80g"]["free"] == 2
    assert nodes[holder]["heartbeat_age_s"] < 10
    assert replica["endpoint"].startswith(f"http://{nodes[holder]['address']}:")

    before = (await ctl("replay", "--json")).json()
    before_time = time.time()
    drained = await ctl("drain", holder, "--grace", "60", "--wait", "--timeout", "90", "--json")
    doc = drained.json()
    assert doc["progress"]["done"]
    assert doc["progress"]["replaced"] == 1
    assert doc["moves"][0]["to"].startswith(f"{other}:")
    after_time = time.time()
    after = (await ctl("replay", "--json")).json()
    (moved,) = [r for r in after["replicas"] if r["model"] == "m1"]
    assert moved["replaces"] == replica["id"]
    assert moved["shards"][0]["node"] == other
    assert await answers(ctl, moved["id"], services.state_dirs) == ["m1"]

    then = (await ctl("replay", "--at", f"@{before_time}", "--json")).json()
    node_then = {n["name"]: n for n in then["nodes"]}[holder]
    assert not node_then["draining"]
    assert node_then["replicas"] == [replica["id"]]
    now = (await ctl("replay", "--at", f"@{after_time}", "--json")).json()
    node_now = {n["name"]: n for n in now["nodes"]}[holder]
    assert node_now["draining"]
    assert node_now["replicas"] == []

    diff = (await ctl("replay", "--diff", str(before["seq"]), str(after["seq"]), "--json")).json()
    got = {(c["scope"], c["key"], c["field"]) for c in diff["changes"]}
    assert got == {
        ("node", holder, "draining"),
        ("node", holder, "drain_grace_s"),
        ("replica", replica["id"], "removed"),
        ("replica", moved["id"], "added"),
        ("endpoint", replica["id"], "removed"),
        ("endpoint", moved["id"], "added"),
    }, diff["changes"]

    config = str(services.control_config)
    report = (await ctl("replay", "--verify", "--control-config", config, "--json")).json()
    assert report["ok"], report["differences"]
    assert report["decision_batches"] >= 4

    real_unusable = placement._unusable

    def altered(node: Any, now: float | None = None) -> str:
        return "altered rule" if node.name == holder else real_unusable(node, now)

    monkeypatch.setattr(placement, "_unusable", altered)
    flagged = await ctl("replay", "--verify", "--control-config", config, "--json")
    assert flagged.code == 1
    differences = json.loads(flagged.stdout)["differences"]
    assert any(holder in d["detail"] for d in differences)

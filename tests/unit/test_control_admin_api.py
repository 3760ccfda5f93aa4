"""What the control plane's admin API (llmgw.control.admin) reads from the folded state,
over real HTTP at its admin listener: the same `ControlService` as production on in-memory
ports (llmgw.bus.memory), simulated agents serving a model, a rejected event, a router's
load report and a snapshot. Each figure of `/v1/state` is the service's own, `/health`
says where the fold is, `/v1/explain/<model>` answers every node for a declared model and
404 for any other name (odd characters included, quoted back as sent), and `/v1/sd/prometheus`
lists the routers that reported."""

from __future__ import annotations

import contextlib
import time
import urllib.parse
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec

from llmgw.bus.memory import LeaseBucket
from llmgw.control.service import ControlService
from llmgw.core import events, loadreport, placement, state, subjects
from llmgw.core.profile import ModelProfile
from tests.integration.control_kit import SimAgent
from tests.unit.test_control_ports import DEADLINE_S, RecordingLog, config, ports, running, until

ROUTER_METRICS = "127.0.0.1:9191"
ODD_MODEL = "org/chat{v2}?100%#"
"""A declared model's name may hold what a URL path does not as it is."""


@contextlib.asynccontextmanager
async def serving_fleet() -> AsyncIterator[tuple[ControlService, RecordingLog]]:
    """A leader with m1 (one replica) serving on one of two simulated nodes, `big` (four
    GPUs a shard) placed nowhere and ODD_MODEL wanting none; one rejected event folded."""
    log = RecordingLog()
    models = (
        ModelProfile(name="m1", engine="sim", replicas=1),
        ModelProfile(name="big", engine="sim", replicas=1, tensor_parallel=4),
        ModelProfile(name=ODD_MODEL, engine="sim", replicas=0),
    )
    cfg = msgspec.structs.replace(config(), models=models)
    agents = [
        SimAgent(None, node, log=log, gpus=2, heartbeat_s=0.05, serve_after_s=0.01)
        for node in ("node-a", "node-b")
    ]
    try:
        async with running(ControlService(cfg, ports=ports(log, LeaseBucket()))) as svc:
            for agent in agents:
                await agent.start()
            await until(
                lambda: any(r.id in svc.state.endpoints for r in svc.state.active_replicas("m1")),
                "m1 serving",
            )
            stray = events.ShardStatus(
                id="stray", ts=time.time(), node="node-a", replica_id="nope", generation=1,
                phase="serving",
            )  # fmt: skip
            await log.append(stray)
            await until(lambda: svc.rejected == 1, "the stray status rejected")
            for agent in agents:
                agent.beating = False
            yield svc, log
    finally:
        for agent in agents:
            await agent.close()


def expected_state(svc: ControlService) -> dict[str, Any]:
    st = svc.state
    return {
        "instance": "control-a", "leading": True, "leader": "control-a", "epoch": svc.epoch,
        "digest": state.digest(st), "folded_seq": st.last_seq, "control_seq": svc.control_seq,
        "snapshot_seq": svc.snapshot_seq, "caught_up": True, "rejected": 1, "undecodable": 0,
        "nodes": 2, "replicas": len(st.replicas), "models": 3,
    }  # fmt: skip


async def get(http: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with http.get(url) as resp:
        assert resp.content_type == "application/json", resp.content_type
        return resp.status, await resp.json()


async def test_v1_state_reports_the_services_own_figures() -> None:
    async with serving_fleet() as (svc, _), aiohttp.ClientSession() as http:
        snap = await svc.snapshot_now()
        deadline = time.monotonic() + DEADLINE_S
        while True:  # heartbeats already sent may still fold: read until quiet
            _, doc = await get(http, f"{svc.admin_url}/v1/state")
            if doc == expected_state(svc):
                break
            assert time.monotonic() < deadline, (doc, expected_state(svc))
        assert doc["snapshot_seq"] == snap > 0
        # Distinct figures, so that none stands in for another.
        assert doc["folded_seq"] > doc["control_seq"] > 0
        assert doc["replicas"] == 1 != doc["nodes"]
        status, health = await get(http, f"{svc.admin_url}/health")
        assert (status, health["status"], health["leading"]) == (200, "ok", True)
        assert 0 < health["folded_seq"] <= svc.state.last_seq


async def test_v1_nodes_shows_each_node_as_of_now() -> None:
    async with serving_fleet() as (svc, _), aiohttp.ClientSession() as http:
        deadline = time.monotonic() + DEADLINE_S
        while True:  # ages from the service's clock now: they grow once heartbeats stop
            _, nodes = await get(http, f"{svc.admin_url}/v1/nodes")
            if all(n["heartbeat_age_s"] > 0 for n in nodes):
                break
            assert time.monotonic() < deadline, nodes
        assert [n["name"] for n in nodes] == ["node-a", "node-b"]
        for node in nodes:
            assert node["liveness"] == "ready"
            assert node["heartbeat_age_s"] < DEADLINE_S, node
        _, replicas = await get(http, f"{svc.admin_url}/v1/replicas")
        assert [r["model"] for r in replicas] == ["m1"]


async def test_metrics_is_prometheus_text_of_the_services_registry() -> None:
    async with serving_fleet() as (svc, _), aiohttp.ClientSession() as http:
        async with http.get(f"{svc.admin_url}/metrics") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"] == "text/plain; version=0.0.4"
            page = await resp.text()
        assert "llmgw_control_leader 1.0" in page
        assert "llmgw_control_events_rejected_total 1.0" in page


async def test_v1_models_says_why_a_model_cannot_be_placed() -> None:
    async with serving_fleet() as (svc, _), aiohttp.ClientSession() as http:
        _, models = await get(http, f"{svc.admin_url}/v1/models")
        by_name = {m["name"]: m for m in models}
        assert by_name["m1"]["unplaceable"] is None
        assert by_name["big"]["unplaceable"] == svc.unplaceable["big"] != ""


async def test_explain_answers_every_node_for_a_declared_model() -> None:
    async with serving_fleet() as (svc, _), aiohttp.ClientSession() as http:
        status, doc = await get(http, f"{svc.admin_url}/v1/explain/big")
        want = placement.explain(svc.state, "big", svc.clock())
        assert status == 200
        assert (doc["model"], doc["verdict"]) == ("big", want.verdict)
        assert doc["placement"] == msgspec.to_builtins(want.placement)
        assert doc["verdict"] != ""
        assert sorted(n["node"] for n in doc["nodes"]) == ["node-a", "node-b"]
        assert doc["nodes"] == list(msgspec.to_builtins(want.nodes))
        assert doc["text"] == want.render()


async def test_explain_finds_a_declared_name_however_its_path_is_written() -> None:
    async with serving_fleet() as (svc, _), aiohttp.ClientSession() as http:
        quoted = urllib.parse.quote(ODD_MODEL, safe="")
        for path in (quoted, quoted.replace("%2F", "/")):
            url = aiohttp.client.URL(f"{svc.admin_url}/v1/explain/{path}", encoded=True)
            async with http.get(url) as resp:
                assert resp.status == 200, (path, await resp.text())
                doc = await resp.json()
            assert doc["model"] == ODD_MODEL
            assert doc["text"] == placement.explain(svc.state, ODD_MODEL, svc.clock()).render()


ODD_NAMES = (
    "nope", "M1", "m1 ", " m1", "m1\t", "a b", "<script>alert(1)</script>", "模型", "..",
    "a/b", "a\\b", "a%b", "a?b=c", "a#b", "'\"", "\x00", "\x7f", "m" * 2000, "%2e%2e",
    "llmgw.events.>", "{model}",
)  # fmt: skip


async def test_explain_of_any_other_name_is_a_404_that_quotes_it_as_sent() -> None:
    async with serving_fleet() as (svc, _), aiohttp.ClientSession() as http:
        for name in ODD_NAMES:
            quoted = urllib.parse.quote(name, safe="")
            url = aiohttp.client.URL(f"{svc.admin_url}/v1/explain/{quoted}", encoded=True)
            async with http.get(url) as resp:
                assert resp.status == 404, (name, resp.status, await resp.text())
                assert resp.content_type == "application/json", name
                doc = await resp.json()
            assert doc["model"] == name
            assert doc["nodes"] == [] or all("node" in n for n in doc["nodes"])


async def test_prometheus_discovery_lists_engines_routers_and_this_control_plane() -> None:
    async with serving_fleet() as (svc, _), aiohttp.ClientSession() as http:
        report = loadreport.LoadReport(ts=svc.clock(), metrics=ROUTER_METRICS)
        svc.scaler.note(subjects.router_signals("router-1", 0), report)
        _, groups = await get(http, f"{svc.admin_url}/v1/sd/prometheus")
        jobs = {g["labels"]["job"]: g for g in groups}
        assert jobs["llmgw-router"] == {
            "targets": [ROUTER_METRICS], "labels": {"job": "llmgw-router", "router": "router-1"},
        }  # fmt: skip
        assert jobs["llmgw-engine"]["labels"]["model"] == "m1"
        assert groups[-1] == {
            "targets": [svc.admin_url.removeprefix("http://")],
            "labels": {"job": "llmgw-control", "control": "control-a"},
        }

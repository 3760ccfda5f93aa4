"""A real Prometheus finds and scrapes the whole fleet through the control plane's service
discovery, and the dashboard's fleet queries answer.

The fleet as real processes (tests/e2e/fleet_kit.py: agents running `llmgw sim` engines on
ports the leader chose, the control plane, a router); Debian's `prometheus` (which
.ci/run installs) scrapes with one `http_sd_configs` entry pointing at the control plane's
`/v1/sd/prometheus`, which names the engines, the agents, the router and the control
plane. The test waits for every target to be up, then asks Prometheus what the fleet
looks like, as a dashboard would.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmgw import natsd
from tests.e2e.fleet_kit import Fleet, sim_model
from tests.harness import TestNatsServer, wait_for
from tests.kit import tools

pytestmark = pytest.mark.slow

Popen = subprocess.Popen[bytes]

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "llmgw.json"
RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "llmgw-alerts.yml"


def rules_without_waits(tmp: Path) -> Path:
    """The shipped alert rules with every `for:` at 0 s: the same expressions, judged at
    once (promtool's unit tests cover the waits)."""
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule["for"] = "0s"
    path = tmp / "llmgw-alerts.yml"
    path.write_text(yaml.safe_dump(doc))
    return path


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.load(resp)


def query(base: str, expr: str) -> list[dict[str, Any]]:
    doc = get(f"{base}/api/v1/query?query={urllib.parse.quote(expr)}")
    assert doc["status"] == "success", doc
    result: list[dict[str, Any]] = doc["data"]["result"]
    return result


def start_prometheus(binary: str, tmp: Path, config: dict[str, Any], port: int) -> Popen:
    """Check the config with promtool, then start Prometheus on 127.0.0.1:`port`."""
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    check = subprocess.run(
        ["promtool", "check", "config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    with (tmp / "prometheus.log").open("wb") as out:
        return subprocess.Popen(
            [
                binary,
                f"--config.file={path}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )


async def test_prometheus_scrapes_every_engine_found_through_the_control_plane(
    nats_server: TestNatsServer, tmp_path: Path
) -> None:
    binary = tools.required("prometheus", "apt-get install prometheus")
    fleet = Fleet(nats_server, tmp_path, models=(sim_model("m1", replicas=2),))
    prom: Popen | None = None
    try:
        await fleet.start()
        port = natsd.free_port("127.0.0.1")
        base = f"http://127.0.0.1:{port}"
        router = urllib.parse.urlsplit(fleet.router_admin).netloc
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules_without_waits(tmp_path))],
            "scrape_configs": [
                {
                    "job_name": "llmgw",
                    "http_sd_configs": [
                        {"url": f"{fleet.control_admin}/v1/sd/prometheus", "refresh_interval": "1s"}
                    ],
                },
            ],
        }
        prom = await asyncio.to_thread(start_prometheus, binary, tmp_path, config, port)
        replicas = {r["id"]: r for r in await fleet.replicas()}
        wanted_jobs = {"llmgw-engine": 2, "llmgw-agent": 2, "llmgw-control": 1, "llmgw-router": 1}
        targets: list[dict[str, Any]] = []

        def all_up() -> bool:
            nonlocal targets
            try:
                targets = get(f"{base}/api/v1/targets")["data"]["activeTargets"]
            except OSError:
                return False  # not listening yet
            jobs: dict[str, int] = {}
            for t in targets:
                if t["health"] == "up":
                    job = t["labels"]["job"]
                    jobs[job] = jobs.get(job, 0) + 1
            return jobs == wanted_jobs

        def seen() -> str:
            return json.dumps([(t["labels"], t["health"], t.get("lastError")) for t in targets])

        await wait_for(all_up, 60, f"targets up: {wanted_jobs}", every_s=0.5, detail=seen)
        engines = [t for t in targets if t["labels"]["job"] == "llmgw-engine"]
        for t in engines:
            replica = replicas[t["labels"]["replica"]]
            assert t["labels"]["model"] == "m1"
            assert t["labels"]["node"] == replica["shards"][0]["node"]
            assert t["scrapeUrl"].startswith(replica["endpoint"])
        # The router and the agents, found through the same discovery: the router by its
        # load reports, each agent by its registration (its admin listener's own address).
        (found,) = [t for t in targets if t["labels"]["job"] == "llmgw-router"]
        assert found["labels"]["router"] == fleet.router_name
        assert found["discoveredLabels"]["__address__"] == router
        agents = {
            t["labels"]["node"]: t["discoveredLabels"]["__address__"].rpartition(":")[0]
            for t in targets
            if t["labels"]["job"] == "llmgw-agent"
        }
        assert agents == fleet.addresses

        # What the dashboard's fleet panels ask, answered from the scrapes.
        def fleet_scraped() -> bool:
            return bool(query(base, 'llmgw_fleet_model_replicas_serving{model="m1"}'))

        await wait_for(fleet_scraped, 30, "the fleet's metrics scraped", every_s=0.5)
        (serving,) = query(base, 'max by (model) (llmgw_fleet_model_replicas_serving{model="m1"})')
        assert serving["value"][1] == "2"
        ready = query(base, 'max by (liveness) (llmgw_fleet_nodes{liveness="ready"})')
        assert ready[0]["value"][1] == "2"
        # The engines' own (vLLM-named) metrics arrive labelled with model and node.
        running = query(base, "vllm:num_requests_running")
        assert {r["metric"]["node"] for r in running} == {"node-a", "node-b"}
        dashboard = json.loads(DASHBOARD.read_text())
        fleet_exprs = [
            target["expr"].replace("$model", ".*")  # the dashboard's "All" models
            for panel in dashboard["panels"]
            if panel["title"].startswith("Fleet:")
            for target in panel["targets"]
            if "unplaceable" not in target["expr"]  # nothing unplaceable in this fleet
        ]
        assert fleet_exprs
        empty = [e for e in fleet_exprs if not query(base, e)]
        assert empty == [], empty
        firing: list[dict[str, Any]] = []

        def alerts() -> list[dict[str, Any]]:
            found: list[dict[str, Any]] = get(f"{base}/api/v1/alerts")["data"]["alerts"]
            return [a for a in found if a["state"] == "firing"]

        # A healthy fleet, once every target was scraped and the rules evaluated again
        # (before the control plane's first scrape, "no leader" is true), fires nothing.
        await wait_for(lambda: alerts() == [], 30, "no alert firing", every_s=0.5)

        # A node lost: its alert fires, naming it.
        fleet.kill_node("node-b")

        def lost_fires() -> bool:
            nonlocal firing
            firing = alerts()
            return any(
                a["labels"]["alertname"] == "LlmgwNodeLost" and a["labels"]["node"] == "node-b"
                for a in firing
            )

        await wait_for(lost_fires, 60, "LlmgwNodeLost firing for node-b", every_s=0.5)
        assert not any(a["labels"].get("node") == "node-a" for a in firing), firing
    finally:
        if prom is not None:
            prom.terminate()
            try:
                prom.wait(15)
            except subprocess.TimeoutExpired:
                prom.kill()
                prom.wait(5)
        await fleet.stop()

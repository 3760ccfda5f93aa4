"""The access log's line says where a request went, as the engines saw it: a real router
(`access_log: true`, its log at info) in front of `llmgw sim` engines, one of them made to
fail a request so that it is retried elsewhere, then both of a model's so that it falls
back to another model."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

from tests.integration.router_kit import Router, Sim

pytestmark = pytest.mark.slow

SUCCESS = "vllm:request_success_total"
NODES = {"a": "node-a", "b": "node-b", "s": "node-s"}


def access_line(router: Router, rid: str) -> dict[str, Any]:
    """The access log's line of request `rid`, once the router has written it."""
    assert router.log_path is not None
    deadline = time.monotonic() + 30
    while True:
        for raw in router.log_path.read_text(errors="replace").splitlines():
            if rid in raw:
                line = json.loads(raw)
                if line.get("event") == "request" and line.get("request_id") == rid:
                    return dict(line)
        assert time.monotonic() < deadline, f"no access log line for {rid}"
        time.sleep(0.05)


def served_by(sims: dict[str, Sim], before: dict[str, float]) -> str:
    """The one engine whose finished requests grew past `before`: the one that answered."""
    deadline = time.monotonic() + 30
    while True:
        grown = [ep for ep, sim in sims.items() if sim.metrics().get(SUCCESS, 0.0) > before[ep]]
        if grown:
            assert len(grown) == 1, grown
            return grown[0]
        assert time.monotonic() < deadline, "no engine finished the request"
        time.sleep(0.05)


def successes(sims: dict[str, Sim]) -> dict[str, float]:
    return {ep: sim.metrics().get(SUCCESS, 0.0) for ep, sim in sims.items()}


def fault_left(sim: Sim) -> bool:
    """Whether the engine's fault plan still waits for a request."""
    return bool(json.loads(sim.get("/sim/faults"))["active"])


def test_the_access_log_names_the_engine_that_answered_the_attempts_and_the_fallback(
    tmp_path: Path, procs: list[Sim | Router]
) -> None:
    short = ("--eos-min-tokens", "2", "--eos-max-tokens", "2")
    sims = {"a": Sim.start("m", *short), "b": Sim.start("m", *short),
            "s": Sim.start("small", *short)}  # fmt: skip
    procs.extend(sims.values())
    endpoints = [
        {"id": ep, "url": sim.url, "node": NODES[ep], "models": ["small" if ep == "s" else "m"]}
        for ep, sim in sims.items()
    ]
    router = Router.start(
        tmp_path,
        dict(sims),
        models=[{"name": "m", "fallbacks": ["small"]}, {"name": "small"}],
        endpoints=endpoints,
        access_log=True,
    )
    procs.append(router)

    def send(rid: str, path: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Send `body`: the engine that answered it and its access log line."""
        before = successes(sims)
        headers = {"X-Request-Id": rid, "x-session-id": "one-session"}
        with httpx.Client(base_url=router.url, timeout=30) as h:
            r = h.post(path, json=body, headers=headers)
        assert r.status_code == 200, r.text
        return served_by(sims, before), access_line(router, rid)

    # A completion, with a session: the engine it reached is the one the line names.
    went, line = send("first", "/v1/completions", {"model": "m", "prompt": "Where to?"})
    assert line["level"] == "info"
    assert (line["api"], line["model"], line["status"]) == ("completions", "m", 200)
    assert (line["endpoint"], line["node"]) == (went, NODES[went])
    assert (line["attempts"], line["served_model"]) == (1, None)

    # The session's engine fails its next request: the router retries on the other one.
    sims[went].faults(fail_status=503, count=1)
    chat = {"model": "m", "messages": [{"role": "user", "content": "And now?"}]}
    other, line = send("retried", "/v1/chat/completions", chat)
    assert not fault_left(sims[went]), "the session's engine never saw the first attempt"
    assert other != went
    assert (line["api"], line["endpoint"], line["node"]) == ("chat", other, NODES[other])
    assert (line["attempts"], line["served_model"]) == (2, None)

    # Both engines of `m` fail their next request: the fallback model's engine answers.
    for ep in ("a", "b"):
        sims[ep].faults(fail_status=503, count=1)
    fell_to, line = send("fell-back", "/v1/chat/completions", chat)
    assert not any(fault_left(sims[ep]) for ep in ("a", "b")), "an engine of m was not tried"
    assert fell_to == "s"
    assert (line["model"], line["served_model"]) == ("m", "small")
    assert (line["endpoint"], line["node"], line["attempts"]) == ("s", "node-s", 3)

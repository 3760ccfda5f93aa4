"""Every log line is one JSON object naming its component: llmgw's own loggers and the
standard library's (aiohttp, nats-py), tracebacks included."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import logging
from llmgw import logs
early = logs.get("llmgw.early")  # made before setup, as module-level loggers are
logs.setup("info", json=True)
early.info("early.event", n=1)
logs.get("llmgw.router").warning("router.thing", detail="x")
logs.get("llmgw.router").debug("router.hidden")
logging.getLogger("aiohttp.access").warning("GET %s 200", "/v1/models")
try:
    raise ValueError("boom")
except ValueError:
    logging.getLogger("nats.aio.client").exception("callback failed")
logging.getLogger("asyncio").debug("hidden too")
"""


def test_every_line_is_json_with_its_component() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True
    )
    lines = [json.loads(line) for line in out.stderr.splitlines()]
    assert [(d["component"], d["level"], d["event"]) for d in lines] == [
        ("llmgw.early", "info", "early.event"),
        ("llmgw.router", "warning", "router.thing"),
        ("aiohttp.access", "warning", "GET /v1/models 200"),
        ("nats.aio.client", "error", "callback failed"),
    ]
    assert all("timestamp" in d for d in lines)
    assert lines[0]["n"] == 1
    assert "ValueError: boom" in lines[3]["exception"]

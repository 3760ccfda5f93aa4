"""Every log line is one JSON object naming its component: llmgw's own loggers and the
standard library's (aiohttp, nats-py), tracebacks included; and every event name keeps
one convention."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import logging
from llmgw import logs
early = logs.get("llmgw.early")  # made before setup, as module-level loggers are
logs.setup("info", json=True)
early.info("early_event", n=1)
logs.get("llmgw.router").warning("thing", detail="x")
logs.get("llmgw.router").debug("hidden")
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
        ("llmgw.early", "info", "early_event"),
        ("llmgw.router", "warning", "thing"),
        ("aiohttp.access", "warning", "GET /v1/models 200"),
        ("nats.aio.client", "error", "callback failed"),
    ]
    assert all("timestamp" in d for d in lines)
    assert lines[0]["n"] == 1
    assert "ValueError: boom" in lines[3]["exception"]


# --------------------------------------------------------------------------- event names

EVENT_NAME = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+)*")
SHELLS = ("agent", "control", "router", "bus", "sim", "tasks", "llmgw")
LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}


def event_names(source: str) -> list[tuple[int, str]]:
    """(line, name) of every literal event name given to a logger in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        receiver = node.func.value
        name = getattr(receiver, "id", getattr(receiver, "attr", ""))
        if node.func.attr not in LEVELS or name not in ("log", "_log") or not node.args:
            continue
        first = node.args[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            found.append((first.lineno, first.value))
    return found


def name_problem(name: str) -> str:
    """Why an event name breaks the convention ("" when it keeps it)."""
    if not EVENT_NAME.fullmatch(name):
        return "is not snake_case words"
    first = name.split("_", 1)[0]
    if first in SHELLS and "_" in name:
        return f"repeats the component ({first!r}), which every line already names"
    return ""


def test_event_names_are_snake_case_and_do_not_repeat_the_component() -> None:
    """One convention: the event says what happened (`lease_acquired`), the component
    says where (`llmgw.bus`); no name is prefixed with its component, half by hand."""
    problems = []
    checked = 0
    for path in sorted((ROOT / "llmgw").rglob("*.py")):
        for line, name in event_names(path.read_text()):
            checked += 1
            why = name_problem(name)
            if why:
                problems.append(f"{path.relative_to(ROOT)}:{line}: {name!r} {why}")
    assert checked > 100, "the scan found the log calls"
    assert problems == []


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("lease_acquired", True),
        ("stopped", True),
        ("bus.connected", False),
        ("agent_stopped", False),
        ("router_worker_started", False),
        ("Bad-Name", False),
        ("control", True),
    ],
)
def test_the_convention_check_itself(name: str, ok: bool) -> None:
    assert (name_problem(name) == "") is ok
    assert event_names(f"log.info({name!r}, n=1)\n") == [(1, name)]

"""llmgw.core stays pure: no I/O libraries, no clock, no randomness (docs/design.md invariant 2)."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "llmgw" / "core"
FORBIDDEN_MODULES = {
    "asyncio",
    "nats",
    "aiohttp",
    "structlog",
    "prometheus_client",
    "random",
    "time",
    "datetime",
    "socket",
    "subprocess",
    "os",
    "uuid",
    "secrets",
    "threading",
    "pynvml",
}
FORBIDDEN_CALLS = {"open", "print", "input"}


def test_core_imports_no_io_clock_or_randomness() -> None:
    offenders: list[str] = []
    for path in sorted(CORE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if name.split(".")[0] in FORBIDDEN_MODULES:
                    offenders.append(f"{path.name}:{node.lineno} imports {name}")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in FORBIDDEN_CALLS
            ):
                offenders.append(f"{path.name}:{node.lineno} calls {node.func.id}()")
    assert offenders == []

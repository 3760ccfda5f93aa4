"""JSON Schema of the event union and of the config Structs, generated into schemas/.

`llmgw schemas --write` regenerates the checked-in files; tests/unit/test_schemas.py
fails when they drift from the code, so a Struct change cannot ship silently.
Config Structs register themselves in CONFIG_TYPES by import path.
"""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path
from typing import Any

import msgspec

from llmgw.core import events

# File name -> "module:Struct" of each configuration described in schemas/.
CONFIG_TYPES: dict[str, str] = {
    "model-profile.schema.json": "llmgw.core.profile:ModelProfile",
    "router-config.schema.json": "llmgw.router.config:RouterConfig",
    "router-keys.schema.json": "llmgw.router.auth:KeysFile",
    "agent-config.schema.json": "llmgw.agent.config:AgentConfig",
    "sim-config.schema.json": "llmgw.sim.config:SimConfig",
    "control-config.schema.json": "llmgw.control.config:ControlConfig",
    "ctl-config.schema.json": "llmgw.ctl.settings:CtlConfig",
}


def _schema(tp: Any) -> dict[str, Any]:
    return msgspec.json.schema(tp)


def generate() -> dict[str, str]:
    """Every schema file's name and its exact text."""
    out = {"events.schema.json": _render(_schema(events.AnyEvent))}
    for name, ref in CONFIG_TYPES.items():
        module, _, attr = ref.partition(":")
        out[name] = _render(_schema(getattr(importlib.import_module(module), attr)))
    return out


def _render(schema: dict[str, Any]) -> str:
    return json.dumps(_clean(schema), indent=2, sort_keys=True) + "\n"


def _clean(node: Any) -> Any:
    """Docstring-derived descriptions, dedented the same way whatever msgspec's version
    (0.23 dedents them itself, 0.22 does not): the files must not depend on it."""
    if isinstance(node, dict):
        return {
            k: inspect.cleandoc(v) if k == "description" and isinstance(v, str) else _clean(v)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_clean(v) for v in node]
    return node


def write(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in generate().items():
        path = folder / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            written.append(path)
    return written


def drift(folder: Path) -> list[str]:
    """Names of schema files missing, stale, or no longer generated."""
    expected = generate()
    problems = [
        n for n, t in expected.items() if not (folder / n).exists() or (folder / n).read_text() != t
    ]
    problems += [p.name for p in folder.glob("*.schema.json") if p.name not in expected]
    return sorted(problems)

"""The layer rules, read from every import in llmgw/ (lazy ones inside functions too):

- `llmgw.core` imports nothing of llmgw outside itself (it is the pure model and planner);
- no shell imports a sibling shell: the agent, control plane, router, ctl, sim and the
  embedded fleet share code only through `core`, `bus`, `pki` and the top-level modules;
- `llmgw.cli` is the one place that wires shells together.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "llmgw"
SHELLS = ("agent", "control", "router", "ctl", "sim", "up")


def imported_llmgw_modules(path: Path) -> set[str]:
    """Every `llmgw.x.y` a module imports, `from llmgw import a` giving `llmgw.a`."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "llmgw"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "llmgw":
                found |= {f"llmgw.{a.name}" for a in node.names}
            elif node.module.startswith("llmgw."):
                found.add(node.module)
    return found


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def offences(layer: str, allowed: set[str] | None, forbidden: set[str]) -> list[str]:
    out = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for module in imported_llmgw_modules(path):
            other = layer_of(module)
            if other == layer:
                continue
            if (allowed is not None and other not in allowed) or other in forbidden:
                out.append(f"{path.relative_to(PACKAGE.parent)} imports {module}")
    return out


def test_core_imports_only_core() -> None:
    assert offences("core", allowed=set(), forbidden=set()) == []


def test_no_shell_imports_a_sibling_shell() -> None:
    found = [line for shell in SHELLS for line in offences(shell, None, set(SHELLS) | {"cli"})]
    assert found == []


def test_the_rules_see_lazy_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "def f():\n    from llmgw.router import app\n    import llmgw.agent.service\n"
        "from llmgw import bus\n"
    )
    assert imported_llmgw_modules(module) == {
        "llmgw.router",
        "llmgw.agent.service",
        "llmgw.bus",
    }

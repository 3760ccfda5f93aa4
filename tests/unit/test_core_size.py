"""The core stays readable in pieces: no module of llmgw/core over 500 lines and no function
over 60, unless a comment right above the function says why it is longer."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "llmgw" / "core"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def test_no_core_module_is_over_500_lines() -> None:
    long = {
        str(p.relative_to(CORE)): n
        for p in sorted(CORE.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def test_no_core_function_is_over_60_lines_without_a_comment_saying_why() -> None:
    long: list[str] = []
    for path in sorted(CORE.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines), filename=str(path))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            assert node.end_lineno is not None
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            justified = first >= 2 and lines[first - 2].lstrip().startswith("#")
            if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES and not justified:
                long.append(f"{path.relative_to(CORE)}:{node.lineno} {node.name}")
    assert long == []

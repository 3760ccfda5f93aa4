"""The size rule: no module in llmgw/ over 500 lines and no function over 60, unless a
comment says why.

A long function carries `# long: <why>` on the line directly above its `def` (or above
its first decorator); a long module carries `# long module: <why>` among its first 30
lines. A marker without a reason is an offence wherever it stands: the rule asks for the
reason, not for the word.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "llmgw"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
MODULE_MARKER_WINDOW = 30

_FUNCTION_MARKER = re.compile(r"^\s*#\s*long:(.*)$")
_MODULE_MARKER = re.compile(r"^\s*#\s*long module:(.*)$")


def _reason(pattern: re.Pattern[str], line: str) -> str | None:
    """The marker's reason ('' for a bare marker), or None when the line is no marker."""
    match = pattern.match(line)
    return None if match is None else match.group(1).strip()


def offences(name: str, source: str) -> list[str]:
    """Every breach of the size rule in one module's source, each as a readable line."""
    lines = source.splitlines()
    found: list[str] = []
    for number, line in enumerate(lines, start=1):
        for pattern in (_FUNCTION_MARKER, _MODULE_MARKER):
            if _reason(pattern, line) == "":
                found.append(f"{name}:{number}: a size marker without a reason")
    if len(lines) > MAX_MODULE_LINES:
        head = lines[:MODULE_MARKER_WINDOW]
        if not any(_reason(_MODULE_MARKER, line) for line in head):
            found.append(f"{name}: {len(lines)} lines (limit {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(source, filename=name)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        assert node.end_lineno is not None
        length = node.end_lineno - node.lineno + 1
        if length <= MAX_FUNCTION_LINES:
            continue
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        above = lines[first - 2] if first >= 2 else ""
        if not _reason(_FUNCTION_MARKER, above):
            found.append(
                f"{name}:{node.lineno}: {node.name} is {length} lines (limit {MAX_FUNCTION_LINES})"
            )
    return found


def test_every_module_and_function_fits_or_says_why() -> None:
    found: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += offences(path.relative_to(ROOT).as_posix(), path.read_text())
    assert len(list(PACKAGE.rglob("*.py"))) > 100, "the scan found the package"
    assert found == []


def _function(lines: int, marker: str | None = None, decorated: bool = False) -> str:
    body = "".join(f"    x{i} = {i}\n" for i in range(lines - 1))
    head = "@decorator\n" if decorated else ""
    above = f"{marker}\n" if marker is not None else ""
    return f"{above}{head}def f():\n{body}"


def test_the_rule_catches_an_oversized_function() -> None:
    assert offences("m.py", _function(MAX_FUNCTION_LINES)) == []
    assert offences("m.py", _function(MAX_FUNCTION_LINES + 1)) == [
        f"m.py:1: f is {MAX_FUNCTION_LINES + 1} lines (limit {MAX_FUNCTION_LINES})"
    ]


def test_the_rule_catches_an_oversized_method() -> None:
    body = "".join(f"        x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    source = f"class C:\n    async def m(self):\n{body}"
    assert offences("m.py", source) == [
        f"m.py:2: m is {MAX_FUNCTION_LINES + 1} lines (limit {MAX_FUNCTION_LINES})"
    ]


def test_a_reasoned_marker_above_the_def_or_its_decorators_excuses_it() -> None:
    long = MAX_FUNCTION_LINES + 5
    assert offences("m.py", _function(long, "# long: one option per flag")) == []
    decorated = _function(long, "# long: one option per flag", decorated=True)
    assert offences("m.py", decorated) == []


def test_a_marker_elsewhere_or_without_reason_does_not() -> None:
    long = MAX_FUNCTION_LINES + 5
    away = "# long: a reason\n\n" + _function(long)
    assert len(offences("m.py", away)) == 1
    bare = offences("m.py", _function(long, "# long:"))
    assert bare == [
        "m.py:1: a size marker without a reason",
        f"m.py:2: f is {long} lines (limit {MAX_FUNCTION_LINES})",
    ]


def test_the_rule_catches_an_oversized_module() -> None:
    source = "x = 1\n" * (MAX_MODULE_LINES + 1)
    assert offences("m.py", source) == [f"m.py: {MAX_MODULE_LINES + 1} lines (limit 500)"]
    assert offences("m.py", "# long module: a table of metrics\n" + source) == []
    late = "x = 1\n" * MODULE_MARKER_WINDOW + "# long module: too late\n" + source
    assert len(offences("m.py", late)) == 1
    assert offences("m.py", "# long module:\nx = 1\n") == ["m.py:1: a size marker without a reason"]

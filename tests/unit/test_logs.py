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
import structlog
from hypothesis import example, given
from hypothesis import strategies as st

from llmgw import logs
from llmgw.core import printable

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


# --------------------------------------------------------------------------- node text

# What a node can put in a field that a service logs: an OSC that retitles the terminal,
# the 8-bit CSI (U+009B), a right-to-left override, a zero-width space, a line break.
HOSTILE = ["\x1b]0;pwned\x07", "\u009b31m", "\u202e", "\u200b", "\n"]

HOSTILE_SCRIPT = f"""
import logging, sys
from llmgw import logs
logs.setup("info", json=sys.argv[1] == "json")
text = "".join({HOSTILE!r})
log = logs.get("llmgw.control")
log.warning("event_refused", error=text, node="node-a" + text, spaced="a b" + text,
            listed=[text], **{{"key" + text: 1}})
log.info(text)
logging.getLogger("aiohttp.access").info("GET %s 200", "/" + text)
try:
    raise ValueError(text)
except ValueError:
    log.exception("failed", reason=text)
"""


def _logged(form: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", HOSTILE_SCRIPT, form],
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=120,
        check=True,
    ).stderr


def test_the_console_log_writes_node_text_escaped() -> None:
    """On a terminal, keys, values, messages and tracebacks: nothing a node wrote acts on
    it, and every line the script logs stays one line (the traceback keeps its own)."""
    out = _logged("console")
    assert not [c for c in "\x1b\x07\x9b\u202e\u200b" if c in out]
    shown = "\\x1b]0;pwned\\x07\\x9b31m\\u202e\\u200b\\x0a"
    lines = out.splitlines()
    events = [line.split("] ", 1)[1].split()[0] for line in lines[:4]]
    assert events == ["event_refused", shown, "GET", "failed"]
    assert f"error={shown}" in lines[0]
    assert f"node=node-a{shown}" in lines[0]
    assert f"spaced='a b{shown}'" in lines[0]
    assert f"key{shown}=1" in lines[0]
    assert f"/{shown}" in lines[2]
    assert f"ValueError: {shown[:-4]}\n" in out  # a traceback keeps its line breaks
    # ... each of its lines indented, so that a node's line break in the message cannot
    # start a line that reads as a record of its own: only the four records start at once.
    assert [line for line in lines if not line[:1].isspace()] == lines[:4]


def test_in_colour_the_only_escape_sequences_are_the_renderers_own() -> None:
    text = "".join(HOSTILE)
    line = logs.EscapingConsoleRenderer(colors=True)(
        None, "warning", {"event": text, "level": "warning", "error": text, "n": [text]}
    )
    colours = re.compile(r"\x1b\[[0-9;]*m")
    assert colours.search(line)
    assert not [c for c in "\x1b\x07\x9b\u202e\u200b\n" if c in colours.sub("", line)]


def shown_value(text: str) -> str:
    """What the console writes of field `a` holding `text`, read back: its quotes taken off
    and a quote escaped inside them unescaped. AssertionError where a quote inside ends the
    value early: what follows would read as fields of their own."""
    line = logs.EscapingConsoleRenderer(colors=False)(None, "info", {"event": "e", "a": text})
    value = line.split(" a=", 1)[1]
    quote = value[0] if value[:1] in ("'", '"') else ""
    if not quote:
        return value
    assert len(value) >= 2, value
    assert value.endswith(quote), value
    inner, out, i = value[1:-1], [], 0
    while i < len(inner):
        if inner[i] == "\\":  # printable's escapes, and an escaped quote
            pair = inner[i : i + 2]
            out.append(quote if pair == "\\" + quote else pair)
            i += 2
            continue
        assert inner[i] != quote, f"{text!r} is written {value}: its quote ends early"
        out.append(inner[i])
        i += 1
    return "".join(out)


@given(st.text(alphabet=st.sampled_from("ab ='\"\\\x1b")))
@example("x'\" b=\"y'")
def test_a_console_value_reads_back_as_itself_and_never_as_more_fields(text: str) -> None:
    """A node's text with both kinds of quote in it was wrapped in one of them as it was:
    `x'" b="y'` read as a field `a` of `x'` and a field `b` of `y'`."""
    assert shown_value(text) == printable.escaped(text)


def test_json_logs_escape_every_character_but_printable_ascii() -> None:
    lines = _logged("json").splitlines()
    assert all(line.isascii() and line.isprintable() for line in lines)
    records = [json.loads(line) for line in lines]
    text = "".join(HOSTILE)
    assert records[0]["error"] == text
    assert records[0]["key" + text] == 1
    assert records[1]["event"] == text
    assert f"ValueError: {text}" in records[3]["exception"]


def test_a_text_holding_one_kind_of_quote_is_wrapped_in_the_other_as_it_is() -> None:
    render = logs.EscapingConsoleRenderer(colors=False)
    line = render(None, "info", {"event": "e", "a": "it's here"})
    assert line.endswith(""" a="it's here\"""")
    line = render(None, "info", {"event": "e", "a": 'say "hi"'})
    assert line.endswith(""" a='say "hi"'""")


class _RawRepr:
    """A value whose repr is a node's text as it came (a library's object, say)."""

    def __repr__(self) -> str:
        return "".join(HOSTILE)


def test_a_value_of_any_type_is_written_escaped() -> None:
    line = logs.EscapingConsoleRenderer(colors=False)(
        None, "warning", {"event": "e", "level": "warning", "peer": _RawRepr()}
    )
    assert not [c for c in "\x1b\x07\x9b\u202e\u200b\n" if c in line]
    assert "peer=\\x1b]0;pwned" in line


def test_a_requests_trace_is_on_its_lines_and_an_empty_span_left_out() -> None:
    assert logs._trace_of_request(None, "info", {"event": "e"}) == {"event": "e"}
    token = logs.TRACE.set(("a" * 32, ""))
    try:
        assert logs._trace_of_request(None, "info", {"event": "e"}) == {
            "event": "e",
            "trace_id": "a" * 32,
        }
        logs.TRACE.set(("a" * 32, "b" * 16))
        assert logs._trace_of_request(None, "info", {})["span_id"] == "b" * 16
    finally:
        logs.TRACE.reset(token)


def test_an_unknown_level_logs_as_info() -> None:
    code = (
        "from llmgw import logs; logs.setup('loud', json=True); log = logs.get('llmgw.x'); "
        "log.debug('hidden'); log.info('shown')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert [json.loads(line)["event"] for line in out.stderr.splitlines()] == ["shown"]


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


def test_ctl_writes_the_library_logs_it_lets_through_escaped() -> None:
    from llmgw.cli import ctl_common

    ctl_common.quiet_logs()
    assert isinstance(structlog.get_config()["processors"][-1], logs.EscapingConsoleRenderer)

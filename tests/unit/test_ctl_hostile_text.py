"""Text a node (or a router) writes, shown to an operator: it must neither drive the
terminal nor forge or disguise a line of `llmgw ctl`'s output, nor of the console's.

A compromised agent controls its registration (address, GPU names and classes, fabric
names) and its shard reports (endpoint, error, engine log tail); a router names the
models of the usage counters it adds to. Each test writes such text the way a node can
and reads what the operator would see.
"""

from __future__ import annotations

import shutil
import subprocess
import unicodedata
from collections.abc import AsyncIterator

import msgspec
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from llmgw import bus
from llmgw.core import events, placement, printable, views
from llmgw.ctl import changes, eventlines, history, operations, render, usage
from llmgw.ctl.errors import BadInput
from tests.unit import scenarios

# 8-bit CSI (U+009B) clears the screen on a terminal that takes C1 controls as UTF-8;
# NEL (U+0085) is a line break to some; RLO and RLI reverse what follows; a zero-width
# space, a BOM or a soft hyphen makes a name pass for another.
CSI, NEL, RLO, RLI, PDI = "\x9b", "\x85", "\u202e", "\u2067", "\u2069"
ZWSP, BOM, SHY = "\u200b", "\ufeff", "\xad"
DANGEROUS = ["\n", "\r", "\x1b", CSI, NEL, RLO, RLI, PDI, "\u200f", "\u061c", ZWSP, BOM, SHY]


def _safe(text: str) -> bool:
    return not any(c in text for c in DANGEROUS[1:])


@pytest.mark.parametrize("char", DANGEROUS)
def test_clean_escapes_c0_c1_and_bidi_controls(char: str) -> None:
    cleaned = eventlines.clean(f"a{char}b")
    assert char not in cleaned
    assert cleaned == f"a\\x{ord(char):02x}b" if ord(char) < 256 else f"a\\u{ord(char):04x}b"


def test_clean_keeps_ordinary_text() -> None:
    text = "shard 0 failed: CUDA out of memory (80 GiB) — résumé 模型 🙂 مرحبا"
    assert eventlines.clean(text) == text


def test_a_shard_error_with_8bit_csi_or_bidi_does_not_reach_the_terminal() -> None:
    ev = events.ShardStatus(
        id="s", ts=0, node="node-a", replica_id="r-1", generation=1, phase="failed",
        error=f"oom{CSI}2J{CSI}31m", log_tail=(f"line {RLO}1-edon{PDI}",),
    )  # fmt: skip
    assert _safe(eventlines.summary(ev))
    row = {"id": "r-1", "model": "m", "retired": False, "shards": [
        {"shard": 0, "node": "node-a", "gpus": [0], "phase": "failed", "endpoint": "",
         "error": ev.error, "log_tail": list(ev.log_tail)}]}  # fmt: skip
    assert _safe(render.replicas_table([row]))


def test_inventory_with_bidi_overrides_shows_escaped_in_the_nodes_table() -> None:
    sim = scenarios.Sim()
    gpus = tuple(
        msgspec.structs.replace(g, gpu_class=f"h100-80g{RLO}")
        for g in scenarios.gpus("h100-80g", 2, node="node-a")
    )
    sim.register("node-a", gpu_list=gpus, fabrics=[scenarios.fabric(f"ib{CSI}2J")])
    assert _safe(render.nodes_table(views.node_rows(sim.state, sim.now)))


def test_replay_diff_a_node_address_cannot_forge_a_change() -> None:
    sim = scenarios.Sim()
    before = history.copy_state(sim.state)
    forged = "10.0.0.2\n+ node node-z  8 GPUs at 10.9.9.9"
    sim.append(msgspec.structs.replace(scenarios.registered("node-b"), address=forged))
    lines = [c.render() for c in changes.diff(before, sim.state)]
    assert len(lines) == 1
    assert "\n" not in lines[0]
    assert lines[0] == "+ node node-b  8 GPUs at 10.0.0.2\\x0a+ node node-z  8 GPUs at 10.9.9.9"


def test_replay_diff_an_endpoint_url_cannot_forge_a_change() -> None:
    change = changes.Change(scope="endpoint", key="r-1", field="added",
                            after=f"http://a:1\r- endpoint r-2{CSI}2K")  # fmt: skip
    assert _safe(change.render())


def _wrong_class_fleet(gpu_class: str) -> scenarios.Sim:
    sim = scenarios.Sim()
    gpus = tuple(
        msgspec.structs.replace(g, gpu_class=gpu_class)
        for g in scenarios.gpus("h100-80g", 2, node="node-c")
    )
    sim.register("node-c", gpu_list=gpus)
    sim.declare(scenarios.profile("llama", gpu_class="a100-80g"))
    return sim


def test_explain_placement_a_gpu_class_cannot_forge_a_candidate() -> None:
    sim = _wrong_class_fleet("l40s-45g\n  + node-q  lands here")
    text = placement.explain(sim.state, "llama", sim.now).render()
    assert text.splitlines()[1:] == [
        "  - node-c  wrong class: has l40s-45g\\x0a  + node-q  lands here, needs a100-80g"
    ]
    assert _safe(placement.explain(_wrong_class_fleet(f"x{CSI}2J{RLO}").state, "llama", 0).render())


def test_a_router_cannot_put_controls_in_ctl_usage() -> None:
    subject = f"llmgw.usage.team-a.h.10.{'%C2%9B2J%E2%80%AEevil'}.req"
    rows = usage.rows({subject: 3}, {}, 0)
    assert rows[0]["model"] == f"{CSI}2J{RLO}evil"
    text = render.table(["KEY", "MODEL"], [[r["key"], r["model"]] for r in rows])
    assert _safe(text)


def test_json_for_a_terminal_escapes_c1_and_bidi_controls_and_means_the_same() -> None:
    import json

    data = {"error": f"x{CSI}2J{RLO}y\x1b\\{NEL}", "ok": "模型 🙂"}
    text = render.json_text(data)
    assert _safe(text)
    assert "\\u009b2J\\u202ey" in text
    assert json.loads(text) == data
    assert msgspec.json.decode(text) == data


@given(st.text(st.characters(exclude_categories=("Cs",))))
@example(f"node-a{ZWSP}\U000e0041\U000e0100{BOM}\u2028")
def test_json_for_a_terminal_holds_no_unsafe_character_and_decodes_the_same(text: str) -> None:
    """Astral ones (tags, variation selectors 17-256) as JSON writes them: UTF-16 pairs."""
    shown = render.json_text({"error": text})
    assert not [c for c in shown if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")]
    assert not [c for c in shown if ord(c) in printable.UNSAFE]
    assert msgspec.json.decode(shown) == {"error": text}


def test_the_console_page_writes_out_c1_format_and_invisible_characters_in_every_text() -> None:
    """In Chromium, a GPU class ending in U+202E reversed the model and replica links
    after it in the node's box (the page's `text` helper set textContent as given): the
    page now writes out the characters of `printable.UNSAFE` but C0, as ctl does."""
    import re
    from importlib import resources

    page = resources.files("llmgw.ctl.console").joinpath("page.html").read_text()
    found = re.search(r"const UNSAFE = /\[(.+?)\]/gu;", page)
    assert found is not None
    ranges = re.findall(r"\\u\{([0-9a-f]+)\}(?:-\\u\{([0-9a-f]+)\})?", found.group(1))
    assert "".join(f"\\u{{{a}}}" + (f"-\\u{{{b}}}" if b else "") for a, b in ranges) == (
        found.group(1)
    )
    in_page = {c for a, b in ranges for c in range(int(a, 16), int(b or a, 16) + 1)}
    assert in_page == {c for c in printable.UNSAFE if c >= 0x7F}
    assert "el.textContent = shown(content);" in page
    assert page.count(".innerHTML") == 0


_RUN_SHOWN = """
const page = require("fs").readFileSync(process.argv[1], "utf8");
eval(page.slice(page.indexOf("const UNSAFE"), page.indexOf("function text(")) + ";this.f=shown;");
const texts = JSON.parse(require("fs").readFileSync(0, "utf8"));
process.stdout.write(JSON.stringify(texts.map((t) => this.f(t))));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the page's script")
def test_the_console_pages_shown_writes_out_what_ctl_does_for_every_character() -> None:
    """The page's own `shown` run on each code point from DEL up: what ctl's escaping
    writes (astral ones whole, not as the halves of a UTF-16 pair), and C0 left alone."""
    from importlib import resources

    page = resources.files("llmgw.ctl.console").joinpath("page.html")
    texts = [chr(c) for c in range(0x7F, 0x110000) if not 0xD800 <= c <= 0xDFFF]
    texts += [f"node-a{ZWSP}", "a\nb", "模型 🙂 é"]
    found = subprocess.run(
        ["node", "-e", _RUN_SHOWN, str(page)],
        input=msgspec.json.encode(texts),
        capture_output=True,
        check=True,
    )
    expected = ["".join(c if ord(c) < 0x7F else printable.escaped(c) for c in t) for t in texts]
    assert msgspec.json.decode(found.stdout) == expected


# What the brief names: an OSC that retitles the terminal, the 8-bit CSI, RLO.
NODE = "node-a\x1b]0;pwned\x07\u009b31m\u202e\u200b"


def _log_with_a_forged_endpoint() -> list[bus.Record]:
    """A node named with controls, serving; the recorded EndpointUp then says another URL
    than the one the log reproduces, so `replay --verify` quotes both decisions."""
    sim = scenarios.Sim()
    sim.register(NODE)
    sim.declare(scenarios.profile("llama", replicas=1))
    sim.settle()
    log = [
        (seq, msgspec.structs.replace(e, url="http://forged:1"))
        if isinstance(e, events.EndpointUp)
        else (seq, e)
        for seq, e in sim.durable_records()
    ]
    return [bus.Record(seq=seq, subject="llmgw.log", time=1000.0, event=e) for seq, e in log]


def _ctl(monkeypatch: pytest.MonkeyPatch, log: list[bus.Record], *args: str) -> tuple[int, str]:
    """`llmgw ctl ARGS` over `log`, as the bus would serve it: exit status and stdout."""
    from typer.testing import CliRunner

    from llmgw.cli import ctl_common
    from llmgw.cli.main import app

    class Session:
        nc = None

        async def close(self) -> None:
            pass

    async def open_session(_cfg: object) -> Session:
        return Session()

    async def bounds(_nc: object) -> history.Bounds:
        return history.Bounds(
            first_seq=1, last_seq=log[-1].seq, first_time=0, last_time=0, messages=len(log)
        )

    async def records(_nc: object, **_kw: object) -> AsyncIterator[list[bus.Record]]:
        yield log

    monkeypatch.setattr(ctl_common.Session, "open", staticmethod(open_session))
    monkeypatch.setattr(history, "bounds", bounds)
    monkeypatch.setattr(history, "records", records)
    result = CliRunner().invoke(app, ["ctl", *args, "--server", "tls://127.0.0.1:4222"])
    return result.exit_code, result.stdout


@pytest.mark.parametrize("json_out", [False, True])
def test_replay_verify_escapes_the_decisions_it_quotes(
    monkeypatch: pytest.MonkeyPatch, json_out: bool
) -> None:
    log = _log_with_a_forged_endpoint()
    code, out = _ctl(monkeypatch, log, "replay", "--verify", *(["--json"] if json_out else []))
    assert code == 1, out
    assert "forged" in out
    assert not [c for c in "\x1b\x07\x9b\u202e\u200b" if c in out]
    quoted = msgspec.json.encode(NODE)[1:-1].decode()  # as the decision's JSON has it
    if json_out:
        (found,) = msgspec.json.decode(out)["differences"]
        assert quoted in found["detail"]
    else:
        assert printable.escaped(quoted) in out
        assert "decided differently" in out


def test_replay_escapes_what_the_fold_refused_and_what_it_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`replay --to` lists the fold's refusals (their reasons name a node's fields) and
    the messages that are no event (their subjects and the decoder's words)."""
    log = _log_with_a_forged_endpoint()

    async def rebuild(_nc: object, **_kw: object) -> history.Rebuilt:
        r = history.Rebuilt(
            state=scenarios.Sim().state, target_seq=log[-1].seq, at=None, snapshot_seq=0,
            folded=len(log), elapsed_s=0.0, rejected=[(3, f"unknown node {NODE}")],
            skipped=[bus.Skipped(seq=4, subject=f"llmgw.node.{NODE}", time=0, error=NODE)],
            bounds=history.Bounds(first_seq=1, last_seq=log[-1].seq, first_time=0,
                                  last_time=0, messages=len(log)),
        )  # fmt: skip
        return r

    monkeypatch.setattr(history, "rebuild", rebuild)
    code, out = _ctl(monkeypatch, log, "replay", "--to", str(log[-1].seq))
    assert code == 0, out
    assert not [c for c in "\x1b\x07\x9b\u202e\u200b" if c in out]
    assert f"seq 3: unknown node {printable.escaped(NODE)}" in out
    assert f"seq 4 llmgw.node.{printable.escaped(NODE)}: {printable.escaped(NODE)}" in out


def test_a_drain_shows_the_names_of_the_nodes_it_moves_to_escaped() -> None:
    """`ctl drain` prints its plan, then how far it has come: both name the node the
    replacement lands on; and a mistyped node is answered with the known ones."""
    sim = scenarios.Sim()
    sim.register("node-a", count=2)
    sim.declare(scenarios.profile("m", engine="sim", gpu_class=""))
    sim.settle()
    sim.register(NODE, count=2)
    (move,) = operations.drain_plan(sim.state, "node-a", sim.now)
    assert move.to.startswith(NODE)
    sim.drain("node-a", grace_s=100)
    sim.settle()
    progress = operations.drain_progress(sim.state, "node-a", [move.replica], sim.now)
    with pytest.raises(BadInput) as refused:
        operations.require_node(sim.state, "node-b")
    for text in (move.render(), progress.render(), *progress.lines, str(refused.value)):
        assert not [c for c in "\x1b\x07\x9b\u202e\u200b" if c in text]
    assert printable.escaped(NODE) in move.render()
    assert printable.escaped(NODE) in progress.lines[0]
    assert printable.escaped(NODE) in str(refused.value)

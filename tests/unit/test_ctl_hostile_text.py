"""Text a node (or a router) writes, shown to an operator: it must neither drive the
terminal nor forge or disguise a line of `llmgw ctl`'s output, nor of the console's.

A compromised agent controls its registration (address, GPU names and classes, fabric
names) and its shard reports (endpoint, error, engine log tail); a router names the
models of the usage counters it adds to. Each test writes such text the way a node can
and reads what the operator would see.
"""

from __future__ import annotations

import msgspec
import pytest

from llmgw.core import events, placement, views
from llmgw.ctl import changes, eventlines, history, render, usage
from tests.unit import scenarios

# 8-bit CSI (U+009B) clears the screen on a terminal that takes C1 controls as UTF-8;
# NEL (U+0085) is a line break to some; RLO and RLI reverse what follows.
CSI, NEL, RLO, RLI, PDI = "\x9b", "\x85", "\u202e", "\u2067", "\u2069"
DANGEROUS = ["\n", "\r", "\x1b", CSI, NEL, RLO, RLI, PDI, "\u200f", "\u061c"]


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


def test_the_console_page_writes_out_c1_and_bidi_controls_in_every_text() -> None:
    """In Chromium, a GPU class ending in U+202E reversed the model and replica links
    after it in the node's box (the page's `text` helper set textContent as given): the
    page now writes out the characters of `printable.UNSAFE` but C0, as ctl does."""
    import re
    from importlib import resources

    from llmgw.core import printable

    page = resources.files("llmgw.ctl.console").joinpath("page.html").read_text()
    found = re.search(r"const UNSAFE = /\[(.+?)\]/g;", page)
    assert found is not None
    unsafe = re.compile(f"[{found.group(1)}]")
    assert {c for c in range(0x10000) if unsafe.fullmatch(chr(c))} == {
        c for c in printable.UNSAFE if c >= 0x7F
    }
    assert "el.textContent = shown(content);" in page
    assert page.count(".innerHTML") == 0

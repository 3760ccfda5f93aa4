"""The tables `llmgw ctl nodes / replicas / replay` print (llmgw.ctl.render): a failed
shard in red, a retired replica's phase marked, a heartbeat expired from the log said so,
the fold's refusals counted in the header. Pure."""

from __future__ import annotations

from llmgw import bus
from llmgw.core import views
from llmgw.ctl import history, render
from tests.unit import scenarios


def test_failed_and_lost_are_red_whatever_else_the_cell_says() -> None:
    assert render.state_colour("failed") == "red"
    assert render.state_colour("retired:failed") == "red"
    assert render.state_colour("lost") == "red"
    assert render.state_colour("draining/failed") == "red"  # not the yellow it begins with
    assert render.state_colour("serving") == "green"
    assert render.state_colour("retired:serving") == "green"
    assert render.state_colour("whatever") is None


def _fleet() -> scenarios.Sim:
    sim = scenarios.Sim()
    sim.register("node-a", count=4, unhealthy=[3])
    sim.declare(scenarios.profile("m", engine="sim"))
    sim.settle()
    return sim


def test_a_nodes_row_says_gpus_used_why_excluded_and_an_expired_heartbeat() -> None:
    sim = _fleet()
    rows = views.node_rows(sim.state, sim.now + 5)
    text = render.nodes_table(rows)
    assert "1 used" in text
    assert "GPU 3: uncorrected ECC errors (2)" in text
    assert "5.0s" in text
    history.without_expired_heartbeats(rows, horizon=None)
    (line,) = render.nodes_table(rows).splitlines()[1:]
    assert "expired" in line.split()
    assert "5.0s" not in line


def test_a_retired_replicas_shard_phase_is_marked_retired() -> None:
    sim = _fleet()
    rows = views.replica_rows(sim.state)
    rows[0]["retired"] = True
    (line,) = render.replicas_table(rows).splitlines()[1:]
    assert "retired:" in line


def test_the_replay_header_counts_what_the_fold_refused_and_what_did_not_decode() -> None:
    bounds = history.Bounds(first_seq=1, last_seq=9, first_time=0, last_time=0, messages=9)
    rebuilt = history.Rebuilt(
        state=scenarios.Sim().state, target_seq=9, at=None, snapshot_seq=0, folded=9,
        elapsed_s=0.01, rejected=[(4, "no"), (5, "no")],
        skipped=[bus.Skipped(seq=6, subject="llmgw.events.node.x.heartbeat", time=0, error="bad")],
        bounds=bounds,
    )  # fmt: skip
    header = render.rebuilt_header(rebuilt)
    assert header.endswith("; 2 refused by the fold; 1 undecodable skipped")
    assert "from the beginning of the log + 9 events" in header

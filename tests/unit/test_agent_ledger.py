"""The command ledger: idempotence by generation, epochs, superseded starts, persistence."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.agent import ledger
from llmgw.agent.shards import ShardView
from llmgw.core import events
from llmgw.core.events import ShardPhase
from llmgw.core.profile import LaunchSpec

SPEC = LaunchSpec(engine="sim", model="m", served_name="m", port=20000, gpus=(0,))


def start(g: int, epoch: int = 1, rid: str = "r") -> events.StartShard:
    return events.StartShard(
        id=f"start-{rid}-{g}-{epoch}",
        ts=0.0,
        epoch=epoch,
        node="n",
        replica_id=rid,
        generation=g,
        launch=SPEC,
    )


def stop(g: int, epoch: int = 1, rid: str = "r") -> events.StopShard:
    return events.StopShard(
        id=f"stop-{rid}-{g}-{epoch}", ts=0.0, epoch=epoch, node="n", replica_id=rid, generation=g
    )


def drain(g: int) -> events.DrainShard:
    return events.DrainShard(id=f"drain-{g}", ts=0.0, node="n", replica_id="r", generation=g)


def view(g: int, phase: ShardPhase = "serving") -> ShardView:
    return ShardView(replica_id="r", generation=g, shard=0, phase=phase, gpus=(0,))


def test_start_once_per_generation() -> None:
    book = ledger.Ledger()
    assert ledger.decide(start(1), book, None).action == "start"
    assert ledger.decide(start(1), book, view(1)).action == "ignore"
    assert ledger.decide(start(1), book, view(2)).action == "ignore"
    assert ledger.decide(start(2), book, view(1)).action == "start"
    ledger.note_started(book, "r", 0, 2, now=1.0)
    # Gone (failed, forgotten) but already started: a re-sent start must not restart it.
    decision = ledger.decide(start(2), book, None)
    assert decision.action == "ignore"
    assert "already started" in decision.reason
    ledger.note_ended(book, "r", 0, 3, now=2.0)
    assert ledger.decide(start(3), book, None).action == "ignore"


def test_stop_only_the_generation_it_names_or_older() -> None:
    book = ledger.Ledger()
    assert ledger.decide(stop(1), book, view(1)).action == "stop"
    assert ledger.decide(stop(2), book, view(1)).action == "stop"
    stale = ledger.decide(stop(1), book, view(2))
    assert stale.action == "ignore"
    assert "stale" in stale.reason
    # Nothing runs: confirm it, once.
    assert ledger.decide(stop(1), book, None).action == "report_stopped"
    assert ledger.decide(stop(1), book, view(1, "failed")).action == "report_stopped"
    ledger.note_ended(book, "r", 0, 1, now=0.0)
    assert ledger.decide(stop(1), book, None).action == "ignore"


def test_drain_only_a_serving_shard_of_that_generation() -> None:
    book = ledger.Ledger()
    assert ledger.decide(drain(1), book, view(1)).action == "drain"
    assert ledger.decide(drain(1), book, view(1, "loading")).action == "ignore"
    assert ledger.decide(drain(1), book, view(2)).action == "ignore"
    assert ledger.decide(drain(1), book, None).action == "ignore"


def test_stale_epoch() -> None:
    assert ledger.stale_epoch(start(1, epoch=2), 3) == (
        "from leader epoch 2, older than the 3 already seen"
    )
    assert ledger.stale_epoch(start(1, epoch=3), 3) == ""
    assert ledger.stale_epoch(start(1, epoch=4), 3) == ""


def test_superseded_starts_in_a_backlog() -> None:
    assert ledger.superseded(start(1), [stop(1)], epoch=1)
    assert ledger.superseded(start(1), [start(2)], epoch=1)
    assert not ledger.superseded(start(2), [stop(1)], epoch=1)
    assert not ledger.superseded(start(1), [stop(1, rid="other")], epoch=1)
    # A deposed leader's stop does not cancel the current leader's start.
    assert not ledger.superseded(start(1, epoch=3), [stop(1, epoch=2)], epoch=3)
    assert not ledger.superseded(stop(1), [start(2)], epoch=1)


def test_successors_are_the_later_commands_on_the_same_shard() -> None:
    a1, other, a2, a3 = start(1), start(1, rid="o"), stop(1), start(2)
    hb = object()  # not a command: it has no successors and is none
    assert ledger.successors([a1, hb, other, a2, a3]) == [[a2, a3], [], [], [a3], []]


def test_persistence_and_corruption(tmp_path: Path) -> None:
    assert ledger.load(tmp_path) == ledger.Ledger()
    book = ledger.Ledger(last_seq=42, epoch=3)
    ledger.note_started(book, "r", 0, 2, now=5.0)
    ledger.save(tmp_path, book)
    loaded = ledger.load(tmp_path)
    assert loaded.last_seq == 42
    assert loaded.epoch == 3
    assert loaded.shards["r/0"].started == 2
    ledger.path_in(tmp_path).write_text("{broken")
    with pytest.raises(ledger.LedgerUnreadable, match="move it aside"):
        ledger.load(tmp_path)


def test_the_ledger_stays_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ledger, "MAX_SHARDS_KEPT", 3)
    book = ledger.Ledger()
    for i in range(5):
        ledger.note_started(book, f"r{i}", 0, 1, now=float(i))
    assert sorted(book.shards) == ["r2/0", "r3/0", "r4/0"]


commands = st.lists(
    st.tuples(st.sampled_from(["start", "stop"]), st.integers(1, 4), st.integers(1, 3)),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(cmds=commands)
def test_property_a_generation_starts_at_most_once_and_never_goes_back(
    cmds: list[tuple[str, int, int]],
) -> None:
    """Any order of starts and stops, redelivered at will, from any epoch: each generation is
    launched at most once, and never one older than a generation already launched."""
    book = ledger.Ledger()
    running: ShardView | None = None
    launched: list[int] = []
    for kind, g, epoch in cmds:
        cmd = start(g, epoch) if kind == "start" else stop(g, epoch)
        if ledger.stale_epoch(cmd, book.epoch):
            continue
        book.epoch = epoch
        action = ledger.decide(cmd, book, running).action
        if action == "start":
            if running is not None:
                ledger.note_ended(book, "r", 0, running.generation, now=0.0)
            running = view(g)
            launched.append(g)
            ledger.note_started(book, "r", 0, g, now=0.0)
        elif action == "stop":
            assert running is not None
            assert running.generation <= g
            ledger.note_ended(book, "r", 0, running.generation, now=0.0)
            running = None
        elif action == "report_stopped":
            ledger.note_ended(book, "r", 0, g, now=0.0)
    assert len(launched) == len(set(launched))
    assert launched == sorted(launched)


def test_a_start_repeated_later_in_a_backlog_does_not_supersede_it() -> None:
    """Commands arrive at least once: the same start twice in a backlog is one start, not
    a start undone by a later one (which the ledger would then ignore as already started:
    the shard would never start)."""
    assert not ledger.superseded(start(2), [start(2)], epoch=1)
    assert ledger.superseded(start(2), [start(3)], epoch=1)


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 6)), max_size=20))
def test_the_generations_noted_never_go_back(notes: list[tuple[bool, int]]) -> None:
    """A start or an end noted for an older generation (a superseded start, a stop of an
    old one) after a newer one must not lower what the ledger holds: a redelivered start of
    the newer generation would run it again."""
    book = ledger.Ledger()
    for started, g in notes:
        (ledger.note_started if started else ledger.note_ended)(book, "r", 0, g, now=0.0)
    entry = book.shards.get(ledger.key("r", 0), ledger.Applied())
    assert entry.started == max((g for s, g in notes if s), default=0)
    assert entry.ended == max((g for s, g in notes if not s), default=0)


def test_a_stop_older_than_the_start_it_follows_does_not_supersede_it() -> None:
    """A start from a newer leader than the ledger has seen yet, then a stop from the
    leader it deposed: the stop is stale against the start's own epoch, so the start runs."""
    assert not ledger.superseded(start(1, epoch=3), [stop(1, epoch=2)], epoch=1)
    assert ledger.superseded(start(1, epoch=3), [stop(1, epoch=3)], epoch=1)


def test_a_command_on_another_shard_of_the_replica_does_not_supersede_a_start() -> None:
    other_shard = events.StopShard(
        id="stop-r-1-shard1", ts=0.0, epoch=1, node="n", replica_id="r", generation=1, shard=1
    )
    assert not ledger.superseded(start(1), [other_shard], epoch=1)


@pytest.mark.parametrize("note", [ledger.note_started, ledger.note_ended])
def test_the_ledger_forgets_the_shard_untouched_longest_not_the_first_noted(
    monkeypatch: pytest.MonkeyPatch, note: Any
) -> None:
    """A shard noted again is fresh: the bound forgets by the clock of the last change,
    else a long-lived replica's entry goes first and its start could run again."""
    monkeypatch.setattr(ledger, "MAX_SHARDS_KEPT", 3)
    book = ledger.Ledger()
    for i, now in enumerate([1.0, 2.0, 3.0]):
        note(book, f"r{i}", 0, 1, now=now)
    note(book, "r0", 0, 2, now=4.0)  # r0 again: now the newest
    note(book, "r3", 0, 1, now=5.0)
    assert sorted(book.shards) == ["r0/0", "r2/0", "r3/0"]


def test_a_corrupt_ledger_is_moved_aside_whole_and_an_empty_one_starts(tmp_path: Path) -> None:
    ledger.path_in(tmp_path).write_text("{broken")
    book = ledger.load_or_set_aside(tmp_path, now=1234.9)
    assert book == ledger.Ledger()
    assert not ledger.path_in(tmp_path).exists()
    assert (tmp_path / "commands.json.corrupt-1234").read_text() == "{broken"


def test_a_save_the_disk_refuses_returns_false_and_leaves_no_partial_copy(
    tmp_path: Path,
) -> None:
    # The ledger's name taken by a folder with something in it: the rename fails.
    ledger.path_in(tmp_path).mkdir()
    (ledger.path_in(tmp_path) / "x").write_text("")
    book = ledger.Ledger(last_seq=7)
    assert ledger.save(tmp_path, book) is False
    assert sorted(p.name for p in tmp_path.iterdir()) == ["commands.json"]

"""Epochs the agent may obey: the leader lease's bound, and garbage in the ledger on disk."""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.agent import ledger
from llmgw.core import events


def stop(epoch: int) -> events.StopShard:
    return events.StopShard(id="c", ts=1.0, epoch=epoch, node="n", replica_id="r", generation=1)


def test_the_lease_value_gives_the_epoch() -> None:
    acquired = json.dumps({"holder": "control-1", "epoch": 0}).encode()
    renewed = json.dumps({"holder": "control-1", "epoch": 7}).encode()
    assert ledger.lease_epoch(7, acquired, {}) == 7
    assert ledger.lease_epoch(40, renewed, None) == 7
    assert ledger.lease_epoch(41, b"", {"KV-Operation": "DEL"}) is None
    assert ledger.lease_epoch(42, None, {"Nats-Marker-Reason": "MaxAge"}) is None
    assert ledger.lease_epoch(43, b"not json", {}) is None


@given(seq=st.integers(0, 2**64), data=st.one_of(st.none(), st.binary(max_size=64)))
def test_any_lease_entry_decodes_or_names_no_holder(seq: int, data: bytes | None) -> None:
    epoch = ledger.lease_epoch(seq, data, {})
    assert epoch is None or epoch > 0


def test_beyond_the_lease() -> None:
    assert ledger.beyond_lease(stop(5), 5) == ""
    assert ledger.beyond_lease(stop(4), 5) == ""
    assert "beyond the leader lease (epoch 5)" in ledger.beyond_lease(stop(10**12), 5)
    assert "no epoch yet" in ledger.beyond_lease(stop(1), 0)


@settings(max_examples=200, deadline=None)
@given(
    epoch=st.integers(-(2**63), 2**64 - 1),
    last_seq=st.integers(-(2**63), 2**64 - 1),
    generations=st.lists(st.tuples(st.integers(-(2**63), 2**63), st.integers(0, 2**60))),
)
def test_sanitize_leaves_only_what_a_real_ledger_holds(
    epoch: int, last_seq: int, generations: list[tuple[int, int]]
) -> None:
    kept = ledger.Ledger(
        epoch=epoch,
        last_seq=last_seq,
        shards={
            f"r{i}/0": ledger.Applied(started=s, ended=e) for i, (s, e) in enumerate(generations)
        },
    )
    problems = ledger.sanitize(kept)
    assert 0 <= kept.epoch <= ledger.MAX_EPOCH
    assert 0 <= kept.last_seq <= ledger.MAX_SEQ
    for entry in kept.shards.values():
        assert 0 <= entry.started <= ledger.MAX_GENERATION
        assert 0 <= entry.ended <= ledger.MAX_GENERATION
    changed = (kept.epoch != epoch) + (kept.last_seq != last_seq)
    assert len(problems) == changed + len(generations) - len(kept.shards)


def test_load_drops_garbage_and_keeps_the_rest(tmp_path: Path) -> None:
    good = ledger.Ledger(last_seq=12, epoch=3, shards={"r/0": ledger.Applied(started=2)})
    ledger.save(tmp_path, good)
    assert msgspec.json.encode(ledger.load(tmp_path)) == msgspec.json.encode(good)
    ledger.path_in(tmp_path).write_text(
        json.dumps({"last_seq": -5, "epoch": 2**62, "shards": {"r/0": {"started": 2**60}}})
    )
    loaded = ledger.load(tmp_path)
    assert (loaded.epoch, loaded.last_seq, loaded.shards) == (0, 0, {})


def test_a_lease_entry_with_no_positive_epoch_names_no_holder() -> None:
    # A value at sequence 0 (no stream has one) or one claiming a negative epoch: no
    # leader could have written it, and an epoch <= 0 would make every command "beyond".
    acquired = json.dumps({"holder": "control-1", "epoch": 0}).encode()
    negative = json.dumps({"holder": "control-1", "epoch": -3}).encode()
    assert ledger.lease_epoch(0, acquired, {}) is None
    assert ledger.lease_epoch(9, negative, {}) is None


@given(
    ended=st.integers(-(2**63), -1),
    updated=st.sampled_from([math.inf, -math.inf, math.nan]),
    which=st.sampled_from(["ended", "updated"]),
)
def test_sanitize_drops_a_negative_end_or_a_clock_that_is_no_number(
    ended: int, updated: float, which: str
) -> None:
    bad = (
        ledger.Applied(started=1, ended=ended)
        if which == "ended"
        else ledger.Applied(started=1, ended=1, updated=updated)
    )
    book = ledger.Ledger(shards={"bad/0": bad, "good/0": ledger.Applied(started=2, updated=5.0)})
    problems = ledger.sanitize(book)
    assert list(book.shards) == ["good/0"]
    assert len(problems) == 1
    assert "bad/0" in problems[0]

"""A router's KV feed folding records (llmgw.router.kvfeed): only a KV subject's node is
believed, refusals are logged once per interval per node with the count of those not
logged, and the index is swept every interval, at once after a cut-short pass or a
clock set back. Pure: records are handed to `KvFeed.apply`."""

from __future__ import annotations

import structlog

from llmgw.bus.intake import Record
from llmgw.core import kvindex, subjects
from llmgw.core.kvindex import KvIndex
from llmgw.router.config import LogSource
from llmgw.router.kvfeed import REFUSALS_LOGGED_EVERY_S, SWEEP_EVERY_S, KvFeed
from tests.unit.test_kvindex import upd

SOURCE = LogSource(servers=("nats://127.0.0.1:1",), name="r1")


def _record(seq: int, subject: str, endpoint: str = "e1") -> Record:
    event = upd(endpoint, 1, full=True, stored=[seq])
    return Record(seq=seq, subject=subject, time=0.0, event=event)  # type: ignore[arg-type]


def test_only_a_kv_subject_names_the_node_an_update_is_believed_of() -> None:
    feed = KvFeed(SOURCE, KvIndex())
    feed.apply([_record(1, "llmgw.events.node.n1.heartbeat"), _record(2, "llmgw.kv.n1")],
               now=1.0)  # fmt: skip
    assert feed.index.endpoints == {}
    feed.apply([_record(3, subjects.kv_updates("n1", "e1"))], now=1.0)
    assert set(feed.index.endpoints) == {("n1", "e1")}


def test_a_nodes_refusals_are_logged_once_an_interval_with_the_count_not_logged() -> None:
    feed = KvFeed(SOURCE, KvIndex(), listed=lambda _e, _n: False)
    cap = kvindex.MAX_UNLISTED_PER_NODE
    records = [_record(i, subjects.kv_updates("evil", f"x{i}"), f"x{i}") for i in range(cap + 4)]
    with structlog.testing.capture_logs() as logged:
        feed.apply(records, now=1.0)  # the last 4 are refused
        feed.apply([_record(999, subjects.kv_updates("evil", "y"), "y")], now=1.5)
        later = 1.0 + REFUSALS_LOGGED_EVERY_S
        feed.apply([_record(1000, subjects.kv_updates("evil", "z"), "z")], now=later)
    refused = [e for e in logged if e["event"] == "kv_update_refused"]
    assert [(e["node"], e["not_logged"]) for e in refused] == [("evil", 0), ("evil", 4)]
    assert feed.index.refused == 6


def test_the_index_is_swept_once_an_interval_and_at_once_after_the_clock_went_back() -> None:
    sweeps: list[float] = []
    feed = KvFeed(SOURCE, KvIndex(), listed=lambda _e, _n: True)
    real = feed.index.sweep

    def counted(listed, now, **kw):  # type: ignore[no-untyped-def]
        sweeps.append(now)
        return real(listed, now, **kw)

    feed.index.sweep = counted  # type: ignore[method-assign]
    start = 1000.0
    for t in (start, start + 1, start + 2, start + SWEEP_EVERY_S, start + SWEEP_EVERY_S + 1):
        feed.apply([], now=t)
    assert sweeps == [start, start + SWEEP_EVERY_S]
    feed.apply([], now=start - 60)  # the clock was set back a minute
    assert sweeps[-1] == start - 60


def test_a_refusal_after_the_clock_went_back_is_logged_at_once() -> None:
    """A clock set back an hour does not silence a node's refusals for that hour."""
    feed = KvFeed(SOURCE, KvIndex(), listed=lambda _e, _n: False)
    cap = kvindex.MAX_UNLISTED_PER_NODE
    records = [_record(i, subjects.kv_updates("evil", f"x{i}"), f"x{i}") for i in range(cap + 1)]
    with structlog.testing.capture_logs() as logged:
        feed.apply(records, now=5000.0)
        feed.apply([_record(999, subjects.kv_updates("evil", "y"), "y")], now=5000.0 - 3600)
    refused = [e for e in logged if e["event"] == "kv_update_refused"]
    assert [e["seq"] for e in refused] == [cap, 999]


def test_one_sweep_logs_one_line_per_node_counting_all_it_dropped_of_that_node() -> None:
    feed = KvFeed(SOURCE, KvIndex(), listed=lambda _e, _n: False)
    for node, endpoint, blocks in (("n2", "b", 3), ("n1", "z", 1), ("n1", "a", 2), ("n2", "c", 1)):
        update = upd(endpoint, 1, full=True, stored=list(range(blocks)))
        feed.index.apply(update, node, 0.0)
    with structlog.testing.capture_logs() as logged:
        feed.sweep(kvindex.UNLISTED_GRACE_S + 1)
    lines = [e for e in logged if e["event"] == "kv_unlisted_dropped"]
    got = [(e["node"], e["endpoints"], e["blocks"], e["first"]) for e in lines]
    assert got == [("n1", 2, 3, ["a", "z"]), ("n2", 2, 4, ["b", "c"])]
    assert not feed.index.endpoints

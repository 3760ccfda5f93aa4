"""The spool's files as an operator finds them (llmgw.router.spool): what a start logs, the
folder's and files' modes, names in the folder no router wrote, the size bound, a spool
with repeated entries, a disk that refuses writes for a while, the files of workers a
router no longer has, a FIFO some process feeds, and what a stop writes."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest
import structlog

from llmgw.router import spool as spool_module
from llmgw.router.quotas import FLUSH_S, Quotas
from llmgw.router.spool import (
    NOTHING,
    BudgetOwed,
    OwedSpool,
    Spooled,
    UsageOwed,
    decode,
    encode,
    keeping,
    spool_path,
)
from tests.unit.test_owed_spool import PERIOD, owing, spool_in


def _budget(tokens: int) -> BudgetOwed:
    return BudgetOwed(key="k", period=PERIOD, tokens=tokens)


def _held(folder: Path, worker: int = 0) -> Spooled:
    return decode(spool_path(folder, worker).read_bytes())


def test_a_start_without_a_spool_logs_nothing_and_one_with_a_spool_says_what_it_owes(
    tmp_path: Path,
) -> None:
    """A first start is no alarm; a start that owes a stopped process's charges says how
    many budgets and usage rows it took on."""
    spool = spool_in(str(tmp_path))
    with structlog.testing.capture_logs() as logged:
        assert spool.load(1) == NOTHING
    assert logged == []
    assert list(tmp_path.glob("owed-0.json*")) == []
    owed = owing({("k", PERIOD): (7, 0)}, {("k", "m"): (1, 2, 1), ("j", "m"): (3, 0, 1)})
    spool.keep(owed.owed_now())
    spool.close()

    again = spool_in(str(tmp_path))
    with structlog.testing.capture_logs() as logged:
        assert again.load(1) == owed.owed_now()
    again.close()
    assert [(e["event"], e["budgets"], e["usage"]) for e in logged] == [("owed_spool_loaded", 1, 2)]


def test_the_spool_folder_and_files_are_the_router_users_alone(tmp_path: Path) -> None:
    """What a router owes names keys: the folder it makes is 0700, its files 0600."""
    folder = tmp_path / "state" / "router"
    spool = spool_in(str(folder))
    spool.load(1)
    spool.keep(Spooled(budgets=(_budget(3),)))
    spool.close()
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for name in ("owed-0.json", "owed-0.lock"):
        assert stat.S_IMODE((folder / name).stat().st_mode) == 0o600, name


def test_a_request_that_used_no_tokens_is_still_owed_to_the_usage_counters(
    tmp_path: Path,
) -> None:
    """A request billed with no tokens in or out (an empty answer) counts in `requests`:
    the spool keeps the row."""
    owed = owing({}, {("k", "m"): (0, 0, 1)}).owed_now()
    assert owed.usage == (UsageOwed(key="k", model="m", requests=1),)
    spool = spool_in(str(tmp_path))
    spool.load(1)
    spool.keep(owed)
    spool.close()
    again = spool_in(str(tmp_path))
    assert again.load(1).usage == owed.usage
    again.close()


@pytest.mark.parametrize(
    "stray", ["owed-backup.json", "owed-.json", "owed-1a.json", "owed-\u00b2.json",
              "owed-\u0663.json", "owed--1.json"],
)  # fmt: skip
def test_a_file_in_the_folder_that_no_worker_writes_is_left_alone_and_the_router_starts(
    tmp_path: Path, stray: str
) -> None:
    """A copy an operator made, or any name that is not `owed-<worker number>.json`: worker
    0 neither takes it over nor fails to start on its name (a superscript two is a digit to
    Python's `isdigit`, yet no number to `int`)."""
    data = encode(Spooled(budgets=(_budget(9),)))
    (tmp_path / stray).write_bytes(data)
    spool = spool_in(str(tmp_path))
    spool.keep(Spooled(budgets=(_budget(2),)))
    spool.close()
    zero = spool_in(str(tmp_path))
    assert [b.tokens for b in zero.load(1).budgets] == [2]
    zero.close()
    assert (tmp_path / stray).read_bytes() == data


@pytest.mark.parametrize("size", ["bound", "one more", "huge"])
def test_a_spool_of_the_bound_is_read_and_a_larger_one_set_aside_unread_saying_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: str
) -> None:
    """At most one byte past the bound is read: a huge file (sparse here) is not loaded
    into the router's memory to be refused."""
    bound = 200
    monkeypatch.setattr(spool_module, "MAX_SPOOL_BYTES", bound)
    owed = Spooled(budgets=(_budget(3),))
    data = encode(owed)
    data += b" " * (bound - len(data) + (size != "bound"))  # valid JSON whatever its length
    path = spool_path(tmp_path, 0)
    path.write_bytes(data)
    if size == "huge":
        os.truncate(path, 256 * 1024 * 1024)
    spool = spool_in(str(tmp_path))
    with structlog.testing.capture_logs() as logged:
        loaded = spool.load(1)
    spool.close()
    if size == "bound":
        assert loaded == owed
        assert logged[0]["event"] == "owed_spool_loaded"
        return
    assert loaded == NOTHING
    (said,) = [e for e in logged if e["event"] == "owed_spool_unreadable"]
    assert said["error"] == f"{bound + 1} bytes, more than a router writes ({bound})"
    with open(said["moved_to"], "rb") as aside:  # kept for the operator
        assert aside.read(len(data)) == data


def test_a_spool_with_repeated_entries_keeps_what_is_still_owed_of_their_sum(
    tmp_path: Path,
) -> None:
    """A file holding one budget twice (3 and 4, written by hand) owes 7; once 2 of them
    are added, it holds 5, not each entry's 3 and 4 again (7 charged twice over)."""
    spool_path(tmp_path, 0).write_bytes(encode(Spooled(budgets=(_budget(3), _budget(4)))))
    spool = spool_in(str(tmp_path))
    assert spool.load(1) == Spooled(budgets=(_budget(7),))
    spool.settle(Spooled(budgets=(_budget(5),)))
    spool.close()
    assert _held(tmp_path) == Spooled(budgets=(_budget(5),))


def test_a_disk_that_refuses_is_logged_once_per_spell_and_each_write_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Full, then freed, then full again: one log line for each spell of refusals, and the
    first write after a spell writes what is owed, even when it is what was owed before."""
    real = spool_module.durable.replace
    full = True

    def disk(path: Path, data: bytes) -> None:
        if full:
            raise OSError(28, "No space left on device")
        real(path, data)

    monkeypatch.setattr(spool_module.durable, "replace", disk)
    spool = spool_in(str(tmp_path))
    spool.load(1)
    owed = [Spooled(budgets=(_budget(n),)) for n in (1, 2, 3, 4)]
    with structlog.testing.capture_logs() as logged:
        spool.keep(owed[0])
        spool.keep(owed[1])
        assert not spool_path(tmp_path, 0).exists()
        full = False
        spool.keep(owed[1])  # the same as the last refused: written now
        assert _held(tmp_path) == owed[1]
        full = True
        spool.keep(owed[2])
        spool.keep(owed[3])
    spool.close()
    said = [e for e in logged if e["event"] == "owed_spool_not_durable"]
    assert len(said) == 2
    assert all("No space left" in e["error"] for e in said)
    assert _held(tmp_path) == owed[1]  # what the disk took last


def test_a_spool_written_again_after_it_was_paid_holds_what_is_owed(tmp_path: Path) -> None:
    """Paid, the file goes; a later outage owing the very same amounts writes it again."""
    spool = spool_in(str(tmp_path))
    spool.load(1)
    owed = Spooled(budgets=(_budget(3),))
    spool.keep(owed)
    spool.keep(NOTHING)
    assert not spool_path(tmp_path, 0).exists()
    spool.keep(owed)
    assert _held(tmp_path) == owed
    spool.settle(NOTHING)
    assert not spool_path(tmp_path, 0).exists()
    spool.close()


def test_only_worker_0_takes_over_files_and_it_sums_their_usage_and_frees_their_locks(
    tmp_path: Path,
) -> None:
    """Started with 2 workers after 3: worker 1, whichever starts first, owes only its own;
    worker 0 owes its own and worker 2's usage summed, and holds no lock of worker 2's, so
    that a router started with 3 workers again has a worker 2."""
    for worker, counts in ((0, (1, 2, 1)), (1, (5, 5, 5)), (2, (10, 20, 2))):
        spool = spool_in(str(tmp_path), worker)
        spool.keep(owing({}, {("k", "m"): counts}).owed_now())
        spool.close()
    one = spool_in(str(tmp_path), 1)
    assert one.load(2).usage == (UsageOwed(key="k", model="m", tokens_in=5, tokens_out=5,
                                           requests=5),)  # fmt: skip
    assert spool_path(tmp_path, 2).exists()
    zero = spool_in(str(tmp_path), 0)
    want = (UsageOwed(key="k", model="m", tokens_in=11, tokens_out=22, requests=3),)
    assert zero.load(2).usage == want
    assert _held(tmp_path).usage == want
    assert not spool_path(tmp_path, 2).exists()
    two = OwedSpool.open(str(tmp_path), 2)
    assert two is not None, "worker 0 still holds the lock of a file it took over"
    for spool in (zero, one, two):
        spool.close()


@pytest.mark.parametrize("fed", [b"", encode(Spooled(budgets=(_budget(9),)))])
def test_a_fifo_another_process_holds_open_is_set_aside_not_read_as_a_spool(
    tmp_path: Path, fed: bytes
) -> None:
    """A FIFO with a writer: its bytes are whatever that writer sends, a valid spool or
    nothing yet (a read that would wait), neither a file the router wrote."""
    path = spool_path(tmp_path, 0)
    os.mkfifo(path)
    writer = os.open(path, os.O_RDWR)  # a writer that keeps it open
    try:
        os.write(writer, fed)
        spool = spool_in(str(tmp_path))
        with structlog.testing.capture_logs() as logged:
            assert spool.load(1) == NOTHING
        spool.close()
    finally:
        os.close(writer)
    (said,) = [e for e in logged if e["event"] == "owed_spool_unreadable"]
    assert said["error"].startswith("not a regular file")
    assert not path.exists()


async def test_a_router_stopped_within_a_turn_of_its_last_charge_keeps_it_on_disk(
    tmp_path: Path,
) -> None:
    """The spool is written every `FLUSH_S` while the counters do not answer; a stop cancels
    that writer, so what was charged since its last write is written by the stop itself."""
    quotas = Quotas()  # no counters: unreached
    quotas.spool = spool = spool_in(str(tmp_path))
    spool.load(1)
    quotas._spooler = asyncio.create_task(
        keeping(spool, quotas.owed_now, quotas.unreached, quotas._stop, FLUSH_S)
    )
    quotas.owe("k", PERIOD, 7, 1)
    await quotas.close()
    assert _held(tmp_path) == Spooled(budgets=(_budget(7),))


def test_a_file_whose_worker_still_runs_is_not_taken_over(tmp_path: Path) -> None:
    """Started with 1 worker while worker 2 of the router before it still runs (stopping):
    that file is that process's to pay; worker 0 owes only its own."""
    two = spool_in(str(tmp_path), 2)
    two.load(3)
    two.keep(Spooled(budgets=(_budget(11),)))
    zero = spool_in(str(tmp_path), 0)
    assert zero.load(1) == NOTHING
    zero.close()
    two.close()
    assert _held(tmp_path, 2) == Spooled(budgets=(_budget(11),))


def test_a_charge_made_while_the_counters_answer_never_enters_the_file(tmp_path: Path) -> None:
    """The file held 3 of a budget (and some usage); the key spent 7 more since, which the
    flusher adds within a turn: a kill after that add must not find the 7 in the file, to be
    added again by the next process. The file only shrinks while the counters answer."""

    def used(tokens_in: int, tokens_out: int, requests: int) -> UsageOwed:
        return UsageOwed(key="k", model="m", tokens_in=tokens_in, tokens_out=tokens_out,
                         requests=requests)  # fmt: skip

    spool = spool_in(str(tmp_path))
    spool.load(1)
    held = Spooled(budgets=(_budget(3),), usage=(used(1, 2, 1),))
    spool.keep(held)
    spool.settle(Spooled(budgets=(_budget(10),), usage=(used(5, 6, 3),)))
    assert _held(tmp_path) == held
    spool.settle(Spooled(budgets=(_budget(2),), usage=(used(1, 1, 1),)))
    assert _held(tmp_path) == Spooled(budgets=(_budget(2),), usage=(used(1, 1, 1),))
    spool.close()


def test_a_paid_file_the_disk_would_not_remove_is_removed_at_the_next_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All of it added, but the removal fails once: the file still holds paid charges, so
    the next turn removes it rather than leave them for the next process to add again."""
    real = spool_module.durable.remove
    refusals = [OSError(5, "Input/output error")]

    def disk(path: Path) -> None:
        if refusals:
            raise refusals.pop()
        real(path)

    monkeypatch.setattr(spool_module.durable, "remove", disk)
    spool = spool_in(str(tmp_path))
    spool.load(1)
    spool.keep(Spooled(budgets=(_budget(3),)))
    spool.settle(NOTHING)  # paid; the removal refused
    assert spool_path(tmp_path, 0).exists()
    spool.settle(NOTHING)
    assert not spool_path(tmp_path, 0).exists()
    spool.close()


def _taken_over_while_the_disk_refuses(folder: Path, monkeypatch: pytest.MonkeyPatch) -> OwedSpool:
    """Worker 0, started with 1 worker after 3, takes over worker 2's spool (11 tokens;
    its own holds 5) while its disk refuses writes: 16 owed, in memory."""
    for worker, tokens in ((0, 5), (2, 11)):
        spool = spool_in(str(folder), worker)
        spool.keep(Spooled(budgets=(_budget(tokens),)))
        spool.close()
    write = spool_module.durable.replace

    def refused(path: Path, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(spool_module.durable, "replace", refused)
    zero = spool_in(str(folder), 0)
    assert [b.tokens for b in zero.load(1).budgets] == [16]
    assert _held(folder, 2).budgets == (_budget(11),)  # kept for the next start meanwhile
    monkeypatch.setattr(spool_module.durable, "replace", write)
    return zero


def _next_start_owes(folder: Path) -> list[int]:
    spool = spool_in(str(folder), 0)
    try:
        return [b.tokens for b in spool.load(1).budgets]
    finally:
        spool.close()


def test_a_taken_over_spool_the_counters_paid_is_removed_and_never_charged_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The merged file could not be written, so worker 2's file stayed; once the counters
    had its debt (a flusher turn that left nothing owed), it goes: the next start owes
    nothing rather than its 11 tokens a second time."""
    zero = _taken_over_while_the_disk_refuses(tmp_path, monkeypatch)
    zero.settle(NOTHING)
    zero.close()
    assert not spool_path(tmp_path, 2).exists()
    assert not spool_path(tmp_path, 0).exists()
    assert _next_start_owes(tmp_path) == []


def test_a_taken_over_spool_goes_once_the_takers_file_holds_its_debt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk writes again during the outage: worker 0's file holds all 16 owed, and
    worker 2's file goes, so the next start owes 16, not 27."""
    zero = _taken_over_while_the_disk_refuses(tmp_path, monkeypatch)
    zero.keep(Spooled(budgets=(_budget(16),)))
    zero.close()
    assert not spool_path(tmp_path, 2).exists()
    assert _next_start_owes(tmp_path) == [16]


def test_a_turn_that_paid_part_of_a_taken_over_debt_keeps_only_the_rest_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The counters took 10 of the 16 tokens: what the files held that is still owed (6)
    is worker 0's file, and worker 2's goes; a turn whose write the disk refuses keeps it."""
    zero = _taken_over_while_the_disk_refuses(tmp_path, monkeypatch)
    write = spool_module.durable.replace

    def refused(path: Path, data: bytes) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(spool_module.durable, "replace", refused)
    zero.settle(Spooled(budgets=(_budget(6),)))
    assert _held(tmp_path, 2).budgets == (_budget(11),)
    monkeypatch.setattr(spool_module.durable, "replace", write)
    zero.settle(Spooled(budgets=(_budget(6),)))
    zero.close()
    assert not spool_path(tmp_path, 2).exists()
    assert _next_start_owes(tmp_path) == [6]


def test_spools_set_aside_within_one_second_are_each_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three unreadable spools set aside in the same second (starts that fail one after
    another) are three files for the operator to inspect, not the last one alone."""
    monkeypatch.setattr(spool_module.time, "time", lambda: 1_790_000_000.5)
    path = spool_path(tmp_path, 0)
    for i in range(3):
        path.write_bytes(b"not a spool %d" % i)
        spool = spool_in(str(tmp_path))
        assert spool.load(1) == NOTHING
        spool.close()
    kept = sorted(p.read_bytes() for p in tmp_path.glob("owed-0.json.bad-1790000000*"))
    assert kept == [b"not a spool 0", b"not a spool 1", b"not a spool 2"]

"""The leader lease's bound on the epochs an agent obeys (llmgw.agent.lease_bound), with a
lease the test sets: a command beyond every epoch a live lease has shown is refused,
counted and never raises the ledger; one within it, or for another node, is admitted;
an epoch on disk above the live lease's is cut down to it and saved."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw import bus
from llmgw.agent import lease_bound, ledger
from llmgw.agent.lease_bound import LeaseBound
from llmgw.bus.lease import Holder
from llmgw.core import events


class Lease:
    """The leader lease as an agent reads it: `epochs` answered in turn (the last again)."""

    def __init__(self, *epochs: int | None) -> None:
        self.epochs = list(epochs)
        self.reads = 0

    async def holder(self) -> Holder | None:
        self.reads += 1
        epoch = self.epochs[min(self.reads, len(self.epochs)) - 1]
        return None if epoch is None else Holder(holder="control-a", epoch=epoch, revision=1)


def command(epoch: int, node: str = "n1") -> bus.Record:
    cmd = events.StopShard(id="c", ts=1.0, epoch=epoch, node=node, replica_id="r", generation=1)
    return bus.Record(seq=9, subject=f"llmgw.cmd.{node}", time=1.0, event=cmd)


@pytest.fixture(autouse=True)
def no_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lease_bound, "LEASE_REREAD_S", 0.0)


def admits(bound: LeaseBound, lease: Lease, book: ledger.Ledger, record: bus.Record) -> bool:
    return asyncio.run(bound.admits(lease, book, record))


@settings(max_examples=100, deadline=None)
@given(lease_epoch=st.integers(1, 10**6), ahead=st.integers(-5, 10**12))
def test_a_command_is_obeyed_exactly_when_a_live_lease_has_shown_its_epoch(
    tmp_path_factory: pytest.TempPathFactory, lease_epoch: int, ahead: int
) -> None:
    epoch = max(1, lease_epoch + ahead)
    bound = LeaseBound("n1", tmp_path_factory.mktemp("agent"))
    book = ledger.Ledger()
    admitted = admits(bound, Lease(lease_epoch), book, command(epoch))
    assert admitted == (epoch <= lease_epoch)
    assert bound.refused == (0 if admitted else 1)
    assert bound.epoch == lease_epoch
    assert book.epoch == 0, "what the lease bound decides never raises the ledger"


def test_a_new_leaders_first_command_is_obeyed_once_a_read_of_the_lease_shows_it(
    tmp_path: Path,
) -> None:
    """A replica answering the first reads may lag the new leader's acquisition."""
    bound = LeaseBound("n1", tmp_path)
    lease = Lease(3, 3, 4)
    assert admits(bound, lease, ledger.Ledger(), command(4))
    assert (lease.reads, bound.epoch, bound.refused) == (3, 4, 0)


def test_without_a_live_leader_no_epoch_is_obeyed_beyond_the_highest_seen(tmp_path: Path) -> None:
    bound = LeaseBound("n1", tmp_path)
    book = ledger.Ledger()
    assert admits(bound, Lease(5), book, command(5))
    assert not admits(bound, Lease(None), book, command(6))
    assert admits(bound, Lease(None), book, command(5))
    assert bound.epoch == 5


def test_another_nodes_command_is_not_this_bounds_to_judge(tmp_path: Path) -> None:
    lease = Lease(1)
    assert admits(LeaseBound("n1", tmp_path), lease, ledger.Ledger(), command(10**12, "n2"))
    assert lease.reads == 0


def test_an_epoch_on_disk_beyond_the_live_lease_is_cut_to_it_and_saved(tmp_path: Path) -> None:
    book = ledger.Ledger(epoch=10**12)
    ledger.save(tmp_path, book)
    bound = LeaseBound("n1", tmp_path)
    assert admits(bound, Lease(7), book, command(7))
    assert book.epoch == 7
    assert ledger.load(tmp_path).epoch == 7


def test_a_lagging_read_of_the_lease_never_lowers_the_epoch_obeyed(tmp_path: Path) -> None:
    """A replica answering a read may still show the previous leader's epoch: the new
    leader's commands, once its epoch was seen, stay obeyed."""
    bound = LeaseBound("n1", tmp_path)
    book = ledger.Ledger()
    assert admits(bound, Lease(4), book, command(4))
    assert admits(bound, Lease(3), book, command(5)) is False  # reads 3: nothing seen beyond 4
    assert bound.epoch == 4
    assert admits(bound, Lease(3), book, command(4))


def test_a_command_within_the_epoch_seen_reads_no_lease(tmp_path: Path) -> None:
    """The lease is read for a command beyond what was seen, not for every command."""
    bound = LeaseBound("n1", tmp_path)
    assert admits(bound, Lease(6), ledger.Ledger(), command(6))
    quiet = Lease(6)
    assert admits(bound, quiet, ledger.Ledger(), command(6))
    assert admits(bound, quiet, ledger.Ledger(), command(2))
    assert quiet.reads == 0


class Slept:
    """asyncio.sleep, recording each wait asked for and not waiting it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.waits: list[float] = []
        self._sleep = asyncio.sleep
        monkeypatch.setattr(asyncio, "sleep", self)

    async def __call__(self, delay: float) -> None:
        self.waits.append(delay)
        await self._sleep(0)


class UnreadableLease(Lease):
    """A lease whose first `failures` reads raise, as a server that is away."""

    def __init__(self, failures: int, epoch: int) -> None:
        super().__init__(epoch)
        self.failures = failures

    async def holder(self) -> Holder | None:
        if self.failures:
            self.failures -= 1
            raise OSError("no responders")
        return await super().holder()


def test_rereads_of_a_lagging_lease_wait_longer_each_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lease_bound, "LEASE_REREAD_S", 0.25)
    slept = Slept(monkeypatch)
    assert admits(LeaseBound("n1", tmp_path), Lease(3, 3, 4), ledger.Ledger(), command(4))
    assert slept.waits == [0.25, 0.5]


def test_an_unreadable_lease_is_read_again_backing_off_as_each_retry_line_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slept = Slept(monkeypatch)
    bound, lease = LeaseBound("n1", tmp_path), UnreadableLease(8, 5)
    with structlog.testing.capture_logs() as logged:
        assert admits(bound, lease, ledger.Ledger(), command(5))
    said = [e["retry_in_s"] for e in logged if e["event"] == "lease_unreadable"]
    assert said == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0]
    assert slept.waits == said
    assert bound.epoch == 5

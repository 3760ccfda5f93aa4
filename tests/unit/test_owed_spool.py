"""What a router owes the fleet's counters, kept on disk (llmgw.router.spool): a router
stopped or killed while the counters cannot be reached pays it when it starts again, and
no spool file, whatever its bytes, stops a router from starting."""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace

import msgspec
import nats.errors
import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.bus.counters import CounterError
from llmgw.core import subjects, tenancy
from llmgw.core.limits import MAX_COUNTER, MAX_TIME
from llmgw.router import spool as spool_module
from llmgw.router.config import AuthConfig, RouterConfig, validate
from llmgw.router.holds import AnsweredCounters, Held
from llmgw.router.quotas import Quotas
from llmgw.router.spool import (
    NOTHING,
    BudgetOwed,
    OwedSpool,
    Spooled,
    SpoolUnreadable,
    decode,
    encode,
    keeping,
    merged,
    spool_path,
    still_owed,
)
from tests.unit.test_quotas import Store, key

WALL = 1e9
PERIOD = tenancy.period_of(WALL, "day")

key_names = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,63}", fullmatch=True)
periods = st.builds(tenancy.period_of, st.floats(0, MAX_TIME), st.sampled_from(["day", "month"]))
amounts = st.integers(0, 2 * MAX_COUNTER)
budgets = st.dictionaries(st.tuples(key_names, periods), st.tuples(amounts, amounts), max_size=8)
usage = st.dictionaries(
    st.tuples(key_names, st.text(max_size=40)), st.tuples(amounts, amounts, amounts), max_size=8
)


Budgets = dict[tuple[str, str], tuple[int, int]]
Usage = dict[tuple[str, str], tuple[int, int, int]]


def owing(budgets: Budgets, usage: Usage) -> Quotas:
    """A router owing each budget (amount, on its way) and each (key, model)'s usage."""
    q = Quotas()
    for (name, period), (amount, paying) in budgets.items():
        q.owe(name, period, paying, 1)
        if paying:
            q._owed[(name, period)].take()  # an add under way when it stopped
        q.owe(name, period, amount, 1)
    for (name, model), counts in usage.items():
        q.usage.add(name, model, counts)
    q.owe("windowed", "", 5, 10)  # a window's: not spooled (llmgw.router.spool)
    return q


def spool_in(folder: str, worker: int = 0) -> OwedSpool:
    spool = OwedSpool.open(folder, worker)
    assert spool is not None
    return spool


@settings(max_examples=150, deadline=None)
@given(budgets, usage)
def test_any_owed_state_is_read_back_whole_by_the_next_process(
    owed_budgets: Budgets, owed_usage: Usage
) -> None:
    before = owing(owed_budgets, owed_usage)
    with tempfile.TemporaryDirectory() as folder:
        first = spool_in(folder)
        first.load(1)
        first.keep(before.owed_now())
        first.close()  # stopped, or killed: the file stays

        after = Quotas()
        second = spool_in(folder)
        after.restore(second.load(1))
        second.close()
    bound = MAX_COUNTER
    want_budgets = {(k, p): min(a + b, bound) for (k, p), (a, b) in owed_budgets.items() if a + b}
    got_budgets = {(b.key, b.period): b.tokens for b in after.owed_now().budgets}
    assert got_budgets == want_budgets
    want_usage = {
        where: tuple(min(n, bound) for n in counts)
        for where, counts in owed_usage.items()
        if any(counts)
    }
    got_usage = {(u.key, u.model): (u.tokens_in, u.tokens_out, u.requests)
                 for u in after.owed_now().usage}  # fmt: skip
    assert got_usage == want_usage
    assert after.owes("windowed", "") == 0


@settings(max_examples=300, deadline=None)
@given(st.one_of(
    st.binary(max_size=300),
    st.builds(lambda doc: msgspec.json.encode(doc), st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
            st.sampled_from(["version", "budgets", "usage", "key", "period", "tokens",
                             "model", "tokens_in", "requests"]), inner, max_size=4),
        max_leaves=20)),
))  # fmt: skip
def test_no_bytes_in_a_spool_file_raise_out_of_the_loader(data: bytes) -> None:
    """Whatever the file holds, the loader returns: what it holds when it is a spool, else
    nothing, the file set aside as it was."""
    try:
        want: Spooled | None = merged([decode(data)])
    except SpoolUnreadable:
        want = None
    with tempfile.TemporaryDirectory() as folder:
        spool_path(Path(folder), 0).write_bytes(data)
        spool = spool_in(folder)
        loaded = spool.load(1)
        spool.close()
        aside = list(Path(folder).glob("owed-0.json.bad-*"))
        if want is None:
            assert loaded == NOTHING
            assert [p.read_bytes() for p in aside] == [data]
        else:
            assert loaded == want
            assert not aside


@pytest.mark.parametrize(
    "doc",
    [
        b'{"budgets": [{"key": "k", "period": "d20261202", "tokens": 1e400}]}',
        b'{"budgets": [{"key": "k", "period": "d20261202", "tokens": 9007199254740993}]}',
        b'{"budgets": [{"key": "k", "period": "d20261202", "tokens": -5}]}',
        b'{"budgets": [{"key": "k", "period": "d20261202", "tokens": "12"}]}',
        b'{"budgets": [{"key": "k\\u001b[2J", "period": "d20261202", "tokens": 12}]}',
        b'{"budgets": [{"key": "k", "period": "d2026\\n", "tokens": 12}]}',
        b'{"usage": [{"key": "k", "model": "m", "requests": 1, "admin": true}]}',
        b'{"version": 2}',
        b'{"budgets": [{"key": "k", "period": "d20261202", "tok',
        b"[" * 100_000,
    ],
)
def test_a_hostile_spool_is_set_aside_and_said_so_and_the_router_starts(
    tmp_path: Path, doc: bytes
) -> None:
    path = spool_path(tmp_path, 0)
    path.write_bytes(doc)
    spool = spool_in(str(tmp_path))
    with structlog.testing.capture_logs() as logged:
        assert spool.load(1) == NOTHING
    spool.close()
    (said,) = [e for e in logged if e["event"] == "owed_spool_unreadable"]
    assert said["file"] == str(path)
    assert said["moved_to"].startswith(str(path) + ".bad-")
    assert "inspect it" in said["advice"]
    assert Path(said["moved_to"]).read_bytes() == doc  # kept for the operator
    assert not path.exists()


def test_a_router_stopped_in_an_outage_pays_its_budget_when_the_next_one_starts(
    tmp_path: Path,
) -> None:
    """A router spends of its share while the counters are down and stops; the next
    process in its place owes what the spool held, and its flusher adds it."""
    store = Store()
    store.totals[subjects.budget_counter("k", PERIOD)] = 100  # read before the outage
    p = key(budget_tokens=1000)

    async def outage() -> int:
        q = Quotas(store)  # type: ignore[arg-type]
        q.processes = 2
        assert (await q.hold(p, 50, WALL, 0.0)) is not None
        store.down = True
        q.counters = None
        held = await q.hold(p, 200, WALL, 0.0)
        assert isinstance(held, Held)
        q.usage.used(p, "m", 150, 90)
        q.ended(p, "m", 200, (150, 90), held)  # 240 used of a hold of 200
        spool = spool_in(str(tmp_path))
        spool.load(1)
        spool.keep(q.owed_now())  # the router stops: what it owes, on disk
        spool.close()
        return q.owes("k", PERIOD)

    owed = asyncio.run(outage())
    assert owed > 0

    async def restarted() -> None:
        store.down = False
        q = Quotas(store)  # type: ignore[arg-type]
        q.clock = lambda: WALL
        spool = spool_in(str(tmp_path))
        q.restore(spool.load(1))
        await q.pay_owed(WALL)
        spool.settle(q.owed_now())  # a turn that added the budget's charges, not the usage
        assert [u.model for u in decode(spool_path(tmp_path, 0).read_bytes()).usage] == ["m"]
        await q._flush_usage()
        spool.settle(q.owed_now())
        spool.close()

    before = store.totals[subjects.budget_counter("k", PERIOD)]
    asyncio.run(restarted())
    assert store.totals[subjects.budget_counter("k", PERIOD)] == before + owed
    hour = int(WALL // 3600)
    assert store.totals[subjects.usage_counter("k", hour, "m", "in")] == 150
    assert store.totals[subjects.usage_counter("k", hour, "m", "req")] == 1
    assert not spool_path(tmp_path, 0).exists()  # paid: nothing is added twice


def test_a_second_router_on_the_same_folder_runs_without_a_spool_and_says_so(
    tmp_path: Path,
) -> None:
    first = spool_in(str(tmp_path))
    with structlog.testing.capture_logs() as logged:
        assert OwedSpool.open(str(tmp_path), 0) is None
    assert [e["event"] for e in logged] == ["owed_spool_taken"]
    assert "its own state_dir" in logged[0]["advice"]
    first.close()
    spool_in(str(tmp_path)).close()  # free once the first one stopped


def test_a_folder_the_router_cannot_write_is_said_and_the_router_runs(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    with structlog.testing.capture_logs() as logged:
        assert OwedSpool.open(str(blocked / "state"), 0) is None
    assert [e["event"] for e in logged] == ["owed_spool_unavailable"]
    assert "state_dir" in logged[0]["advice"]


def test_worker_0_takes_over_the_spools_of_workers_a_router_no_longer_has(
    tmp_path: Path,
) -> None:
    """Started with 2 workers after 3: worker 2's spool is no process's; worker 0 owes it."""
    for worker, tokens in ((0, 5), (1, 7), (2, 11)):
        spool = spool_in(str(tmp_path), worker)
        spool.keep(Spooled(budgets=(_budget(tokens),)))
        spool.close()
    zero, one = spool_in(str(tmp_path), 0), spool_in(str(tmp_path), 1)
    assert [b.tokens for b in zero.load(2).budgets] == [16]
    assert [b.tokens for b in one.load(2).budgets] == [7]
    assert not spool_path(tmp_path, 2).exists()
    assert [b.tokens for b in decode(spool_path(tmp_path, 0).read_bytes()).budgets] == [16]
    zero.close()
    one.close()


def test_spools_taken_over_stay_on_disk_while_the_takers_own_cannot_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Worker 0 takes over worker 2's spool but its disk refuses to write the merged file:
    worker 2's file stays where it is, for the next start, rather than its debt living only
    in this process's memory."""
    for worker, tokens in ((0, 5), (2, 11)):
        spool = spool_in(str(tmp_path), worker)
        spool.keep(Spooled(budgets=(_budget(tokens),)))
        spool.close()

    def refused(path: Path, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(spool_module.durable, "replace", refused)
    zero = spool_in(str(tmp_path), 0)
    assert [b.tokens for b in zero.load(1).budgets] == [16]  # owed, in memory
    zero.close()
    assert [b.tokens for b in decode(spool_path(tmp_path, 2).read_bytes()).budgets] == [11]


def _budget(tokens: int) -> BudgetOwed:
    return BudgetOwed(key="k", period=PERIOD, tokens=tokens)


def test_a_spool_is_written_only_when_what_is_owed_changed_and_removed_once_paid(
    tmp_path: Path,
) -> None:
    spool = spool_in(str(tmp_path))
    spool.load(1)
    path = spool_path(tmp_path, 0)
    spool.keep(NOTHING)
    assert not path.exists()
    owed = Spooled(budgets=(_budget(3),))
    spool.keep(owed)
    assert decode(path.read_bytes()) == owed
    path.write_bytes(b"touched")  # an unchanged state is not written again
    spool.keep(owed)
    assert path.read_bytes() == b"touched"
    spool.paid()
    assert not path.exists()
    spool.close()


def test_an_empty_state_dir_is_refused_saying_what_to_give() -> None:
    cfg = RouterConfig(state_dir=" ", auth=AuthConfig(allow_anonymous=True))
    (problem,) = validate(cfg)
    assert "state_dir is empty: give a folder the router may write" in problem


@settings(max_examples=100, deadline=None)
@given(budgets, usage, budgets, usage)
def test_a_turn_the_counters_answered_leaves_in_the_file_only_what_it_held_still_owed(
    held_budgets: Budgets, held_usage: Usage, now_budgets: Budgets, now_usage: Usage
) -> None:
    """What a file holds only shrinks while the counters answer: nothing charged since
    enters it, and what was added leaves it; all of it paid, it goes."""
    held, now = owing(held_budgets, held_usage).owed_now(), owing(now_budgets, now_usage).owed_now()
    left = still_owed(held, now)
    amounts = {("b", b.key, b.period): b.tokens for b in now.budgets}
    amounts |= {("u", u.key, u.model): (u.tokens_in, u.tokens_out, u.requests) for u in now.usage}
    for b in left.budgets:
        assert b.tokens <= min(amounts[("b", b.key, b.period)], _held_tokens(held, b))
    for u in left.usage:
        now_counts = amounts[("u", u.key, u.model)]
        assert isinstance(now_counts, tuple)
        counts = (u.tokens_in, u.tokens_out, u.requests)
        assert all(n <= m for n, m in zip(counts, now_counts, strict=True))
    assert still_owed(held, held) == held
    assert still_owed(held, NOTHING) == NOTHING


def _held_tokens(held: Spooled, b: BudgetOwed) -> int:
    return next(h.tokens for h in held.budgets if (h.key, h.period) == (b.key, b.period))


async def test_the_spool_is_written_only_while_the_counters_do_not_answer(tmp_path: Path) -> None:
    spool = spool_in(str(tmp_path))
    spool.load(1)
    owed = Spooled(budgets=(_budget(3),))
    stop, asked = asyncio.Event(), asyncio.Event()

    def owed_now() -> Spooled:
        asked.set()
        return owed

    answering = True
    kept = asyncio.create_task(keeping(spool, owed_now, lambda: not answering, stop, 0.001))
    for _ in range(20):
        await asyncio.sleep(0.002)
    assert not asked.is_set()
    assert not spool_path(tmp_path, 0).exists()
    answering = False
    await asyncio.wait_for(asked.wait(), 30)
    stop.set()
    await kept
    assert decode(spool_path(tmp_path, 0).read_bytes()) == owed
    spool.settle(NOTHING)  # all of it added since
    assert not spool_path(tmp_path, 0).exists()
    spool.close()


async def test_the_spool_writes_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write is fsynced: on a slow disk it takes long, and the router's loop relays every
    stream meanwhile. The disk here lets a write finish only once the loop has run on
    (were the write on the loop, it would wait out the whole 30 s and fail the test)."""
    spool = spool_in(str(tmp_path))
    spool.load(1)
    writing, loop_ran = threading.Event(), threading.Event()
    real = spool_module.durable.replace

    def slow_disk(path: Path, data: bytes) -> None:
        writing.set()
        assert loop_ran.wait(30), "the event loop did not run while the spool wrote"
        real(path, data)

    monkeypatch.setattr(spool_module.durable, "replace", slow_disk)
    stop = asyncio.Event()
    owed = Spooled(budgets=(_budget(3),))
    kept = asyncio.create_task(keeping(spool, lambda: owed, lambda: True, stop, 0.001))
    assert await asyncio.to_thread(writing.wait, 30)
    loop_ran.set()  # the loop runs while the write waits
    stop.set()
    await kept  # (it ends after the write it began)
    assert decode(spool_path(tmp_path, 0).read_bytes()) == owed
    spool.close()


@pytest.mark.parametrize("kind", ["fifo", "link", "folder"])
def test_a_spool_that_is_no_file_of_its_own_is_set_aside_without_waiting_on_it(
    tmp_path: Path, kind: str
) -> None:
    """A FIFO would block the router's start on open; a link points where the router
    never wrote; a folder is no file."""
    path = spool_path(tmp_path, 0)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link":
        (tmp_path / "elsewhere").write_bytes(encode(Spooled(budgets=(_budget(3),))))
        path.symlink_to(tmp_path / "elsewhere")
    else:
        path.mkdir()
    spool = spool_in(str(tmp_path))
    with structlog.testing.capture_logs() as logged:
        assert spool.load(1) == NOTHING
    spool.close()
    assert [e["event"] for e in logged] == ["owed_spool_unreadable"]
    assert not path.exists()


async def test_the_counters_are_unreached_from_an_add_they_do_not_answer_to_one_they_do() -> None:
    """A turn of the flusher with nothing to add asks nothing: only adds tell whether the
    counters answer, so that an outage is seen whatever is owed."""

    class Server:
        down = False

        async def request(self, subject: str, payload: bytes, **_: object) -> SimpleNamespace:
            if self.down:
                raise nats.errors.TimeoutError
            return SimpleNamespace(data=b'{"val": "5"}')

    server = Server()
    q = Quotas()
    assert q.unreached()  # no connection yet
    q.counters = AnsweredCounters(server)  # type: ignore[arg-type]
    assert not q.unreached()
    server.down = True
    with pytest.raises(CounterError):
        await q.counters.add("llmgw.usage.k.b.d20261202", 0)
    assert q.unreached()
    server.down = False
    assert await q.counters.add("llmgw.usage.k.b.d20261202", 0) == 5
    assert not q.unreached()


async def test_a_router_closed_owing_a_budget_leaves_it_on_disk(tmp_path: Path) -> None:
    """What the flusher's last turn could not add stays in the spool when the router stops,
    for the next process in its place to pay."""
    q = Quotas()
    spool = spool_in(str(tmp_path))
    q.restore(spool.load(1))
    q.spool = spool
    q.owe("k", PERIOD, 42, 1000)
    await q.close()
    assert decode(spool_path(tmp_path, 0).read_bytes()) == Spooled(budgets=(_budget(42),))


async def test_a_flusher_turn_that_paid_the_spool_takes_it_off_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stopped process's spool, paid by the next one's flusher while it runs: the file goes
    then, not only when this router stops (a router killed later would pay it again)."""
    stopped = spool_in(str(tmp_path))
    stopped.load(1)
    stopped.keep(Spooled(budgets=(_budget(7),)))
    stopped.close()
    path = spool_path(tmp_path, 0)
    assert path.exists()
    store = Store()
    q = Quotas(store)  # type: ignore[arg-type]
    q.clock = lambda: WALL
    spool = spool_in(str(tmp_path))
    q.restore(spool.load(1))
    q.spool = spool
    settled = threading.Event()
    settle = spool.settle

    def settling(owed: Spooled) -> None:
        settle(owed)
        if owed == NOTHING:
            settled.set()

    monkeypatch.setattr(spool, "settle", settling)
    flusher = asyncio.create_task(q.flush_until_stopped())
    assert await asyncio.to_thread(settled.wait, 30)  # a turn that added all it owed
    gone = not path.exists()
    await q.close()
    await flusher
    assert gone
    assert store.totals[subjects.budget_counter("k", PERIOD)] == 7

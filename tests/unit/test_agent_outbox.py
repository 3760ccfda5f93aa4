"""The agent's on-disk outbox: order, durability across reopen, bounds, and damaged files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import structlog.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.agent.outbox import Outbox
from llmgw.core import events


def status(i: int, phase: str = "serving") -> events.ShardStatus:
    return events.ShardStatus(
        id=f"s{i}", ts=float(i), node="n", replica_id=f"r{i}", generation=1, phase=phase
    )


def registered(i: int) -> events.NodeRegistered:
    return events.NodeRegistered(id=f"g{i}", ts=float(i), node="n", address="n")


def heartbeat(i: int) -> events.Heartbeat:
    return events.Heartbeat(id=f"h{i}", ts=float(i), node="n", seq=i)


def ids(box: Outbox) -> list[str]:
    return [e.event.id for e in box]


def drain(box: Outbox, count: int) -> None:
    for _ in range(count):
        head = box.peek()
        assert head is not None
        box.delivered(head.n)


def test_fifo_and_reopen_keeps_only_what_was_not_acknowledged(tmp_path: Path) -> None:
    box = Outbox(tmp_path)
    for i in range(5):
        box.put(status(i), ttl_s=None if i else 30.0)
    assert box.peek() is not None
    assert box.peek().ttl_s == 30.0  # type: ignore[union-attr]
    drain(box, 2)
    box.close()
    again = Outbox(tmp_path)
    assert ids(again) == ["s2", "s3", "s4"]
    # Numbers continue after the highest ever used: a new entry never hides behind the cursor.
    entry = again.put(status(9))
    assert entry.n == 6
    drain(again, 4)
    assert len(again) == 0
    assert (tmp_path / "pending.jsonl").stat().st_size == 0
    again.close()
    assert ids(Outbox(tmp_path)) == []


def test_delivered_must_be_the_head(tmp_path: Path) -> None:
    box = Outbox(tmp_path)
    box.put(status(1))
    second = box.put(status(2))
    with pytest.raises(ValueError, match="not the head"):
        box.delivered(second.n)


def test_a_torn_last_line_is_dropped_and_appends_start_clean(tmp_path: Path) -> None:
    box = Outbox(tmp_path)
    box.put(status(1))
    box.put(status(2))
    box.close()
    with open(tmp_path / "pending.jsonl", "ab") as f:
        f.write(b'{"n":3,"ttl_s":null,"event":{"type":"node.sh')  # a crash mid-write
    again = Outbox(tmp_path)
    assert again.unreadable == 1
    again.put(status(4))
    again.close()
    assert ids(Outbox(tmp_path)) == ["s1", "s2", "s4"]


def test_bounds_drop_heartbeats_then_superseded_registrations_never_statuses(
    tmp_path: Path,
) -> None:
    box = Outbox(tmp_path, max_events=4)
    box.put(registered(1))
    box.put(heartbeat(1))
    box.put(status(1))
    box.put(registered(2))
    box.put(status(2))  # 5 > 4: the heartbeat goes
    assert ids(box) == ["g1", "s1", "g2", "s2"]
    box.put(status(3))  # the older registration goes; the newest stays
    assert ids(box) == ["s1", "g2", "s2", "s3"]
    box.put(status(4))  # nothing droppable left: statuses are kept over the bound
    assert ids(box) == ["s1", "g2", "s2", "s3", "s4"]
    assert box.dropped == 2
    box.close()
    assert ids(Outbox(tmp_path)) == ["s1", "g2", "s2", "s3", "s4"]


def test_byte_bound(tmp_path: Path) -> None:
    box = Outbox(tmp_path, max_bytes=600)
    for i in range(10):
        box.put(heartbeat(i))
    assert 0 < box.size_bytes <= 600
    assert ids(box)[-1] == "h9"


def test_garbage_files_never_stop_an_agent_from_starting(tmp_path: Path) -> None:
    (tmp_path / "pending.jsonl").write_bytes(b"\x00\xff garbage\n{}\n[1,2]\n" + b"x" * 1000)
    (tmp_path / "cursor").write_text("not a number")
    box = Outbox(tmp_path)
    assert len(box) == 0
    assert box.unreadable == 4
    box.put(status(1))
    assert ids(box) == ["s1"]


Op = tuple[str, int]
ops = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(["status", "registered", "heartbeat"]), st.integers(0, 10**6)),
        st.tuples(st.just("deliver"), st.integers(1, 3)),
        st.tuples(st.just("reopen"), st.just(0)),
    ),
    max_size=60,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=ops, bound=st.integers(1, 8))
def test_property_order_kept_statuses_never_lost(
    tmp_path_factory: pytest.TempPathFactory, ops: list[Op], bound: int
) -> None:
    """Whatever puts, acknowledgements and restarts happen: what is delivered comes out in
    the order it was put, at most once, and every ShardStatus is delivered or still pending."""
    folder = tmp_path_factory.mktemp("outbox")
    box = Outbox(folder, max_events=bound)
    put: list[str] = []
    delivered: list[str] = []
    made = {"status": status, "registered": registered, "heartbeat": heartbeat}
    for i, (op, arg) in enumerate(ops):
        if op == "deliver":
            for _ in range(arg):
                head = box.peek()
                if head is None:
                    break
                delivered.append(head.event.id)
                box.delivered(head.n)
        elif op == "reopen":
            box.close()
            box = Outbox(folder, max_events=bound)
        else:
            event = made[op](i)
            put.append(event.id)
            box.put(event)
        # What the byte bound counts is what the pending entries take on disk.
        assert box.size_bytes == sum(len(Outbox._line(e)) for e in box)
    pending = ids(box)
    out = delivered + pending
    assert len(out) == len(set(out)), "nothing twice"
    positions = [put.index(x) for x in out]
    assert positions == sorted(positions), "in the order put"
    statuses = [x for x in put if x.startswith("s")]
    assert [x for x in out if x.startswith("s")] == statuses, "no status lost"
    if len(box) > bound:
        # Over the bound only when nothing droppable is left.
        kinds = [x[0] for x in pending]
        assert "h" not in kinds
        assert kinds.count("g") <= 1


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(junk=st.binary(max_size=400), cursor=st.binary(max_size=20))
def test_property_any_bytes_on_disk_open_cleanly(
    tmp_path_factory: pytest.TempPathFactory, junk: bytes, cursor: bytes
) -> None:
    """Whatever a crash or a disk left in the files, the outbox opens, keeps the readable
    entries written before the damage, and appends after it."""
    folder = tmp_path_factory.mktemp("junk")
    box = Outbox(folder)
    box.put(status(1))
    box.close()
    with open(folder / "pending.jsonl", "ab") as f:
        f.write(junk)
    (folder / "cursor").write_bytes(cursor)
    again = Outbox(folder)
    again.put(status(2))
    again.close()
    kept = ids(Outbox(folder))
    assert kept[-1] == "s2"
    assert set(kept) <= {"s1", "s2"}


class SyncSpy:
    """Records what each fsync made durable, by the path behind its descriptor."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.synced: list[str] = []
        for name in ("fsync", "fdatasync"):
            real = getattr(os, name, None)
            if real is not None:
                monkeypatch.setattr(os, name, self._wrap(real))

    def _wrap(self, real: Callable[[int], None]) -> Callable[[int], None]:
        def sync(fd: int) -> None:
            self.synced.append(os.readlink(f"/proc/self/fd/{fd}"))
            real(fd)

        return sync

    def count(self, path: Path) -> int:
        return self.synced.count(str(path))


def test_a_put_is_fsynced_before_it_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: nothing was fsynced, so a power loss could take back a recorded transition
    that NATS, fsyncing every acknowledgement, would otherwise have kept."""
    box = Outbox(tmp_path / "outbox")
    spy = SyncSpy(monkeypatch)
    box.put(status(1, "failed"))
    assert spy.count(tmp_path / "outbox" / "pending.jsonl") == 1
    # A batch is one fsync, not one per entry.
    box.put_many([(status(i), None) for i in range(2, 102)])
    assert spy.count(tmp_path / "outbox" / "pending.jsonl") == 2
    assert ids(box) == [f"s{i}" for i in range(1, 102)]
    assert box.put_many([]) == []
    assert spy.count(tmp_path / "outbox" / "pending.jsonl") == 2


def test_a_rewrite_is_durable_before_and_after_its_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "outbox"
    spy = SyncSpy(monkeypatch)
    box = Outbox(folder, max_events=3)
    # Opening rewrites the file (tmp, then rename): both the new file and the folder.
    assert spy.synced[-2:] == [str(folder / "pending.tmp"), str(folder)]
    assert str(tmp_path) in spy.synced  # the new folder's own name
    spy.synced.clear()
    for i in range(3):
        box.put(status(i))
    box.put(heartbeat(9))  # over the bound: the heartbeat is dropped, the file compacted
    assert ids(box) == ["s0", "s1", "s2"]
    assert spy.synced[-2:] == [str(folder / "pending.tmp"), str(folder)]
    box.put(status(3))
    # Appends after a compaction go to the renamed file, and are fsynced there.
    assert spy.synced[-1] == str(folder / "pending.jsonl")
    box.close()
    assert ids(Outbox(folder, max_events=10)) == ["s0", "s1", "s2", "s3"]


def test_put_stays_fast_with_fsync(tmp_path: Path) -> None:
    """One fsync per batch keeps a burst of transitions cheap (generous bound for CI disks)."""
    box = Outbox(tmp_path)
    started = time.perf_counter()
    box.put_many([(status(i), None) for i in range(1000)])
    assert time.perf_counter() - started < 5.0
    assert len(box) == 1000


# A full disk, for real: RLIMIT_FSIZE makes the kernel refuse to grow any file past a size
# (a short write, then EFBIG), as a full disk does (ENOSPC). In a child process, so that
# nothing else the test run writes meets the limit.
FULL_DISK = """
import json, os, resource, signal, sys
from llmgw.agent.outbox import Outbox
from llmgw.core import events

def status(i):
    return events.ShardStatus(
        id=f"s{i}", ts=float(i), node="n", replica_id=f"r{i}", generation=1, phase="serving"
    )

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills instead of refusing
folder, limit, first, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
then = sys.argv[5]
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
box = Outbox(folder)
for i in range(first, last):
    box.put(status(i))
print(json.dumps({"full": [e.event.id for e in box]}), flush=True)
print(json.dumps({"copy_left": os.path.exists(os.path.join(folder, "pending.tmp"))}), flush=True)
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
if then == "put":
    box.put(status(last))  # the disk takes writes again: the whole file is rewritten
elif then == "deliver":
    box.delivered(box.peek().n)  # or the next acknowledgement rewrites it
else:
    while box.peek() is not None:  # or every entry is acknowledged: the file starts over
        box.delivered(box.peek().n)
print(json.dumps({"freed": [e.event.id for e in box]}), flush=True)
"""


def on_full_disk(
    folder: Path, limit: int, first: int, last: int, then: str = "put"
) -> tuple[list[str], str]:
    """Put statuses s<first>..s<last - 1> with files limited to `limit` bytes, then one
    more (or, `then="deliver"`, acknowledge the head) once the limit is gone; the ids in
    memory at each step, and the output."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(folder), str(limit), str(first), str(last), then],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(root)},
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    found = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return [i for step in found for i in step.get("full", [])], done.stdout + done.stderr


def test_a_full_disk_loses_no_event_and_says_so(tmp_path: Path) -> None:
    """Before: the put that met the full disk half-wrote its line and returned as if it
    were durable (the next start dropped it as torn), and the next one raised, so the
    shard's transition was lost (the supervisor's callback only logs)."""
    kept, out = on_full_disk(tmp_path, 1500, 0, 20)
    assert kept == [f"s{i}" for i in range(20)]
    assert out.count("outbox_not_durable") == 1  # said once, not at every put that follows
    assert '{"copy_left": false}' in out  # a failed rewrite takes no room it did not have
    assert "free space" in out
    assert "outbox_durable_again" in out
    again = Outbox(tmp_path)
    assert ids(again) == [f"s{i}" for i in range(21)]
    assert again.unreadable == 0


def test_an_agent_starts_on_a_full_disk(tmp_path: Path) -> None:
    """Before: opening rewrote the file first, failed on the full disk, and so stopped the
    agent at every restart."""
    box = Outbox(tmp_path)
    box.put_many([(status(i), None) for i in range(20)])
    box.close()
    with open(tmp_path / "pending.jsonl", "ab") as f:
        f.write(b'{"n":99,"event":{"ty')  # and a torn last line, from a crash mid-write
    size = (tmp_path / "pending.jsonl").stat().st_size
    kept, out = on_full_disk(tmp_path, size - 100, 20, 22)
    assert kept == [f"s{i}" for i in range(22)]
    assert "outbox_not_durable" in out
    assert ids(Outbox(tmp_path)) == [f"s{i}" for i in range(23)]


def test_an_acknowledgement_after_the_disk_frees_makes_the_outbox_durable_again(
    tmp_path: Path,
) -> None:
    """Before: only the next put rewrote the file; acknowledgements left it without the
    entries the full disk refused, so a stop before the next transition lost them."""
    kept, out = on_full_disk(tmp_path, 1500, 0, 20, then="deliver")
    assert kept == [f"s{i}" for i in range(20)]
    assert "outbox_durable_again" in out
    assert ids(Outbox(tmp_path)) == [f"s{i}" for i in range(1, 20)]


@pytest.mark.parametrize(("max_events", "max_bytes"), [(0, 1024), (10, 0), (-1, -1)])
def test_an_outbox_without_room_is_refused_with_what_it_needs(
    tmp_path: Path, max_events: int, max_bytes: int
) -> None:
    with pytest.raises(ValueError, match="max_events >= 1 and max_bytes >= 1"):
        Outbox(tmp_path, max_events=max_events, max_bytes=max_bytes)


def test_a_put_the_disk_takes_only_in_part_is_not_durable_and_says_so(tmp_path: Path) -> None:
    """A short write (the disk filled mid-line) is a failed write: the next put must not
    append after the torn line, which would make both entries unreadable on the next start."""
    kept, out = on_full_disk(tmp_path, 60, 0, 1)
    assert kept == ["s0"]
    assert "outbox_not_durable" in out
    again = Outbox(tmp_path)
    assert ids(again) == ["s0", "s1"]
    assert again.unreadable == 0


def test_an_outbox_emptied_after_a_full_disk_says_it_is_durable_again(tmp_path: Path) -> None:
    """The one entry the full disk refused is acknowledged: the file, emptied, holds exactly
    what is pending, and the outbox says so instead of staying "not durable"."""
    kept, out = on_full_disk(tmp_path, 60, 0, 1, then="deliver all")
    assert kept == ["s0"]
    assert out.index("outbox_not_durable") < out.index("outbox_durable_again")
    assert ids(Outbox(tmp_path)) == []


def test_a_cursor_that_cannot_be_saved_is_said_once_per_outage(tmp_path: Path) -> None:
    box = Outbox(tmp_path)
    box.put_many([(status(i), None) for i in range(4)])
    blocker = tmp_path / "cursor.tmp"
    with structlog.testing.capture_logs() as logged:
        blocker.mkdir()  # the cursor's temporary name is taken: its write fails
        drain(box, 2)
        blocker.rmdir()
        drain(box, 1)  # saved again
        blocker.mkdir()
        drain(box, 1)
    said = [e for e in logged if e["event"] == "outbox_cursor_not_saved"]
    assert len(said) == 2
    assert ids(box) == []

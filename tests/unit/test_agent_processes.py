"""Process identity from /proc, engine log tails, and pid files that survive bad input."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from llmgw import pidfiles, processes
from llmgw.agent import logtail
from llmgw.core import events, limits
from llmgw.core.redaction import KEY_MARK as MARK


def test_fingerprint_survives_a_command_name_with_parentheses(tmp_path: Path) -> None:
    # /proc/<pid>/stat puts the command name in parentheses; a name holding ") (" must
    # not shift the fields, or the start time would be read from the wrong column.
    tricky = tmp_path / "engine) (x"
    tricky.symlink_to("/bin/sleep")
    proc = subprocess.Popen([str(tricky), "30"], start_new_session=True)
    try:
        fp = processes.fingerprint(proc.pid)
        assert fp is not None
        assert fp.cmdline == (str(tricky), "30")
        assert fp.start_time > 0
        assert fp.boot_id
        assert processes.mismatch(fp) == ""
        assert processes.group_members(proc.pid) == [proc.pid]
        other = processes.Fingerprint(
            pid=proc.pid, start_time=fp.start_time, boot_id="another-boot", cmdline=fp.cmdline
        )
        assert "rebooted" in processes.mismatch(other)
    finally:
        proc.kill()
        proc.wait()
    assert "is not running" in processes.mismatch(fp)
    assert processes.fingerprint(proc.pid) is None
    assert processes.signal_group(proc.pid, processes.signal.SIGTERM) is False


def test_fingerprint_rereads_a_command_line_caught_mid_exec(monkeypatch: Any) -> None:
    # Right after Popen returns, the kernel may not have laid out the new process's
    # arguments yet: /proc/<pid>/cmdline reads empty for a moment. Recording that would
    # make the agent refuse to adopt its own engine after a restart.
    real = processes.cmdline
    reads = []

    def racing(pid: int) -> tuple[str, ...] | None:
        reads.append(pid)
        return () if len(reads) < 3 else real(pid)

    monkeypatch.setattr(processes, "cmdline", racing)
    fp = processes.fingerprint(os.getpid())
    assert fp is not None
    assert fp.cmdline == real(os.getpid())
    assert fp.cmdline
    assert len(reads) == 3


def test_tail_reads_the_last_lines_only(tmp_path: Path) -> None:
    path = tmp_path / "engine.log"
    path.write_text("".join(f"line {i}\n" for i in range(200_000)) + "partial")
    assert logtail.tail(path, 3) == ("line 199998", "line 199999", "partial")
    assert len(logtail.tail(path, 100)) == 100
    assert logtail.tail(tmp_path / "missing.log", 5) == ()


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.text(min_size=1, max_size=20_000).filter(str.strip), max_size=40),
    st.integers(1, 2000),
)
def test_a_tail_always_fits_one_event_the_readers_accept(lines: list[str], count: int) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "engine.log"
        path.write_text(
            "".join(line.replace("\n", " ").replace("\r", " ") + "\n" for line in lines)
        )
        got = logtail.tail(path, count)
    event = events.ShardStatus(
        id="i", ts=1.0, node="n", replica_id="r", generation=1, phase="failed", log_tail=got
    )
    data = events.encode(event)
    assert events.decode(data) == event
    assert len(data) < 512 * 1024


def test_trim_keeps_the_end_and_the_engine_keeps_appending(tmp_path: Path) -> None:
    path = tmp_path / "engine.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)  # as the engine holds it
    try:
        os.write(fd, b"".join(b"x" * 99 + b"\n" for _ in range(1000)))
        assert logtail.trim(path, max_bytes=50_000, keep_bytes=1000)
        os.write(fd, b"after trim\n")
    finally:
        os.close(fd)
    assert path.stat().st_size < 2000
    assert logtail.tail(path, 1) == ("after trim",)
    assert not logtail.trim(path, max_bytes=50_000, keep_bytes=1000)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=300))
def test_a_corrupt_pid_file_is_reported_not_fatal(data: bytes) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "shards"
        folder.mkdir()
        (folder / "bad.0.json").write_bytes(data)
        ((path, record),) = pidfiles.load_all(Path(tmp))
        assert path.name == "bad.0.json"
        assert record is None


def test_pid_file_names_are_safe(tmp_path: Path) -> None:
    assert pidfiles.path_for(tmp_path, "../../etc/x", 1).parent == tmp_path / "shards"


def test_a_tail_without_a_line_end_in_reach_keeps_the_end_of_that_line(tmp_path: Path) -> None:
    # An engine that printed one line longer than what the tail reads (here 200 KB
    # without a newline) and then died: its last words were reported as nothing.
    path = tmp_path / "engine.log"
    for end in ("", "\n", "\r\n\n"):
        path.write_text("started\n" + "x" * 200_000 + "CUDA error: out of memory" + end)
        (line,) = logtail.tail(path, 20)
        assert line.startswith("…")
        assert line.endswith("CUDA error: out of memory")
        assert len(line) <= logtail.MAX_LINE_CHARS


def test_a_tail_shows_a_progress_bar_as_a_terminal_would(tmp_path: Path) -> None:
    # tqdm (vLLM's and SGLang's weight loading) rewrites one line with carriage returns.
    path = tmp_path / "engine.log"
    bar = "".join(f"\rLoading safetensors: {p}%" for p in range(0, 101, 5))
    path.write_text(f"start\n{bar}\rLoading safetensors: 100%\r   \nTraceback: boom\n")
    assert logtail.tail(path, 5) == ("start", "Loading safetensors: 100%", "Traceback: boom")


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=300))
def test_shown_is_one_rewrite_of_the_line(line: str) -> None:
    got = logtail.shown(line)
    assert "\r" not in got
    assert got in line.split("\r") or not got
    assert bool(got.strip()) == bool(line.replace("\r", "").strip())


_KEY_CHARS = "ABCDEFGHJKLMNPQRSTUVWXYZ"
"""A key's alphabet, which the rest of the generated output never uses."""


def _near(at: int) -> st.SearchStrategy[int]:
    return st.integers(max(0, at - 70), at + 5)


_CUT = logtail.MAX_LINE_CHARS - 1
"""Where a long line is cut: its first `_CUT` characters kept, or (the last line, longer
than what the tail reads) its last."""
_READ = 64 * 1024
"""How much of a short tail's end is read (logtail._CHUNK)."""


@settings(max_examples=150, deadline=None)
@given(
    key=st.text(_KEY_CHARS, min_size=8, max_size=64),
    before=st.one_of(_near(_CUT), st.integers(0, 70_000)),
    after=st.one_of(_near(_CUT), _near(_READ), st.integers(0, 5_000)),
    lines=st.sampled_from(["", "\n", "\r"]),
    count=st.integers(1, 300),
)
def test_no_part_of_the_engines_key_leaves_in_a_tail(
    key: str, before: int, after: int, lines: str, count: int
) -> None:
    # The key lands across each place the tail cuts (a long line's end, the last line's
    # start, the start of what is read): redacting after those cuts left the part of a key
    # the cut did not take.
    import tempfile

    text = "x" * before + key + "y" * after + lines + "z" * (before % 7)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "engine.log"
        path.write_text(text)
        got = logtail.tail(path, count, key)
    shown = "".join(got)
    assert not set(shown) & set(_KEY_CHARS), shown[:200]


def test_a_tail_says_where_the_key_was(tmp_path: Path) -> None:
    path = tmp_path / "engine.log"
    key = "SECRETKEY" * 4
    path.write_text("x" * 70_000 + key + "y" * 10 + "\nusing key " + key + "\n")
    assert logtail.tail(path, 5, key) == (f"using key {MARK}",)
    # A chunk that starts inside the key (the file's last 64 KiB begin 5 characters into
    # it): the key is read whole.
    path.write_text("a" * 10 + key + "b" * (64 * 1024 - len(key) + 5))
    (line,) = logtail.tail(path, 1, key)  # read from the file's start: the line is whole
    assert line == ("a" * 10 + MARK + "b" * 5000)[: logtail.MAX_LINE_CHARS - 1] + "…"
    # A long last line whose kept end (its last MAX_LINE_CHARS - 1) starts inside the key.
    path.write_text("a" * 70_000 + key + "b" * (logtail.MAX_LINE_CHARS - 6))
    (line,) = logtail.tail(path, 1, key)
    assert line == "…" + MARK[-5:] + "b" * (logtail.MAX_LINE_CHARS - 6)
    # The end of a key is not the key (this one repeats no start of itself): kept.
    key = "0123456789abcdefghijklmnopqrstuv"
    path.write_text("a\n" + key[5:] + "tail\n")
    assert logtail.tail(path, 5, key) == ("a", key[5:] + "tail")


@settings(max_examples=100, deadline=None)
@given(
    key=st.text(_KEY_CHARS, min_size=8, max_size=64),
    into=st.integers(1, 63),
    blank=st.sampled_from([" ", "\n", "\r \r\n", "\t"]),
    before=st.integers(0, 100),
)
def test_no_part_of_a_key_cut_where_the_read_begins_leaves_before_blank_output(
    key: str, into: int, blank: str, before: int
) -> None:
    # The read begins a key's length before the last 64 KiB (so that a key the 64 KiB
    # would cut is read whole), and there it may cut an earlier key: when all that follows
    # that first line is blank (cleared progress bars), the first line was kept, the part
    # of the key in it too.
    import tempfile

    into %= len(key)
    head = "x" * before + key + "\n"
    # The file's last 64 KiB and the key's length before them begin `into` characters
    # into the key: what follows its line is 64 KiB + len(key) - into - 1 bytes.
    fill = _READ + len(key) - into - 1
    text = head + (blank * (fill // len(blank) + 1))[:fill]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "engine.log"
        path.write_text(text)
        got = logtail.tail(path, 5, key)
    assert not set("".join(got)) & set(_KEY_CHARS), got


def test_a_tail_read_from_the_files_start_keeps_its_first_line(tmp_path: Path) -> None:
    # Reading the key's length before the nominal start reached the file's first byte:
    # the first line was whole, yet dropped as if cut.
    path = tmp_path / "engine.log"
    path.write_text("first line\n" + "x" * (64 * 1024 - 5) + "\nlast\n")
    assert logtail.tail(path, 5, "K" * 32) == ("first line", "x" * 4095 + "…", "last")
    assert logtail.tail(path, 5) == ("last",)  # no key, no margin: the cut line is dropped


@settings(max_examples=60, deadline=None)
@given(
    key=st.text(_KEY_CHARS, min_size=8, max_size=64),
    before=st.integers(0, 3000),
    newline_after=st.booleans(),
    keep=st.integers(200, 2000),
)
def test_a_trimmed_log_keeps_no_part_of_a_key_at_its_start(
    key: str, before: int, newline_after: bool, keep: int
) -> None:
    # trim keeps the file's last bytes from wherever they start: inside a key, its end
    # was kept, which a tail reading the whole trimmed file showed.
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "engine.log"
        for shift in range(len(key) + 1):
            tail_text = "y" * (keep - shift) + ("\nend\n" if newline_after else "")
            path.write_text("x" * before + "\n" + "w" * 5000 + key + tail_text)
            assert logtail.trim(path, 1000, keep + len("\nend\n") * newline_after, key)
            shown = "".join(logtail.tail(path, 10_000, key))
            assert not set(shown) & set(_KEY_CHARS), (shift, shown[:100])


def test_a_tail_line_is_cut_only_past_the_bound_and_says_so() -> None:
    at_bound = "a" * logtail.MAX_LINE_CHARS
    past = "b" * (logtail.MAX_LINE_CHARS + 1)
    assert logtail.bounded((at_bound,)) == (at_bound,)
    (cut,) = logtail.bounded((past,))
    assert cut == "b" * (logtail.MAX_LINE_CHARS - 1) + "…"


def test_a_tail_keeps_no_more_lines_than_an_event_carries() -> None:
    lines = tuple(f"l{i}" for i in range(limits.MAX_LOG_LINES + 50))
    assert logtail.bounded(lines) == lines[-limits.MAX_LOG_LINES :]


_WIDE = st.tuples(st.sampled_from(["a", "é", "€", "𝄞"]), st.integers(1, 5000))


def _cut(line: str) -> str:
    limit = logtail.MAX_LINE_CHARS
    return line if len(line) <= limit else line[: limit - 1] + "…"


@settings(max_examples=60, deadline=None)
@given(st.lists(_WIDE, max_size=120))
@example([("€", 4000)] * 70)  # fits in characters, three times over in bytes
def test_a_bounded_tail_is_the_longest_end_of_the_output_that_fits_in_bytes(
    spans: list[tuple[str, int]],
) -> None:
    """The bound is on bytes (what NATS and the readers count), not characters, and what
    is kept is the end of the output without a gap: the last lines that fit."""
    lines = tuple(_cut(char * n) for char, n in spans)
    got = logtail.bounded(lines)
    assert got == (lines[len(lines) - len(got) :] if got else ())
    cost = sum(len(line.encode()) + 8 for line in got)
    assert cost <= logtail.MAX_TAIL_BYTES
    if len(got) < len(lines):  # the next older line would not have fitted
        assert cost + len(lines[-len(got) - 1].encode()) + 8 > logtail.MAX_TAIL_BYTES


def test_a_trimmed_log_starts_with_the_note_then_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "engine.log"
    path.write_bytes(b"".join(b"line %04d " % i + b"x" * 89 + b"\n" for i in range(100)))
    exactly = path.stat().st_size
    assert not logtail.trim(path, max_bytes=exactly, keep_bytes=1000)  # at the bound: kept
    assert path.stat().st_size == exactly
    assert logtail.trim(path, max_bytes=exactly - 1, keep_bytes=1050)
    kept = path.read_bytes().split(b"\n")
    assert kept[0] == b"[llmgw: earlier output trimmed]"
    assert kept[1].startswith(b"line 0090 ")  # the first whole line within the last 1050 bytes
    assert kept[-2].startswith(b"line 0099 ")


def test_a_long_tail_reads_far_enough_back_for_the_lines_asked(tmp_path: Path) -> None:
    path = tmp_path / "engine.log"
    path.write_text("".join(f"line {i:05d} " + "x" * 200 + "\n" for i in range(5000)))
    got = logtail.tail(path, 1000)
    assert len(got) == 1000
    assert got[0].startswith("line 04000 ")

"""Files replaced whole (llmgw.durable): a reader finds the old contents or the new, never
a mix; a write the disk refuses leaves the old file and no temporary copy; a replaced file
is its owner's alone, whatever a leftover temporary file allowed."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw import durable

# A child whose files may grow to 100 bytes, the way a full disk refuses: the write fails
# with EFBIG (SIGXFSZ ignored, as it would otherwise kill the child).
_REFUSED = """
import resource, signal, sys
from pathlib import Path
from llmgw import durable
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100))
try:
    durable.replace(Path(sys.argv[1]), b"n" * 1000)
except OSError as exc:
    print("refused", exc.errno)
else:
    print("written")
"""


def test_a_write_the_disk_refuses_raises_and_leaves_the_old_file_and_no_copy(
    tmp_path: Path,
) -> None:
    path = tmp_path / "owed.json"
    durable.replace(path, b"old contents")
    out = subprocess.run(
        [sys.executable, "-c", _REFUSED, str(path)], capture_output=True, text=True, timeout=60
    )
    assert out.stdout.split()[0] == "refused", out.stdout + out.stderr
    assert path.read_bytes() == b"old contents"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["owed.json"]


def test_a_leftover_longer_copy_leaves_nothing_of_itself_in_the_new_file(tmp_path: Path) -> None:
    path = tmp_path / "state"
    path.with_name("state.tmp").write_bytes(b"x" * 4096)  # a crash before the rename
    durable.replace(path, b"short")
    assert path.read_bytes() == b"short"
    assert not path.with_name("state.tmp").exists()


def test_the_replaced_file_is_the_owners_alone_even_over_a_leftover_open_copy(
    tmp_path: Path,
) -> None:
    tmp = tmp_path / "state.tmp"
    tmp.write_bytes(b"left by a crash")
    tmp.chmod(0o644)
    path = tmp_path / "state"
    durable.replace(path, b"new")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    durable.replace(path, b"newer")  # and over its own earlier file
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes() == b"newer"


def test_a_rename_onto_a_folder_raises_and_leaves_no_copy(tmp_path: Path) -> None:
    path = tmp_path / "taken"
    (path / "inside").mkdir(parents=True)
    with pytest.raises(IsADirectoryError):
        durable.replace(path, b"data")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_removing_is_idempotent_and_removes(tmp_path: Path) -> None:
    path = tmp_path / "paid"
    durable.replace(path, b"1")
    durable.remove(path)
    assert not path.exists()
    durable.remove(path)  # gone already is fine
    assert list(tmp_path.iterdir()) == []


def test_the_folder_is_synced_after_the_rename_and_after_a_removal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rename lives in the directory: without the folder's fsync a power loss may bring
    back the old name (or the removed file)."""
    synced: list[tuple[bool, bool]] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
        synced.append((is_dir, (tmp_path / "f").exists()))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    durable.replace(tmp_path / "f", b"data")
    # the data first (before the rename), then the folder once the new name is there
    assert synced == [(False, False), (True, True)]
    synced.clear()
    durable.remove(tmp_path / "f")
    assert synced == [(True, False)]

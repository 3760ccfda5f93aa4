"""Files replaced so that a crash or a power loss leaves the old one or the new one, whole."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def sync_dir(folder: Path) -> None:
    """Make a create, rename or removal in `folder` durable: the name lives in the directory."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace(path: Path, data: bytes) -> None:
    """Replace `path` by `data` (mode 0600): written to a temporary file, fsynced, renamed,
    the folder fsynced. Raises OSError when the disk refuses, leaving `path` as it was."""
    tmp = path.with_name(f"{path.name}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            os.fchmod(out.fileno(), 0o600)  # a leftover temporary file keeps its old mode
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()  # a partial copy would only take what room is left
        raise
    sync_dir(path.parent)


def remove(path: Path) -> None:
    """Remove `path` (gone already is fine), durably."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    sync_dir(path.parent)

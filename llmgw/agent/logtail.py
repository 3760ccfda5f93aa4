"""Engine output kept in a file per shard: bounded on disk, its tail shipped with `failed`.

Output goes to a file, not a pipe: an engine writing into the pipe of an
agent that died would get SIGPIPE and die with it, and engines must outlive
the agent. The file is trimmed in place when it grows too large (the engine
opened it with O_APPEND, so its next write lands at the new end).
Used by `llmgw.agent.supervisor`.
"""

from __future__ import annotations

import os
from pathlib import Path

_CHUNK = 64 * 1024


def tail(path: Path, lines: int) -> tuple[str, ...]:
    """The last `lines` non-empty lines of `path`, reading at most a bounded amount from the end."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            start = max(0, size - _CHUNK * max(1, lines // 256 + 1))
            f.seek(start)
            data = f.read()
    except OSError:
        return ()
    text = data.decode(errors="replace")
    parts = [line.rstrip("\r") for line in text.split("\n")]
    if start > 0 and parts:
        parts = parts[1:]  # the first line is cut in the middle
    return tuple(line for line in parts if line.strip())[-lines:]


def trim(path: Path, max_bytes: int, keep_bytes: int) -> bool:
    """Shrink `path` to its last `keep_bytes` once it exceeds `max_bytes`; True if it did.

    Lines the engine writes between the read and the truncate are lost; that is
    the price of a bounded file without the engine's cooperation.
    """
    try:
        if path.stat().st_size <= max_bytes:
            return False
        with path.open("r+b") as f:
            f.seek(-keep_bytes, os.SEEK_END)
            kept = f.read()
            f.seek(0)
            f.truncate(0)
            f.write(b"[llmgw: earlier output trimmed]\n" + kept)
    except OSError:
        return False
    return True

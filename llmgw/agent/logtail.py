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

from llmgw.core import limits, redaction

_CHUNK = 64 * 1024
# What a failed shard's report may carry of the engine's output: readers refuse an event
# beyond the log's bounds (llmgw.core.limits), and NATS refuses a message over its maximum
# payload (1 MiB by default), so the tail is cut to fit well inside both.
MAX_LINE_CHARS = 4096
MAX_TAIL_BYTES = 256 * 1024


def bounded(lines: tuple[str, ...]) -> tuple[str, ...]:
    """`lines` cut to what one event may carry: each line to MAX_LINE_CHARS, then the last
    lines that fit in MAX_TAIL_BYTES and in the log's line count."""
    cut = [
        line if len(line) <= MAX_LINE_CHARS else line[: MAX_LINE_CHARS - 1] + "…" for line in lines
    ]
    kept: list[str] = []
    total = 0
    for line in reversed(cut[-limits.MAX_LOG_LINES :]):
        total += len(line.encode()) + 8
        if total > MAX_TAIL_BYTES:
            break
        kept.append(line)
    return tuple(reversed(kept))


def tail(path: Path, lines: int, api_key: str = "") -> tuple[str, ...]:
    """The last `lines` non-empty lines of `path`, reading at most a bounded amount from the
    end, without `api_key`: it is taken out before any line is cut (a cut through the key
    would leave a part of it that no later redaction finds)."""
    margin = len(api_key.encode())
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            start = max(0, size - _CHUNK * max(1, lines // 256 + 1))
            # Read the key's length before the start too: a key that the start would cut
            # is read whole, and redacted whole.
            read_from = max(0, start - margin)
            f.seek(read_from)
            data = f.read()
    except OSError:
        return ()
    text = data.decode(errors="replace")
    if api_key:
        text = redaction.without_key(text, api_key)
    parts = [shown(line) for line in text.split("\n")]
    if read_from > 0 and any(line.strip() for line in parts[1:]):
        parts = parts[1:]  # the first line is cut in the middle
    elif read_from > 0:
        # One line longer than what was read (a progress bar, a dump without line ends):
        # its end is what the engine said last, so it is kept, marked as cut. Where the
        # read began it may cut an earlier key, fewer bytes of it than the key has: its
        # first `margin` characters, which hold them, are not kept.
        first = parts[0][margin:]
        parts = ["…" + first[-(MAX_LINE_CHARS - 1) :]] if first.strip() else []
    return bounded(tuple(line for line in parts if line.strip())[-lines:])


def shown(line: str) -> str:
    """What a terminal shows of `line`: progress bars (tqdm's, as vLLM and SGLang print
    while loading weights) rewrite one line with carriage returns, and only the last
    rewrite that says something is on the screen."""
    if "\r" not in line:
        return line
    for segment in reversed(line.split("\r")):
        if segment.strip():
            return segment
    return ""


def trim(path: Path, max_bytes: int, keep_bytes: int, api_key: str = "") -> bool:
    """Shrink `path` to its last `keep_bytes` once it exceeds `max_bytes`; True if it did.

    What is kept starts at a line: the cut falls anywhere, inside a line and maybe inside
    the engine's `api_key`, whose part left at the start no redaction would find (a line
    longer than what is kept loses as many bytes as the key has instead). Lines the engine
    writes between the read and the truncate are lost; that is the price of a bounded file
    without the engine's cooperation.
    """
    try:
        if path.stat().st_size <= max_bytes:
            return False
        with path.open("r+b") as f:
            f.seek(-keep_bytes, os.SEEK_END)
            kept = f.read()
            line_end = kept.find(b"\n")
            kept = kept[line_end + 1 :] if line_end >= 0 else kept[len(api_key.encode()) :]
            f.seek(0)
            f.truncate(0)
            f.write(b"[llmgw: earlier output trimmed]\n" + kept)
    except OSError:
        return False
    return True


def redact(lines: tuple[str, ...], api_key: str) -> tuple[str, ...]:
    """The engine's output as it may leave the node: without its API key."""
    if not api_key:
        return lines
    return tuple(redaction.without_key(line, api_key) for line in lines)

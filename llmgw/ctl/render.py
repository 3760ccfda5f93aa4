"""Tables, colour and JSON for `llmgw ctl`'s output.

Tables for people by default, `--json` for scripts (msgspec-encoded, one document;
`ctl events --json` prints one object per line). Colour only when the stream is a
terminal and NO_COLOR is unset, so pipes and files get plain text. The progress bar
of long replays goes to stderr, and only on a terminal.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

import msgspec

from llmgw.core import printable
from llmgw.ctl import history
from llmgw.ctl.eventlines import clean

_encoder = msgspec.json.Encoder()

_COLOURS = {
    "red": "31",
    "green": "32",
    "yellow": "33",
    "blue": "34",
    "magenta": "35",
    "cyan": "36",
    "dim": "2",
    "bold": "1",
}
FAMILY_COLOUR = {"node": "cyan", "operator": "magenta", "control": "green", "cmd": "yellow"}
STATE_COLOUR = {
    "ready": "green",
    "serving": "green",
    "unreachable": "yellow",
    "draining": "yellow",
    "cordoned": "yellow",
    "loading": "cyan",
    "starting": "cyan",
    "placed": "cyan",
    "lost": "red",
    "quarantined": "red",
    "failed": "red",
    "stopped": "dim",
}


def use_colour(stream: TextIO) -> bool:
    return stream.isatty() and not os.environ.get("NO_COLOR")


def paint(text: str, colour: str | None, on: bool) -> str:
    if not on or colour is None or colour not in _COLOURS:
        return text
    return f"\x1b[{_COLOURS[colour]}m{text}\x1b[0m"


def state_colour(value: str) -> str | None:
    for word in value.replace("/", ",").replace(":", ",").split(","):
        if word in ("lost", "failed"):
            return "red"
    first = value.replace("/", ",").replace(":", ",").split(",")
    for word in first:
        if word in STATE_COLOUR and word not in ("retired",):
            return STATE_COLOUR[word]
    return None


# JSON allows C1, format and invisible characters raw in strings, and msgspec writes them
# so: `--json` read on a terminal would then let a node's text drive or reorder it (U+009B
# is CSI) or hide in it. As `\\uXXXX` escapes they are the same JSON, and inert on the
# screen.
def _json_escape(c: int) -> str:
    if c < 0x10000:
        return f"\\u{c:04x}"
    high, low = divmod(c - 0x10000, 0x400)  # JSON writes the others as UTF-16 pairs
    return f"\\u{0xD800 + high:04x}\\u{0xDC00 + low:04x}"


_JSON_ESCAPES = {c: _json_escape(c) for c in printable.UNSAFE}


def json_text(data: Any) -> str:
    return _encoder.encode(data).decode().translate(_JSON_ESCAPES)


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    colour: bool = False,
    colour_col: int | None = None,
) -> str:
    """Left-aligned columns two spaces apart; `colour_col` is painted by its state words."""
    if not rows:
        return "  ".join(headers)
    rows = [[clean(cell) for cell in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    for row in rows:
        cells = []
        for i, (cell, w) in enumerate(zip(row, widths, strict=True)):
            padded = cell.ljust(w)
            if i == colour_col:
                padded = paint(padded, state_colour(cell), colour)
            cells.append(padded)
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def nodes_table(rows: list[dict[str, Any]], *, colour: bool = False) -> str:
    out = []
    for n in rows:
        classes = []
        excluded: list[str] = []
        for cls, c in sorted(n["gpu_classes"].items()):
            text = f"{cls} {c['free']}/{c['total']} free"
            if c["used"]:
                text += f", {c['used']} used"
            if c["unhealthy"]:
                text += f", {c['unhealthy']} unhealthy"
            classes.append(text)
            excluded += c["excluded"]
        fabrics = ",".join(f["name"] for f in n["fabrics"]) or "-"
        state = n["state"] + (f" ({n['cordon_reason']})" if n["cordon_reason"] else "")
        if n.get("quarantine_reason"):
            state += f" (quarantined: {n['quarantine_reason']})"
        out.append(
            [
                n["name"],
                state,
                "; ".join(classes) or "no GPUs",
                fabrics,
                "expired" if n.get("heartbeat_expired") else age(n["heartbeat_age_s"]),
                "; ".join(excluded) or "-",
            ]
        )
    return table(
        ["NODE", "STATE", "GPUS", "FABRICS", "HEARTBEAT", "EXCLUDED"],
        out,
        colour=colour,
        colour_col=1,
    )


def replicas_table(rows: list[dict[str, Any]], *, colour: bool = False, log_lines: int = 5) -> str:
    out = []
    notes: list[str] = []
    for r in rows:
        for s in r["shards"]:
            out.append(
                [
                    r["id"] if s["shard"] == 0 else "",
                    r["model"] if s["shard"] == 0 else "",
                    f"{s['shard']}",
                    s["node"],
                    ",".join(str(g) for g in s["gpus"]),
                    ("retired:" if r["retired"] else "") + s["phase"],
                    s["endpoint"] or "-",
                    s["error"] or "-",
                ]
            )
            if s["log_tail"]:
                notes.append(f"{r['id']}/{s['shard']} on {s['node']}, engine log tail:")
                notes += [f"  | {clean(line)}" for line in s["log_tail"][-log_lines:]]
    text = table(
        ["REPLICA", "MODEL", "SHARD", "NODE", "GPUS", "PHASE", "ENDPOINT", "ERROR"],
        out,
        colour=colour,
        colour_col=5,
    )
    return text + ("\n\n" + "\n".join(notes) if notes else "")


def models_table(rows: list[dict[str, Any]], *, colour: bool = False) -> str:
    out = [
        [
            m["name"],
            m["engine"],
            str(m["revision"]),
            f"{m['replicas_serving']}/{m['replicas_active']}/{m['replicas_wanted']}",
            f"{m['gpus_per_replica']} x {m['gpu_class'] or 'any'}"
            + (f" on {m['nodes_per_replica']} nodes" if m["nodes_per_replica"] > 1 else ""),
            m["unplaceable"] or "-",
        ]
        for m in rows
    ]
    return table(["MODEL", "ENGINE", "REV", "SERVING/ACTIVE/WANTED", "GPUS", "UNPLACEABLE"], out)


class ProgressBar:
    """`replaying [#####.....] 52% 520,000/1,000,000 events` on stderr, on a terminal only."""

    def __init__(self, stream: TextIO | None = None, *, label: str = "replaying") -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty()
        self.label = label
        self._last = 0.0
        self._started = time.perf_counter()
        self._drawn = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total <= 0:
            return
        now = time.perf_counter()
        if now - self._last < 0.1 and done < total:
            return
        self._last = now
        frac = min(1.0, done / total)
        bar = "#" * int(frac * 30)
        rate = done / max(now - self._started, 1e-9)
        self.stream.write(
            f"\r{self.label} [{bar:<30}] {frac:4.0%} {done:,}/{total:,} events "
            f"{rate / 1000:,.0f}k/s"
        )
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()


def rebuilt_header(r: history.Rebuilt) -> str:
    start = f"snapshot at seq {r.snapshot_seq}" if r.snapshot_seq else "the beginning of the log"
    when = f" ({history.format_time(r.at)})" if r.at else ""
    text = (
        f"state at seq {r.target_seq}{when}: from {start} + {r.folded:,} events "
        f"in {r.elapsed_s:.2f} s"
    )
    if r.rejected:
        text += f"; {len(r.rejected)} refused by the fold"
    if r.skipped:
        text += f"; {len(r.skipped)} undecodable skipped"
    return text

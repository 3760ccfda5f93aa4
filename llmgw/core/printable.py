"""Text someone else wrote, made safe to show an operator on one line. Pure.

Nodes and routers write free text into the log and the counters (errors, engine log
tails, addresses, GPU and fabric names, endpoint URLs, model names of usage counters)
that `llmgw ctl`, the console and the admin API show to a person. `escaped` writes out
every character that could act on the terminal or the page instead of being shown:

- C0 controls and DEL: a newline or carriage return forges or overwrites a line, ESC
  starts an escape sequence that drives the terminal;
- C1 controls (U+0080-U+009F): a terminal that takes them as UTF-8 reads U+009B as
  CSI, the same escape sequences without ESC; U+0085 (NEL) is a line break to some;
- the Unicode bidirectional controls (Bidi_Control: marks, embeddings, overrides and
  isolates), which reorder what follows on a terminal or a page that implements the
  bidi algorithm, so that a node's name or a reason reads as something else.

Each becomes a visible `\\xNN` or `\\uNNNN`, the way Python writes it.
"""

from __future__ import annotations

_BIDI_CONTROLS = (0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A))

UNSAFE: frozenset[int] = frozenset((*range(0x20), *range(0x7F, 0xA0), *_BIDI_CONTROLS))
"""The code points `escaped` writes out (JSON for a terminal escapes the same ones)."""

_ESCAPES: dict[int, str] = {c: f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}" for c in UNSAFE}


def escaped(text: str) -> str:
    """`text` with every control and bidirectional formatting character written out."""
    return text.translate(_ESCAPES)

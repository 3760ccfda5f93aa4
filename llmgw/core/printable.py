"""Text someone else wrote, made safe to show an operator on one line. Pure.

Nodes and routers write free text into the log and the counters (errors, engine log
tails, addresses, GPU and fabric names, endpoint URLs, model names of usage counters)
that `llmgw ctl`, the console, the admin API and the services' console log show to a
person. `escaped` writes out every character that could act on the terminal or the page
instead of being shown, or that shows as nothing:

- C0 controls and DEL: a newline or carriage return forges or overwrites a line, ESC
  starts an escape sequence that drives the terminal;
- C1 controls (U+0080-U+009F): a terminal that takes them as UTF-8 reads U+009B as
  CSI, the same escape sequences without ESC; U+0085 (NEL) is a line break to some, as
  are the line and paragraph separators U+2028 and U+2029;
- the format characters (general category Cf), among them the Unicode bidirectional
  controls, which reorder what follows on a terminal or a page that implements the bidi
  algorithm, so that a node's name or a reason reads as something else, and the
  invisible ones (zero-width space and joiners, word joiner, BOM, soft hyphen, tags);
- the other default-ignorable code points, drawn as nothing too (variation selectors,
  the Hangul fillers, the combining grapheme joiner, and those reserved to be ignorable),
  so that `node-a` followed by one of them does not pass for `node-a`;
- surrogates, which a Python string may hold alone and no terminal can be sent.

Each becomes a visible `\\xNN`, `\\uNNNN` or `\\UNNNNNNNN`, the way Python writes it, and a
backslash is doubled, so that distinct texts stay distinct when shown: a node named with
the six characters `a\\x1bb` never reads as one whose name holds an ESC. Emoji joined
by U+200D or styled by a variation selector are shown by their parts.
"""

from __future__ import annotations

from collections.abc import Iterable

_FORMAT = (  # general category Cf, as of Unicode 15.1
    (0x00AD, 0x00AD),
    (0x0600, 0x0605),
    (0x061C, 0x061C),
    (0x06DD, 0x06DD),
    (0x070F, 0x070F),
    (0x0890, 0x0891),
    (0x08E2, 0x08E2),
    (0x180E, 0x180E),
    (0x200B, 0x200F),
    (0x202A, 0x202E),
    (0x2060, 0x2064),
    (0x2066, 0x206F),
    (0xFEFF, 0xFEFF),
    (0xFFF9, 0xFFFB),
    (0x110BD, 0x110BD),
    (0x110CD, 0x110CD),
    (0x13430, 0x1343F),
    (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A),
    (0xE0001, 0xE0001),
    (0xE0020, 0xE007F),
)
_IGNORABLE = (  # Default_Ignorable_Code_Point that is not Cf: shown as nothing
    (0x034F, 0x034F),
    (0x115F, 0x1160),
    (0x17B4, 0x17B5),
    (0x180B, 0x180F),
    (0x2065, 0x2065),
    (0x3164, 0x3164),
    (0xFE00, 0xFE0F),
    (0xFFA0, 0xFFA0),
    (0xFFF0, 0xFFF8),
    (0xE0000, 0xE0FFF),
)
_CONTROLS = ((0x00, 0x1F), (0x7F, 0x9F))
_SEPARATORS = ((0x2028, 0x2029),)
_SURROGATES = ((0xD800, 0xDFFF),)


def _merged(ranges: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Overlapping or adjacent ranges joined, in order."""
    out: list[tuple[int, int]] = []
    for first, last in sorted(ranges):
        if out and first <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(last, out[-1][1]))
        else:
            out.append((first, last))
    return tuple(out)


RANGES = _merged((*_CONTROLS, *_SEPARATORS, *_FORMAT, *_IGNORABLE, *_SURROGATES))
"""`UNSAFE` as inclusive (first, last) ranges, in order: a page's character class."""


def _code_points(ranges: Iterable[tuple[int, int]]) -> frozenset[int]:
    return frozenset(c for first, last in ranges for c in range(first, last + 1))


UNSAFE: frozenset[int] = _code_points(RANGES)
"""The code points `escaped` writes out (JSON for a terminal escapes the same ones)."""


def _escape(c: int) -> str:
    if c < 0x100:
        return f"\\x{c:02x}"
    return f"\\u{c:04x}" if c < 0x10000 else f"\\U{c:08x}"


# One table, so that escaping is a single `str.translate` over the text.
_ESCAPES: dict[int, str] = {ord("\\"): "\\\\", **{c: _escape(c) for c in UNSAFE}}


def escaped(text: str) -> str:
    """`text` with every control, format and invisible character written out and its
    backslashes doubled: shown as is, never acting, and never the same as another text."""
    return text.translate(_ESCAPES)

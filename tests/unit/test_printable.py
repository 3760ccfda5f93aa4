"""What `printable.escaped` promises for any text: nothing in it acts on a terminal or a
page or shows as nothing, it is one line, and distinct texts stay distinct."""

from __future__ import annotations

import itertools
import re
import sys
import unicodedata

from hypothesis import example, given
from hypothesis import strategies as st

from llmgw.core import printable

# Controls, format characters (bidi controls, zero-width ones, tags), line and paragraph
# separators, surrogates: what the running Python's Unicode database calls them.
NEVER_SHOWN = {"Cc", "Cf", "Zl", "Zp", "Cs"}

ANY_TEXT = st.text(st.characters(exclude_categories=()))
"""Any code point, surrogates and unassigned ones included."""

TRICKY_TEXT = st.text(
    st.sampled_from(["\\", "x", "u", "U", "0", "1", "b", "e", "\x1b", "\u200b", "\U000e0041"])
)
"""Literal backslashes next to what reads like an escape, and what escapes to one."""

_TOKEN = re.compile(r"\\(\\|x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8})")


def unescaped(shown: str) -> str:
    """The text that `shown` was made from: a reader can always tell."""
    return _TOKEN.sub(lambda m: "\\" if m[1] == "\\" else chr(int(m[1][1:], 16)), shown)


@given(ANY_TEXT)
@example("a\u200bb\xad\ufeff\U000e0041\ufe0f\u2028\ud800\x1b\x9b")
def test_nothing_shown_is_a_control_a_format_character_or_invisible(text: str) -> None:
    shown = printable.escaped(text)
    assert not [c for c in shown if unicodedata.category(c) in NEVER_SHOWN]
    assert not [c for c in shown if ord(c) in printable.UNSAFE]
    assert len(shown.splitlines()) <= 1


@given(st.one_of(ANY_TEXT, TRICKY_TEXT))
@example("\\x1b\x1b\\\\u200b")
def test_escaping_can_be_read_back_so_distinct_texts_look_distinct(text: str) -> None:
    assert unescaped(printable.escaped(text)) == text


def test_a_literal_escape_does_not_pass_for_the_character() -> None:
    assert printable.escaped("a\\x1bb") != printable.escaped("a\x1bb")
    assert printable.escaped("node\\u200b") != printable.escaped("node\u200b")
    assert printable.escaped("a\\x1bb") == "a\\\\x1bb"


@given(ANY_TEXT)
def test_text_with_nothing_to_escape_is_shown_as_it_is(text: str) -> None:
    if "\\" not in text and not any(ord(c) in printable.UNSAFE for c in text):
        assert printable.escaped(text) == text


def test_every_control_format_separator_and_surrogate_is_escaped() -> None:
    """Against this Python's Unicode database: a later Unicode that adds a format
    character fails here until `printable` lists it."""
    missing = [
        f"U+{c:04X}"
        for c in range(sys.maxunicode + 1)
        if unicodedata.category(chr(c)) in NEVER_SHOWN and c not in printable.UNSAFE
    ]
    assert missing == []


def test_invisible_characters_are_written_out_the_way_python_writes_them() -> None:
    assert printable.escaped("node\u200ba") == "node\\u200ba"
    assert printable.escaped("\u00ad\u2060\ufeff\ufe0f") == "\\xad\\u2060\\ufeff\\ufe0f"
    assert printable.escaped("tag\U000e0041\U000e0100") == "tag\\U000e0041\\U000e0100"
    assert printable.escaped("\u2028\u2029") == "\\u2028\\u2029"


def test_ranges_are_the_unsafe_set_in_order() -> None:
    ranges = printable.RANGES
    assert all(first <= last for first, last in ranges)
    assert all(last + 1 < first for (_, last), (first, _) in itertools.pairwise(ranges))
    assert {c for a, b in ranges for c in range(a, b + 1)} == printable.UNSAFE

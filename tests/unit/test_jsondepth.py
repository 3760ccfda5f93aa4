"""A JSON text's nesting, found without decoding it, is the decoded value's, for any value
and any way of writing it (strings full of brackets, quotes and escapes included)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from llmgw.jsondepth import nested_deeper_than

TRICKY = st.text(alphabet='[]{}"\\\n ab\u00e9\u2028\U0001f600', max_size=12)
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TRICKY,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TRICKY, inner, max_size=4),
    max_leaves=30,
)


def depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    return 0


@given(VALUES, st.integers(0, 12), st.booleans(), st.booleans())
def test_the_nesting_found_is_the_decoded_values(
    value: Any, most: int, ascii_only: bool, indented: bool
) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only, indent=2 if indented else None)
    assert nested_deeper_than(text.encode(), most) == (depth(value) > most)


def test_a_text_nested_past_the_recursion_limit_is_found_at_once() -> None:
    deep = b'{"data": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert nested_deeper_than(deep, 32)
    assert not nested_deeper_than(b'{"data": [{"id": "m", "permission": [{}]}]}', 32)
    assert not nested_deeper_than(b"[" * 40, 64)  # not JSON: its decoder refuses it

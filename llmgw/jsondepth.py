"""How deeply a JSON text nests, found without decoding it. Pure.

Python's JSON decoders (the standard library's and msgspec's) recurse once per level and
stop at the interpreter's recursion limit with RecursionError. Caught, that is a refusal;
but on the way the stack stands at the limit, and whatever runs there (a finalizer the
collector calls at that moment, a warning) fails in turn. A text that nests deeper than a
reader needs is refused before it is decoded: `nested_deeper_than`.
"""

from __future__ import annotations

import re

_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_STRING = re.compile(rb'"[^"]*"')
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_OPEN = frozenset(b"[{")


def nested_deeper_than(text: bytes, most: int) -> bool:
    """Whether `text`, read as JSON, opens more than `most` arrays or objects inside each
    other. Linear in its length: escapes out first, then strings (each a quote to the next
    one), then everything but brackets; the rest is counted, stopping at the first level
    past `most`. A text that is not JSON gets an answer too (its decoder refuses it)."""
    bare = _STRING.sub(b"", _ESCAPE.sub(b"", text)).translate(None, _NOT_BRACKETS)
    if len(bare) <= most:
        return False
    depth = 0
    for c in bare:
        if c in _OPEN:
            depth += 1
            if depth > most:
                return True
        else:
            depth -= 1
    return False

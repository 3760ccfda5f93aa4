"""A request's header given more than once: every value of it, in order. Pure.

aiohttp holds a request's headers in a multidict, where `get` answers the first copy
only; a check that must see a second copy (a key sent twice, two `traceparent`s) reads
them all here. A plain mapping (what tests and benchmarks build) holds one value a name.
Used by `llmgw.router.admission` and `llmgw.router.tracecontext`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast


def values(headers: Mapping[str, str], name: str) -> list[str]:
    """Every value of header `name` in `headers`, in the order they came."""
    getall = getattr(headers, "getall", None)
    if getall is not None:
        return cast(list[str], getall(name, []))
    value = headers.get(name)
    return [] if value is None else [value]

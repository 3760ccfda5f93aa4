"""Counted nouns in what the CLI prints: `1 model`, `2 models`. Pure."""

from __future__ import annotations


def count(n: int, singular: str, plural: str | None = None) -> str:
    """`n` and the noun in the number it takes: count(1, "change") is "1 change"."""
    return f"{n:,} {singular if n == 1 else (plural or singular + 's')}"

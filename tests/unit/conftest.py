"""Fixtures of the unit tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from llmgw.core import catalog
from llmgw.core.profile import ModelProfile


@pytest.fixture
def names_read(monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """How many times a model's names have been read (`catalog.names_of`) so far: what a
    check of many models costs, counted rather than timed (the suite runs on busy machines)."""
    calls = 0
    names_of = catalog.names_of

    def counted(profile: ModelProfile) -> tuple[str, ...]:
        nonlocal calls
        calls += 1
        return names_of(profile)

    monkeypatch.setattr(catalog, "names_of", counted)
    return lambda: calls

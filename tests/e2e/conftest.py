"""Fixtures of the end-to-end tests: a whole fleet of real processes on one test server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.e2e.fleet_kit import Fleet
from tests.harness import TestNatsServer


@pytest.fixture
async def fleet(nats_server: TestNatsServer, tmp_path: Path) -> AsyncIterator[Fleet]:
    """Two nodes, a control plane and a router (see Fleet); stopped after the test.
    Tests that need another fleet define their own `fleet` fixture."""
    f = Fleet(nats_server, tmp_path)
    try:
        yield f
    finally:
        await f.stop()

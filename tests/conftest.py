"""Shared fixtures: a throwaway PKI per session, a fresh real nats-server per test, and
connections as any llmgw identity. The machinery lives in tests/harness.py."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from hypothesis import HealthCheck, settings

from tests.harness import Connector, TestNatsCluster, TestNatsServer, TestPki, running_nats

# Property tests judge what the code returns, never how fast: on a busy machine (CI's two
# cores shared with nats-servers and engines) an example can take longer than Hypothesis's
# default 200 ms deadline, which it reports as a failure. Tests that set their own settings
# keep them.
settings.register_profile("llmgw", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("llmgw")


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    """Undo structlog configuration a test made (a CLI command run in-process configures
    logging): otherwise a later test's `capture_logs` can miss events filtered by a level
    that test set (seen: tests/integration/test_ctl.py then test_bus.py)."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TestPki:
    """One CA for the whole session; `pki.client_tls(kind, name)` issues on first use."""
    return TestPki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def nats_server(pki: TestPki, tmp_path: Path) -> Iterator[TestNatsServer]:
    """A fresh nats-server (JetStream, mTLS, rendered authorization) on a free port."""
    with running_nats(pki, tmp_path / "nats") as server:
        yield server


@pytest.fixture
def nats_cluster(pki: TestPki, tmp_path: Path) -> Iterator[TestNatsCluster]:
    """Three nats-servers in one JetStream cluster (route mTLS), for replicated streams and
    failover; `connect_cluster` connects to it like `connect` does to `nats_server`."""
    cluster = TestNatsCluster(pki, tmp_path / "cluster")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
async def connect_cluster(nats_cluster: TestNatsCluster) -> AsyncIterator[Connector]:
    connector = Connector(nats_cluster)
    try:
        yield connector
    finally:
        await connector.close()


@pytest.fixture
async def connect(nats_server: TestNatsServer) -> AsyncIterator[Connector]:
    """`await connect(kind, name)` / `await connect.admin()`: clients closed at teardown."""
    connector = Connector(nats_server)
    try:
        yield connector
    finally:
        await connector.close()


@pytest.fixture
def procs() -> Iterator[list[Any]]:
    """Processes a test started (each with `.stop()`), stopped last-first at teardown even
    when the test fails."""
    started: list[Any] = []
    yield started
    for p in reversed(started):
        p.stop()

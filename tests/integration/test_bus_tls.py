"""TLS refusals against a real nats-server: a server whose certificate another CA signed,
a client certificate the server does not take.

A service (`bus.connect` as the agent, router and control plane call it) keeps retrying,
backing off, each try logged as `tls_refused` with what to change, and connects once the
server has a certificate of its CA; a client that gives up counts each refused handshake
as a failed try; `fail_on_tls_refusal` (`llmgw ctl`) ends the first connection at the
first refusal, saying which.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats.errors
import pytest
from structlog.testing import capture_logs

from llmgw import bus
from llmgw.bus import natspy
from llmgw.pki.identity import Identity
from tests.harness import TestNatsServer, TestPki, running_nats, wait_for

pytestmark = pytest.mark.slow

NODE = Identity("node", "node-a")


@pytest.fixture
def foreign_server(tmp_path: Path) -> Iterator[TestNatsServer]:
    """A nats-server whose certificate (and client CA) are another PKI's."""
    with running_nats(TestPki(tmp_path / "other-pki"), tmp_path / "foreign-nats") as server:
        yield server


@pytest.fixture
def tries(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The attempt numbers the client's backoff is asked for, waiting none."""
    asked: list[int] = []

    def no_wait(attempt: int, **_: Any) -> float:
        asked.append(attempt)
        return 0.0

    monkeypatch.setattr(natspy, "backoff_delay", no_wait)
    return asked


def refused(logged: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [line for line in logged if line["event"] == "tls_refused"]


async def test_a_service_retries_a_server_of_another_ca_until_it_has_one_of_its_own(
    pki: TestPki, foreign_server: TestNatsServer, tmp_path: Path
) -> None:
    """nats-py waited forever for a failed TLS upgrade's plain stream to close: a service
    started against such a server logged one error and never tried again, even once the
    server had the right certificate."""
    tls = pki.client_tls(NODE.kind, NODE.name)
    with capture_logs() as logged:
        connecting = asyncio.ensure_future(
            bus.connect(foreign_server.url, tls=tls, identity=NODE, name="agent-node-a")
        )
        try:
            await wait_for(lambda: len(refused(logged)) >= 2, 30, "two refused tries")
            line = refused(logged)[0]
            assert line["server"] == foreign_server.url
            assert "not signed by the CA" in line["problem"]
            assert "ca_file" in line["action"]
            assert "retrying" in line["action"]
            # The server comes back on the same port with a certificate of the client's CA.
            foreign_server.stop()
            with running_nats(pki, tmp_path / "fleet-nats", port=foreign_server.port):
                nc = await asyncio.wait_for(connecting, 60)
                assert nc.is_connected
                await bus.close(nc)
        finally:
            connecting.cancel()
            with contextlib.suppress(BaseException):
                await connecting


async def connect_as_node(url: str, tls: ssl.SSLContext, **options: Any) -> bus.BusClient:
    """`bus.connect` as node-a, bounded: a client held for ever fails the test."""
    return await asyncio.wait_for(
        bus.connect(url, tls=tls, identity=NODE, name="node-a", **options), 30
    )


async def test_a_client_that_gives_up_counts_each_refused_handshake_as_a_failed_try(
    pki: TestPki, foreign_server: TestNatsServer, tries: list[int]
) -> None:
    """The TCP connect succeeds before the TLS handshake fails: counted from it, the
    tries never added up (a client with max_reconnect_attempts retried for ever) and the
    backoff never grew past its first step (several tries a second)."""
    tls = pki.client_tls(NODE.kind, NODE.name)
    with pytest.raises(nats.errors.NoServersError):
        await connect_as_node(foreign_server.url, tls, max_reconnect_attempts=3)
    assert tries == [1, 2, 3]


async def test_fail_on_tls_refusal_ends_the_first_connection_at_a_foreign_server_certificate(
    pki: TestPki, foreign_server: TestNatsServer, tries: list[int]
) -> None:
    tls = pki.client_tls(NODE.kind, NODE.name)
    with pytest.raises(bus.TlsRefused) as info:
        await connect_as_node(foreign_server.url, tls, fail_on_tls_refusal=True)
    assert info.value.server == foreign_server.url
    assert info.value.refusal.kind == "server_untrusted"
    assert tries == []  # no second try


async def test_fail_on_tls_refusal_ends_the_first_connection_at_a_refused_certificate(
    nats_server: TestNatsServer, tries: list[int]
) -> None:
    """Under TLS 1.3 the server refuses the client's certificate after the handshake, and
    a write that meets its close said only "Connection lost" about half the time: the
    alert it sent is what `fail_on_tls_refusal` reads. Where the server's reset overtakes
    its alert (the kernel drops what was not read yet: once in five connections in CI),
    that try is an ordinary failure and the next one reads the alert, so each connection
    still ends in the refusal, with at most a retry or two between."""
    tls = nats_server.pki.foreign_tls(NODE.kind, NODE.name)
    for _ in range(5):
        before = len(tries)
        with pytest.raises(bus.TlsRefused) as info:
            await connect_as_node(nats_server.url, tls, fail_on_tls_refusal=True)
        assert info.value.refusal.kind == "client_refused"
        assert len(tries) - before <= 2, tries


async def test_a_connection_up_once_retries_a_later_refusal_whatever_its_first_did(
    nats_server: TestNatsServer, tmp_path: Path
) -> None:
    """`fail_on_tls_refusal` ends a first connection only (`llmgw ctl`): a console connected
    for days, whose server comes back with another CA's certificate, retries as a service
    does, each try logged, and is back once the server has a certificate of its CA."""
    tls = nats_server.pki.client_tls(NODE.kind, NODE.name)
    nc = await connect_as_node(nats_server.url, tls, fail_on_tls_refusal=True)
    try:
        with capture_logs() as logged:
            nats_server.stop()
            other = TestPki(tmp_path / "other-pki")
            with running_nats(other, tmp_path / "foreign-nats", port=nats_server.port):
                await wait_for(lambda: len(refused(logged)) >= 2, 60, "two refused tries")
            nats_server.start()
            await wait_for(lambda: nc.is_connected, 60, "back on the fleet's server")
        assert refused(logged)[0]["problem"]
    finally:
        await bus.close(nc)


async def test_a_server_name_the_certificate_does_not_hold_is_refused(
    nats_server: TestNatsServer, tries: list[int]
) -> None:
    """`tls_hostname` is the name the server's certificate must hold, whatever address
    `servers` lists."""
    tls = nats_server.pki.client_tls(NODE.kind, NODE.name)
    with pytest.raises(bus.TlsRefused) as info:
        await connect_as_node(
            nats_server.url, tls, tls_hostname="elsewhere.invalid", fail_on_tls_refusal=True
        )
    assert info.value.refusal.kind == "server_name"
    nc = await connect_as_node(nats_server.url, tls, tls_hostname="localhost")
    try:
        assert nc.is_connected
    finally:
        await bus.close(nc)

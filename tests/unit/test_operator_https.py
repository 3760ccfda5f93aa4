"""Who the operator API and the console take a certificate for (llmgw.operator_https): the
organizational unit decides whether it is an operator's, whatever its common name; the
common name says which person asked, for the log's record of what the console did."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import socket
import ssl
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
import structlog
from aiohttp import web

from llmgw import http_server, listeners, operator_https
from tests.harness import TestPki


def certificate(common: str, unit: str) -> dict[str, Any]:
    """A peer certificate as ssl.getpeercert() returns it."""
    return {"subject": ((("commonName", common),), (("organizationalUnitName", unit),))}


def test_only_the_unit_makes_an_operator_not_a_node_named_operator() -> None:
    assert operator_https.peer_units(certificate("alice", "operator")) == {"operator"}
    assert "operator" not in operator_https.peer_units(certificate("operator", "node"))
    assert operator_https.peer_units(None) == set()


def test_the_person_who_asked_is_the_certificates_common_name() -> None:
    cert = certificate("alice", "operator")
    transport = SimpleNamespace(get_extra_info=lambda name: cert if name == "peercert" else None)
    request: Any = SimpleNamespace(transport=transport)
    assert operator_https.peer_name(request) == "alice"
    assert operator_https.peer_name(SimpleNamespace(transport=None)) == ""  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def operator_listener(pki: TestPki, head_timeout_s: float = 30.0) -> AsyncIterator[str]:
    """A real HTTPS listener as the control plane's admin API serves one: the fleet's
    server certificate, client certificates from the fleet's CA required, operators only.
    Yields its base URL."""

    async def who(request: web.Request) -> web.Response:
        return web.json_response({"name": operator_https.peer_name(request)})

    app = web.Application(middlewares=[operator_https.operators_only])
    app.router.add_route("*", "/who", who)
    rules = http_server.Rules(head_timeout_s, structlog.get_logger("test"))
    runner = http_server.app_runner(app, rules=rules, access_log=None)
    await runner.setup()
    sock = listeners.bind("127.0.0.1", 0, setting="port")
    certs = pki.certs
    tls = operator_https.server_tls(
        str(certs.server_cert), str(certs.server_key), str(certs.ca_cert)
    )
    try:
        await http_server.start_site(runner, sock, rules=rules, ssl_context=tls)
        yield listeners.url("https", sock)
    finally:
        await runner.cleanup()
        sock.close()


async def test_an_operator_listener_serves_operators_of_the_fleets_ca_only(pki: TestPki) -> None:
    async with operator_listener(pki) as base, aiohttp.ClientSession() as http:

        async def ask(tls: ssl.SSLContext) -> tuple[int, Any]:
            async with http.get(f"{base}/who", ssl=tls) as resp:
                return resp.status, await resp.json()

        assert await ask(pki.client_tls("operator", "alice")) == (200, {"name": "alice"})
        for kind, name in (("node", "node-a"), ("router", "r1"), ("control", "control-test")):
            status, body = await ask(pki.client_tls(kind, name))
            assert status == 403, (kind, status, body)
            assert "OU=operator" in body["error"]
        # A compressed body is refused before whose certificate it is matters, as on every
        # listener: the 415 is the outermost check.
        node = pki.client_tls("node", "node-a")
        squeezed = gzip.compress(b"{}")
        headers = {"Content-Encoding": "gzip"}
        async with http.post(f"{base}/who", data=squeezed, headers=headers, ssl=node) as resp:
            assert resp.status == 415
        # No certificate, an operator's from another CA, an operator's that expired: the
        # handshake fails, so no request is ever read.
        refused = (
            pki.anonymous_tls(),
            pki.foreign_tls("operator", "mallory"),
            pki.expired_tls("operator", "old"),
        )
        for tls in refused:
            with pytest.raises(aiohttp.ClientError):
                await ask(tls)


async def test_a_slow_handshake_counts_against_the_first_heads_deadline(pki: TestPki) -> None:
    """The first head is due a head timeout after the accept, the TLS handshake included:
    a client that connects, waits most of it before its handshake, then sends nothing is
    closed at the deadline from its connect, not a whole timeout after its handshake."""
    timeout_s, delay_s = 4.0, 2.5
    alice = pki.client_tls("operator", "alice")
    async with operator_listener(pki, timeout_s) as base:
        host, port = base.removeprefix("https://").rsplit(":", 1)
        loop = asyncio.get_running_loop()
        sock = socket.create_connection((host, int(port)))
        sock.setblocking(False)
        start = loop.time()
        await asyncio.sleep(delay_s)  # the handshake starts this late, on purpose
        reader, writer = await asyncio.open_connection(sock=sock, ssl=alice, server_hostname=host)
        answer = await asyncio.wait_for(reader.read(), 60)
        took = loop.time() - start
        writer.close()
    assert answer == b""
    assert timeout_s - 0.2 <= took < delay_s + timeout_s - 1.0, took

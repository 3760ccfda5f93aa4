"""The control plane's admin API on loopback answers only requests that name a loopback
host: a page of another site whose DNS name was rebound to 127.0.0.1 (its `Host` still
names the site) must not read the whole fleet through the operator's browser."""

from __future__ import annotations

import asyncio
import time
import types

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from structlog.testing import capture_logs

from llmgw.control import admin
from llmgw.control.config import AdminListener
from llmgw.core import state
from tests.kit import raw_http


def _service(host: str, cert_file: str = "", *, caught_up: bool = True) -> object:
    replayed = asyncio.Event()
    if caught_up:
        replayed.set()
    return types.SimpleNamespace(
        cfg=types.SimpleNamespace(admin=types.SimpleNamespace(host=host, cert_file=cert_file)),
        state=state.ClusterState(),
        caught_up=replayed,
        leading=False,
        clock=time.time,
        name="control-a",
        control_seq=0,
        snapshot_seq=0,
        rejected=0,
        folded=types.SimpleNamespace(undecodable=0),
    )


@pytest.mark.parametrize(
    ("host", "status"),
    [
        ("rebound.example:9190", 421),
        ("127.0.0.1.nip.io:9190", 421),
        ("localhost.evil.example", 421),
        ("127.0.0.1:9190", 200),
        ("localhost:9190", 200),
        ("[::1]:9190", 200),
        ("127.0.0.1", 200),
        ("LOCALHOST:9190", 200),
        ("LocalHost", 200),
        ("localhost.:9190", 200),
        ("localhost.", 200),
        ("127.0.0.2:9190", 200),
        ("[::1]", 200),
        ("[0:0:0:0:0:0:0:1]:9190", 200),
        ("localhost..", 421),
        ("127.0.0.1.:9190", 421),
        ("127.1:9190", 421),
        ("127.000.000.001", 421),
        ("[::ffff:127.0.0.1]:9190", 421),
        ("[::1%25lo]:9190", 421),
        ("::1", 421),
        ("[::2]:9190", 421),
        ("[::]:9190", 421),
        ("0.0.0.0:9190", 421),
        ("localhost:", 421),
        ("localhost:+80", 421),
        ("localhost:9190:1", 421),
        ("[::1]junk", 421),
        ("alice@127.0.0.1:9190", 421),
        ("127.0.0.1/evil.example", 421),
        ("xn--localhost-evil.example", 421),
        ("", 421),
    ],
)
async def test_a_loopback_admin_api_answers_only_loopback_hosts(host: str, status: int) -> None:
    app = admin.build_app(_service("127.0.0.1"))  # type: ignore[arg-type]
    async with TestClient(TestServer(app)) as client:
        r = await client.get("/health", headers={"Host": host})
        assert r.status == status, await r.text()
        if status == 421:
            assert "127.0.0.1" in (await r.json())["error"]


@pytest.mark.parametrize("bound", ["::1", "[::1]", "localhost", "LOCALHOST.", "127.0.0.2"])
async def test_every_loopback_admin_host_checks_the_name(bound: str) -> None:
    """admin.host written as any loopback address or localhost: the same check."""
    app = admin.build_app(_service(bound))  # type: ignore[arg-type]
    async with TestClient(TestServer(app)) as client:
        assert (await client.get("/health", headers={"Host": "rebound.example"})).status == 421
        assert (await client.get("/health", headers={"Host": "localhost:9190"})).status == 200


async def test_an_admin_api_bound_elsewhere_answers_whatever_name_reached_it() -> None:
    """Off loopback the names it is reached by are the operator's (and HTTPS decides)."""
    app = admin.build_app(_service("0.0.0.0"))  # type: ignore[arg-type]
    async with TestClient(TestServer(app)) as client:
        r = await client.get("/health", headers={"Host": "control-1.internal:9190"})
        assert r.status == 200


def _no_host(url: str, method: str, path: str, version: str = "1.1") -> bytes:
    raw = f"{method} {path} HTTP/{version}\r\nConnection: close\r\n\r\n".encode()
    return raw_http.exchange(url, raw, timeout=30.0)


async def test_a_request_without_a_host_header_is_answered() -> None:
    """No browser sends a request without `Host` (HTTP/1.0 may omit it): not a rebound page.
    HTTP/1.1 requires one (RFC 9112): 400."""
    app = admin.build_app(_service("127.0.0.1"))  # type: ignore[arg-type]
    async with TestServer(app) as server:
        url = str(server.make_url("/"))
        answer = await asyncio.to_thread(_no_host, url, "GET", "/health", "1.0")
        assert answer.split(b"\r\n", 1)[0].endswith(b" 200 OK"), answer[:200]
        assert b'"status":"ok"' in answer
        answer = await asyncio.to_thread(_no_host, url, "GET", "/health", "1.1")
        assert answer.split(b"\r\n", 1)[0].endswith(b" 400 Bad Request"), answer[:200]


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
async def test_only_get_and_head_are_answered(method: str) -> None:
    """A read-only API: every path refuses other methods with a 405 naming GET, and a name
    that is no loopback name is refused first (421), whether the path exists or not."""
    app = admin.build_app(_service("127.0.0.1"))  # type: ignore[arg-type]
    paths = ("/v1/nodes", "/v1/replicas", "/v1/models", "/v1/explain/m1", "/v1/state",
             "/metrics", "/v1/sd/prometheus", "/health")  # fmt: skip
    async with TestClient(TestServer(app)) as client:
        for path in paths:
            r = await client.request(method, path, headers={"Host": "127.0.0.1:9190"})
            assert r.status == 405, (path, r.status)
            assert "GET" in r.headers["Allow"]
            r = await client.request(method, path, headers={"Host": "rebound.example"})
            assert r.status == 421, (path, r.status)
        for host, status in (("127.0.0.1:9190", 404), ("rebound.example", 421)):
            r = await client.request(method, "/v1/secrets", headers={"Host": host})
            assert r.status == status
        head = await client.head("/health", headers={"Host": "127.0.0.1:9190"})
        assert (head.status, await head.read()) == (200, b"")


async def test_health_answers_503_while_the_log_is_replayed() -> None:
    """And /v1/state says so, with the leader the fold names (not this instance)."""
    svc = _service("127.0.0.1", caught_up=False)
    svc.state.last_seq = 7  # type: ignore[attr-defined]
    svc.state.leader = "control-b"  # type: ignore[attr-defined]
    app = admin.build_app(svc)  # type: ignore[arg-type]
    async with TestClient(TestServer(app)) as client:
        r = await client.get("/health")
        assert r.status == 503
        assert await r.json() == {"status": "replaying", "leading": False, "folded_seq": 7}
        r = await client.get("/v1/state")
        doc = await r.json()
        assert (doc["caught_up"], doc["folded_seq"]) == (False, 7)
        assert (doc["instance"], doc["leader"], doc["leading"]) == ("control-a", "control-b", False)
        svc.caught_up.set()  # type: ignore[attr-defined]
        r = await client.get("/health")
        assert r.status == 200
        assert await r.json() == {"status": "ok", "leading": False, "folded_seq": 7}
        r = await client.get("/v1/state")
        assert (await r.json())["caught_up"] is True


async def test_an_admin_api_with_a_certificate_answers_whatever_name_reached_it() -> None:
    """Over HTTPS (admin.cert_file) on loopback too, the client certificate decides, not
    the name: a tunnel or a proxy may reach it by another."""
    app = admin.build_app(_service("127.0.0.1", cert_file="/etc/llmgw/admin.pem"))  # type: ignore[arg-type]
    async with TestClient(TestServer(app)) as client:
        r = await client.get("/health", headers={"Host": "control-1.internal:9190"})
        assert r.status == 200


async def test_a_loopback_admin_api_logs_no_exposure_warning() -> None:
    listener = AdminListener(host="127.0.0.1", port=0)
    svc = _service("127.0.0.1")
    svc.cfg.admin = listener  # type: ignore[attr-defined]
    svc.admin_url = ""  # type: ignore[attr-defined]
    with capture_logs() as logged:
        runner = await admin.start(svc)  # type: ignore[arg-type]
    try:
        said = [e["event"] for e in logged]
        assert "admin_listening" in said
        assert "admin_exposed" not in said
        url = svc.admin_url  # type: ignore[attr-defined]
        assert url.startswith("http://127.0.0.1:")
        async with aiohttp.ClientSession() as http, http.get(f"{url}/health") as resp:
            assert resp.status == 200
    finally:
        await runner.cleanup()


async def test_two_host_headers_are_refused_and_the_header_name_is_any_case() -> None:
    """Two `Host` headers, in either order, are a malformed request (400, RFC 9112), so no
    loopback one can vouch for a foreign one; `hOsT` is the same header."""
    app = admin.build_app(_service("127.0.0.1"))  # type: ignore[arg-type]
    async with TestServer(app) as server:
        url = str(server.make_url("/"))
        for heads, status in (
            ("Host: 127.0.0.1\r\nHost: rebound.example", b" 400 "),
            ("Host: rebound.example\r\nHost: 127.0.0.1", b" 400 "),
            ("hOsT: rebound.example", b" 421 "),
            ("hOsT: 127.0.0.1", b" 200 "),
        ):
            raw = f"GET /health HTTP/1.1\r\n{heads}\r\nConnection: close\r\n\r\n".encode()
            answer = await asyncio.to_thread(raw_http.exchange, url, raw, timeout=30.0)
            assert status in answer.split(b"\r\n", 1)[0], (heads, answer[:200])

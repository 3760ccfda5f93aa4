"""The control plane's admin API on loopback answers only requests that name a loopback
host: a page of another site whose DNS name was rebound to 127.0.0.1 (its `Host` still
names the site) must not read the whole fleet through the operator's browser."""

from __future__ import annotations

import asyncio
import types

import pytest
from aiohttp.test_utils import TestClient, TestServer

from llmgw.control import admin
from llmgw.core import state


def _service(host: str, cert_file: str = "") -> object:
    caught_up = asyncio.Event()
    caught_up.set()
    return types.SimpleNamespace(
        cfg=types.SimpleNamespace(admin=types.SimpleNamespace(host=host, cert_file=cert_file)),
        state=state.ClusterState(),
        caught_up=caught_up,
        leading=False,
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
    ],
)
async def test_a_loopback_admin_api_answers_only_loopback_hosts(host: str, status: int) -> None:
    app = admin.build_app(_service("127.0.0.1"))  # type: ignore[arg-type]
    async with TestClient(TestServer(app)) as client:
        r = await client.get("/health", headers={"Host": host})
        assert r.status == status, await r.text()
        if status == 421:
            assert "127.0.0.1" in (await r.json())["error"]


async def test_an_admin_api_bound_elsewhere_answers_whatever_name_reached_it() -> None:
    """Off loopback the names it is reached by are the operator's (and HTTPS decides)."""
    app = admin.build_app(_service("0.0.0.0"))  # type: ignore[arg-type]
    async with TestClient(TestServer(app)) as client:
        r = await client.get("/health", headers={"Host": "control-1.internal:9190"})
        assert r.status == 200

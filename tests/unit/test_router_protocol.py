"""The router's request handler is built only on the aiohttp it was written for."""

from __future__ import annotations

import pytest
import structlog
from aiohttp import web

from llmgw.router import protocol


async def _handler(request: web.BaseRequest) -> web.StreamResponse:
    return web.Response(text="ok")


async def test_the_installed_aiohttp_gets_the_routers_handler() -> None:
    assert protocol.SUPPORTED, "pyproject pins aiohttp to the versions the handler knows"
    srv = protocol.server(_handler, head_timeout_s=5.0, client_max_size=1024)
    assert isinstance(srv, protocol.Server)
    assert isinstance(srv(), protocol.Handler)


async def test_another_aiohttp_gets_its_own_server_and_the_log_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(protocol, "SUPPORTED", False)
    with structlog.testing.capture_logs() as logged:
        srv = protocol.server(_handler, head_timeout_s=5.0, client_max_size=1024)
    assert type(srv) is web.Server
    assert not isinstance(srv(), protocol.Handler)
    (line,) = [e for e in logged if e["event"] == "request_handler_stock"]
    assert "head" in line["reason"]

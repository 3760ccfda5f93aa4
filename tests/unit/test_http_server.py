"""The shared connection handler (llmgw.http_server) is built only on the aiohttp it was
written for: for the router's low-level servers and for the other listeners' applications
alike; on another aiohttp, each gets aiohttp's own, and the log says why."""

from __future__ import annotations

import pytest
import structlog
from aiohttp import web

from llmgw import http_server, logs
from llmgw.router import protocol

RULES = http_server.Rules(5.0, logs.get("llmgw.test"))


async def _handler(request: web.BaseRequest) -> web.StreamResponse:
    return web.Response(text="ok")


async def _app_server(runner: web.AppRunner) -> web.Server:
    await runner.setup()
    assert runner.server is not None
    return runner.server


async def test_the_installed_aiohttp_gets_the_handler() -> None:
    assert http_server.SUPPORTED, "pyproject pins aiohttp to the versions the handler knows"
    srv = protocol.server(_handler, head_timeout_s=5.0, client_max_size=1024)
    assert isinstance(srv, http_server.Server)
    assert isinstance(srv(), http_server.Handler)
    runner = http_server.app_runner(web.Application(), rules=RULES, handler_cancellation=True)
    try:
        app_srv = await _app_server(runner)
        assert isinstance(app_srv, http_server.Server)
        assert app_srv.handler_cancellation  # aiohttp's arguments reach the server
        assert isinstance(app_srv(), http_server.Handler)
    finally:
        await runner.cleanup()


async def test_another_aiohttp_gets_its_own_server_and_the_log_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(http_server, "SUPPORTED", False)
    with structlog.testing.capture_logs() as logged:
        srv = protocol.server(_handler, head_timeout_s=5.0, client_max_size=1024)
        runner = http_server.app_runner(web.Application(), rules=RULES)
    assert type(srv) is web.Server
    assert not isinstance(srv(), http_server.Handler)
    try:
        app_srv = await _app_server(runner)
        assert type(app_srv) is web.Server
        assert not isinstance(app_srv(), http_server.Handler)
    finally:
        await runner.cleanup()
    lines = [e for e in logged if e["event"] == "request_handler_stock"]
    assert len(lines) == 2  # one per listener
    assert all("head" in line["reason"] for line in lines)

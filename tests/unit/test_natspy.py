"""llmgw.bus.natspy's version guard: the overrides apply to the nats-py range they were
written for, and a client outside it is stock nats-py (said once in the log)."""

from __future__ import annotations

import pytest
from nats.protocol.parser import Parser
from structlog.testing import capture_logs

from llmgw.bus import natspy


@pytest.mark.parametrize("version", ["2.16.0", "2.16.7", "2.16.1rc1"])
def test_the_pinned_minor_release_is_supported(version: str) -> None:
    assert natspy.unsupported(version) is None


@pytest.mark.parametrize("version", ["2.17.0", "2.15.9", "3.0.0", "1.99", "unknown", ""])
def test_anything_else_falls_back_and_says_why(version: str) -> None:
    reason = natspy.unsupported(version)
    assert reason is not None
    assert "nats-py" in reason


def test_the_installed_version_gets_the_overrides() -> None:
    # pyproject pins nats-py to the range: an install outside it is a packaging bug.
    assert natspy.REASON is None, natspy.REASON
    client = natspy.Client()
    assert client.overridden
    assert type(client._ps) is natspy.FrameParser
    assert client.reconnect_wait_s == 0


def test_a_forced_fallback_is_stock_nats_py_and_logged_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(natspy, "REASON", "forced by the test")
    monkeypatch.setattr(natspy, "_told", False)
    with capture_logs() as logs:
        clients = [natspy.Client(), natspy.Client()]
    for client in clients:
        assert not client.overridden
        assert type(client._ps) is Parser
        assert client.reconnect_wait_s == natspy.FALLBACK_RECONNECT_WAIT_S > 0
    told = [e for e in logs if e["event"] == "natspy_fallback"]
    assert len(told) == 1
    assert told[0]["why"] == "forced by the test"


def test_the_nats_py_internals_the_bus_client_overrides_still_exist() -> None:
    """llmgw.bus.natspy overrides private nats-py methods; an upgrade within the guarded
    range that renamed them would silently bring back fixed reconnect waits, break the
    Reader's fast path, or hold a client whose TLS upgrade failed for ever."""
    import inspect

    from nats.aio.client import Client
    from nats.aio.transport import TcpTransport

    params = list(inspect.signature(Client._process_msg).parameters)
    assert params == ["self", "sid", "subject", "reply", "data", "headers"]
    assert inspect.iscoroutinefunction(Client._select_next_server)
    assert inspect.iscoroutinefunction(Client._connect_to_server)
    assert inspect.iscoroutinefunction(Client._process_connect_init)
    plain = Client()
    for attribute in ("_server_pool", "_current_server", "_transport", "options", "stats"):
        assert hasattr(plain, attribute)
    transport = TcpTransport()
    for attribute in ("_io_reader", "_io_writer", "_bare_io_reader", "_bare_io_writer"):
        assert hasattr(transport, attribute)
    assert inspect.iscoroutinefunction(TcpTransport.connect_tls)
    assert inspect.iscoroutinefunction(TcpTransport.drain)


async def test_a_read_takes_up_to_read_bytes_of_what_has_arrived() -> None:
    """nats-py asks for 32 KiB a read; the transport takes up to `READ_BYTES` of what has
    arrived (fewer reads and parse calls in a replay), and no more than has."""
    import asyncio

    transport = natspy.UpgradeSafeTransport()  # type: ignore[no-untyped-call]
    stream = asyncio.StreamReader(limit=2**20)
    stream.feed_data(b"x" * (natspy.READ_BYTES + 100))
    transport._io_reader = stream
    assert len(await transport.read(32_768)) == natspy.READ_BYTES
    assert len(await transport.read(32_768)) == 100
    stream.feed_data(b"y" * 10)
    assert await transport.read(32_768) == b"y" * 10

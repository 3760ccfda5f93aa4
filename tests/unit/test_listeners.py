"""Which listener addresses stay on the machine (llmgw.listeners.loopback): the control
plane warns when its plain-HTTP admin API, the whole fleet's state, listens elsewhere."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from llmgw import listeners
from llmgw.cli.main import app


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "127.8.0.1", "::1", "[::1]", "localhost", "LOCALHOST", "localhost."]
)
def test_loopback_hosts(host: str) -> None:
    assert listeners.loopback(host)


@pytest.mark.parametrize(
    "host",
    ["0.0.0.0", "::", "10.0.0.5", "192.168.1.1", "control-1.internal",
     "localhost.evil.example", "127.0.0.1.nip.io", "", " 127.0.0.1"],
)  # fmt: skip
def test_anything_else_counts_as_exposed(host: str) -> None:
    assert not listeners.loopback(host)


@given(st.text(max_size=60))
def test_any_text_is_answered_never_raises(host: str) -> None:
    assert listeners.loopback(host) in (True, False)


@pytest.mark.parametrize(
    ("value", "local"),
    [("127.0.0.1:9190", True), ("[::1]:9190", True), ("localhost", True), ("[::1]", True),
     ("rebound.example:9190", False), ("127.0.0.1.nip.io", False), ("[::1", False), ("", False)],
)  # fmt: skip
def test_host_headers_that_name_loopback(value: str, local: bool) -> None:
    assert listeners.loopback_host_header(value) is local


@given(st.text(max_size=60))
def test_any_host_header_is_answered_never_raises(value: str) -> None:
    assert listeners.loopback_host_header(value) in (True, False)


@pytest.mark.parametrize(
    ("host", "port", "change"),
    [("127.0.0.1", 99999, "admin.port"), ("127.0.0.1", -1, "admin.port"),
     ("a" * 300, 0, "admin.host"), ("a..b", 0, "admin.host"), ("nonexistent.invalid", 0,
     "admin.host"), ("\x00", 0, "admin.host"), ("[::1]", 0, "admin.host")],
)  # fmt: skip
def test_an_address_that_cannot_be_bound_is_an_oserror_naming_the_setting(
    host: str, port: int, change: str
) -> None:
    # A port beyond 65535 was an OverflowError, a host with a NUL a TypeError, a label
    # longer than 63 characters a UnicodeError (tracebacks); a name that does not resolve
    # said to pick another port.
    with pytest.raises(OSError, match=f"set {change} ") as info:
        listeners.bind(host, port, setting="admin.port")
    assert len(str(info.value)) < 300


@pytest.mark.parametrize(
    ("argv", "change"),
    [(["console", "--port", "99999"], "--port"),
     (["sim", "--host", "nonexistent.invalid", "--port", "0"], "--host"),
     (["sim", "--host", "a" * 300, "--port", "0"], "--host")],
)  # fmt: skip
def test_commands_refuse_an_address_in_one_line(argv: list[str], change: str) -> None:
    result = CliRunner().invoke(app, argv, env={})
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 2, result.output
    assert change in result.output


@pytest.mark.parametrize("host", ["", " ", "\t"])
def test_an_empty_host_is_refused_not_read_as_every_interface(host: str) -> None:
    # The socket API binds "" to every interface: `--host "$HOST"` with HOST unset put a
    # service meant for loopback on the network without a word.
    with pytest.raises(listeners.ListenError, match=r"set it to 0\.0\.0\.0") as info:
        listeners.bind(host, 0, setting="admin.port")
    assert str(info.value).startswith("admin.host is empty")
    from llmgw.router.config import Listener
    from llmgw.router.server import listening_sockets

    with pytest.raises(listeners.ListenError, match=r"listen\.host is empty"):
        listening_sockets(Listener(host=host, port=0), 2, setting="listen.port")
    for argv in (["sim", "--host", host, "--port", "0"], ["up", "--host", host],
                 ["console", "--host", host, "--port", "0"]):  # fmt: skip
        result = CliRunner().invoke(app, argv, env={})
        assert result.exit_code != 0, (argv, result.output)
        assert "--host is empty" in result.output, (argv, result.output)

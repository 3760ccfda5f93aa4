"""Which listener addresses stay on the machine (llmgw.listeners.loopback): the control
plane warns when its plain-HTTP admin API, the whole fleet's state, listens elsewhere."""

from __future__ import annotations

import errno
import os
import re
import socket

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


ports = st.none() | st.integers(0, 65535).map(str)


def _with(port: str | None, host: str) -> str:
    return host if port is None else f"{host}:{port}"


def _any_case(draw: st.DrawFn, text: str) -> str:
    upper = draw(st.lists(st.booleans(), min_size=len(text), max_size=len(text)))
    return "".join(c.upper() if u else c for c, u in zip(text, upper, strict=True))


@st.composite
def loopback_hosts(draw: st.DrawFn) -> str:
    """A `Host` a client of a loopback listener sends: 127.0.0.0/8, [::1] or localhost, in
    any letter case, with a port or without."""
    ipv4 = st.ip_addresses(v=4, network="127.0.0.0/8").map(str)
    host = draw(ipv4 | st.sampled_from(["[::1]", "localhost"]))
    return _with(draw(ports), _any_case(draw, host))


@given(loopback_hosts())
def test_every_loopback_literal_names_loopback(value: str) -> None:
    assert listeners.loopback_host_header(value)


labels = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?", fullmatch=True)


@given(st.ip_addresses(v=4, network="127.0.0.0/8").map(str) | st.just("localhost"), labels,
       st.booleans(), ports)  # fmt: skip
def test_a_name_that_only_contains_a_loopback_name_is_not_one(
    loopback: str, label: str, before: bool, port: str | None
) -> None:
    # 127.0.0.1.evil.example and localhost.evil.example resolve to whatever their owner says.
    name = f"{label}.{loopback}" if before else f"{loopback}.{label}"
    assert not listeners.loopback_host_header(_with(port, name))


@pytest.mark.parametrize(
    "value",
    ["0x7f.1", "0x7f000001", "2130706433", "127.1", "0177.0.0.1", "127.0.0.01", "", ":80",
     " 127.0.0.1", "127.0.0.1 ", "::1", "[::1", "[::1]x", "evil@127.0.0.1", "127.0.0.1/x",
     "127.0.0.1:x", "127.0.0.1:", "localhost:80:80", "[127.0.0.1]", "localhost..",
     "[::ffff:127.0.0.1]", "localhost\x00", "\uff4cocalhost", "127.0.0.1%2f"],
)  # fmt: skip
def test_other_spellings_of_loopback_are_not_taken(value: str) -> None:
    # A browser writes 127.0.0.1, [::1] or localhost as they are; anything else a name
    # could be registered as, or no host at all.
    assert not listeners.loopback_host_header(value)


LOOPBACK_SYNTAX = re.compile(r"(127(\.[0-9]{1,3}){3}|\[[0-9a-f:.]+\]|localhost\.?)(:[0-9]+)?", re.I)


near_loopback = st.tuples(st.text(max_size=4), loopback_hosts(), st.text(max_size=6)).map("".join)


@given(st.text(max_size=40) | near_loopback)
def test_nothing_else_names_loopback(value: str) -> None:
    # A path, user info, a second port, junk around the name: not a host a browser writes.
    if listeners.loopback_host_header(value):
        assert LOOPBACK_SYNTAX.fullmatch(value), value


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


@pytest.mark.parametrize("workers", [1, 2])
def test_a_router_refused_its_admin_port_holds_no_api_port_meanwhile(workers: int) -> None:
    """`claim` binds the API port first: when the admin port is taken it closes what it
    bound, so the refusal leaves the API port as it found it (free, here)."""
    from llmgw.router.config import Listener, RouterConfig
    from llmgw.router.server import PortTaken, claim

    with listeners.bind("127.0.0.1", 0, setting="admin.port") as taken:
        with listeners.bind("127.0.0.1", 0, setting="listen.port") as probe:
            free = probe.getsockname()[1]
        cfg = RouterConfig(
            workers=workers,
            listen=Listener(host="127.0.0.1", port=free),
            admin=Listener(host="127.0.0.1", port=taken.getsockname()[1]),
        )
        with pytest.raises(PortTaken, match=r"\(admin\.port\) is taken") as refused:
            claim(cfg)
        # While the refusal is handled (its traceback holds `claim`'s frame), as the CLI's
        # `except` handles it:
        assert "stop that process" in str(refused.value)
        with listeners.bind("127.0.0.1", free, setting="listen.port") as again:
            assert again.getsockname()[1] == free


@pytest.mark.parametrize(
    ("value", "name"),
    [("Example.COM:8080", "example.com"), ("[::1]:80", "[::1]"), ("localhost.", "localhost."),
     ("ex\u00e4mple.com", None), ("example.com:\uff18\uff10", None), ("example.com:\u0668", None),
     ("user@example.com", None), ("example.com/x", None), ("example.com:", None)],
)  # fmt: skip
def test_a_host_header_names_an_ascii_host_and_digit_port_or_nothing(
    value: str, name: str | None
) -> None:
    # Bytes past ASCII reach a header as latin-1 text: neither a name nor a port's digits
    # may hold them (a browser sends punycode), nor user info.
    assert listeners.host_header_name(value) == name


@pytest.mark.parametrize("value", ["localhost.", "localhost.:9190", "LOCALHOST.:80"])
def test_the_fully_qualified_localhost_names_loopback(value: str) -> None:
    assert listeners.loopback_host_header(value)


def test_an_ipv6_host_is_bound_as_ipv6_and_its_url_bracketed() -> None:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    with listeners.bind("::1", 0, setting="admin.port") as sock:
        assert sock.family == socket.AF_INET6
        port = sock.getsockname()[1]
        assert listeners.url("https", sock) == f"https://[::1]:{port}"
    with listeners.bind("127.0.0.1", 0, setting="admin.port") as four:
        assert listeners.url("http", four) == f"http://127.0.0.1:{four.getsockname()[1]}"


@pytest.mark.parametrize("code", [errno.EADDRINUSE, errno.EACCES])
def test_a_taken_or_privileged_port_says_to_pick_another_port(code: int) -> None:
    exc = OSError(code, os.strerror(code))
    said = str(listeners.bind_error(exc, "127.0.0.1", 80, "admin.port"))
    assert "set admin.port to a free port" in said
    assert "admin.host" not in said


@pytest.mark.parametrize(
    ("url", "target"),
    [("http://0.0.0.0:9100", "node-a:9100"), ("http://[::]:9100", "node-a:9100"),
     ("http://10.0.0.5:9100", "10.0.0.5:9100"), ("http://[fd00::5]:9100", "[fd00::5]:9100"),
     ("", "")],
)  # fmt: skip
def test_a_wildcard_listener_is_scraped_at_the_machines_name(url: str, target: str) -> None:
    assert listeners.scrape_target(url, "node-a") == target

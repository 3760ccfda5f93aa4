"""sd_notify: one datagram on $NOTIFY_SOCKET (a path or an abstract @name), never an error."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from llmgw import sdnotify


def test_ready_reaches_a_socket_at_a_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        assert sdnotify.ready() is True
        assert sock.recv(64) == b"READY=1"


def test_ready_reaches_an_abstract_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"llmgw-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.notify("STATUS=folding") is True
        assert sock.recv(64) == b"STATUS=folding"


@pytest.mark.parametrize("value", ["", "relative/path", "/nonexistent/llmgw/notify"])
def test_without_a_usable_socket_nothing_is_sent_and_nothing_raised(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", value)
    assert sdnotify.ready() is False


def test_outside_systemd_nothing_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.ready() is False


def test_a_relative_path_is_refused_even_where_a_socket_answers_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sd_notify(3) takes an absolute path or an @name: a relative one would resolve against
    whatever folder the service runs in, and tell whoever listens there."""
    monkeypatch.chdir(tmp_path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("notify")
        sock.setblocking(False)
        monkeypatch.setenv("NOTIFY_SOCKET", "notify")
        assert sdnotify.ready() is False
        with pytest.raises(BlockingIOError):
            sock.recv(64)


def test_a_listener_that_is_gone_is_no_error_and_no_claim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))  # the socket file stays, nobody reads it
    assert path.exists()
    assert sdnotify.ready() is False

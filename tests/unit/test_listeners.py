"""Which listener addresses stay on the machine (llmgw.listeners.loopback): the control
plane warns when its plain-HTTP admin API, the whole fleet's state, listens elsewhere."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw import listeners


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

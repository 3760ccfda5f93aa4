"""The ports `llmgw up` and the tests hand to servers they start (llmgw.natsd.free_port):
free when given, and outside the kernel's ephemeral range, from which every outgoing
connection on the machine takes its local port (a router that `llmgw up` started on a busy
machine found its port taken by one, between the check and its bind)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw import natsd


@given(
    st.floats(min_value=0.0, max_value=1.0, exclude_max=True),
    st.integers(1, 65535),
    st.integers(0, 65535),
)
def test_a_picked_port_is_outside_the_ephemeral_range(draw: float, lo: int, span: int) -> None:
    hi = min(65535, lo + span)
    port = natsd.pick_port(draw, (lo, hi))
    if port is None:  # only when nothing from the floor up lies outside the range
        assert lo <= natsd.LOWEST_PICKED
        assert hi == 65535
        return
    assert natsd.LOWEST_PICKED <= port <= 65535
    assert not lo <= port <= hi


def test_every_port_outside_the_range_can_be_drawn() -> None:
    ephemeral = (32768, 60999)
    drawn = {natsd.pick_port(i / 100_000, ephemeral) for i in range(100_000)}
    wanted = set(range(natsd.LOWEST_PICKED, 32768)) | set(range(61000, 65536))
    assert drawn == wanted


def test_free_ports_are_free_distinct_and_not_ephemeral() -> None:
    lo, hi = natsd.ephemeral_range()
    given_ports = [natsd.free_port() for _ in range(200)]
    assert len(set(given_ports)) == len(given_ports)
    for port in given_ports[:20]:
        assert not lo <= port <= hi
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))


@pytest.mark.parametrize("text", ["60999 32768", "0 60999", "32768 70000", "32768", "a b"])
def test_an_ephemeral_range_that_makes_no_sense_is_taken_as_linuxs_default(
    text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ip_local_port_range"
    path.write_text(text + "\n")
    monkeypatch.setattr(natsd, "_EPHEMERAL_RANGE", path)
    assert natsd.ephemeral_range() == (32768, 60999)
    path.write_text("40000\t50000\n")
    assert natsd.ephemeral_range() == (40000, 50000)

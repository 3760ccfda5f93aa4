"""The control plane's admin API and the agent's admin listener hold their connections as
the router's front door does (tests/integration/test_router_hygiene.py): a request head
trickled in a byte at a time is cut with a 408 once `admin.header_timeout_s` has passed;
a connection that sends nothing (over HTTPS: not even a handshake) is closed once that
long has passed since its connect, while a head sent in pieces within it, and a
kept-alive connection's next request after a longer idle spell, are served; a malformed
header holding a key is answered with a 400 that quotes nothing it sent, logged by its
kind only; a gzip bomb sent as a body, even to a path that reads none, is answered 415
without being inflated, while an uncompressed body is served. Each runs in-process (its
`start` or `serve` on real sockets), over plain HTTP and over HTTPS with an operator's
certificate; the log checked is everything the process logs, llmgw's lines and aiohttp's
records alike. `llmgw console` (its `--header-timeout-s`) runs as a real process over a
real nats-server, its log a file."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import threading
import time
import types
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import structlog

from llmgw import bus
from llmgw.agent import config as agent_config
from llmgw.agent import metrics
from llmgw.control import admin
from llmgw.control import config as control_config
from llmgw.core import state
from tests.e2e.console_kit import console_argv
from tests.e2e.fleet_kit import Service
from tests.harness import TestNatsServer, TestPki, connect_as
from tests.kit import raw_http

pytestmark = pytest.mark.slow

HEAD_TIMEOUT_S = 1.0
EARLY_S = 0.2
"""How much before its deadline a close may be seen (timer granularity), and no more."""

Log = Callable[[], str]


@pytest.fixture
def logged(caplog: pytest.LogCaptureFixture) -> Iterator[Log]:
    """Everything logged in this process from here on, as text: llmgw's events and the
    standard library's records (aiohttp's), tracebacks included."""
    caplog.set_level(logging.DEBUG)
    with structlog.testing.capture_logs() as lines:
        yield lambda: "\n".join(map(repr, lines)) + "\n" + caplog.text


def cuts_a_trickled_head(url: str, tls: ssl.SSLContext | None = None) -> None:
    """A head sent one byte every 0.1 s is answered 408 and closed within a bound."""
    start, pieces = raw_http.one_byte_at_a_time(url, every_s=0.1, for_s=HEAD_TIMEOUT_S + 20)
    answer, took = raw_http.trickle(url, start, pieces, every_s=0.1, tls=tls)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    assert "error" in json.loads(answer.partition(b"\r\n\r\n")[2])
    assert HEAD_TIMEOUT_S - EARLY_S <= took < HEAD_TIMEOUT_S + 15


def closes_a_silent_connection(url: str, tls: ssl.SSLContext | None = None) -> None:
    """A connection that sends nothing is closed, unanswered, once the head deadline has
    passed since its connect, not before; over HTTPS both one that never starts the
    handshake (a raw TCP socket) and one that goes quiet after it (`tls`)."""
    for client_tls in (None, tls) if tls is not None else (None,):
        answer, took = raw_http.silent(url, tls=client_tls, wait_s=30)
        assert answer == b"", answer[:300]
        assert HEAD_TIMEOUT_S - EARLY_S <= took < 30, (client_tls, took)


def serves_a_kept_alive_connection_after_an_idle_spell(
    url: str, tls: ssl.SSLContext | None = None, path: str = "/health"
) -> None:
    """A second request on the same connection, after idling past the head deadline: the
    deadline covers the first head, never the wait for the next one."""
    first, second = raw_http.kept_alive(url, path, idle_s=2.5 * HEAD_TIMEOUT_S, tls=tls)
    assert first.startswith(b"HTTP/1.1 200"), first[:300]
    assert second.startswith(b"HTTP/1.1 200"), second[:300]


def answers_a_malformed_key_quietly(url: str, log: Log, tls: ssl.SSLContext | None = None) -> None:
    """A header with a key and a control character: a JSON 400 without the key, one log
    line naming the kind of problem, no traceback."""
    answer = raw_http.exchange(url, raw_http.malformed_key(url), tls=tls)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith((b"HTTP/1.1 400", b"HTTP/1.0 400")), answer[:300]
    assert raw_http.SECRET.encode() not in answer
    assert "header" in json.loads(body)["error"]
    raw_http.logged_without_the_key(log, "invalid_header", 0)


def serves_a_head_sent_at_once(
    url: str, tls: ssl.SSLContext | None = None, path: str = "/health", status: int = 200
) -> None:
    host, port = raw_http.addr(url)
    raw = f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode()
    answer = raw_http.exchange(url, raw, tls=tls)
    assert answer.startswith(b"HTTP/1.1 %d" % status), answer[:300]


def refuses_a_gzip_bomb(
    url: str, cpu_s: Callable[[], float], tls: ssl.SSLContext | None = None, path: str = "/health"
) -> None:
    """A GET (which no handler reads a body of) with a MB of gzip that inflates to a GiB:
    aiohttp inflated it, seconds of the listener's loop with no credential needed. It is
    refused with a JSON 415 (or the connection closed) within well under a second of the
    CPU clock `cpu_s` reads, the listener's."""
    raw = raw_http.with_body(url, "GET", path, raw_http.gzip_bomb(), "Content-Encoding: gzip")
    before = cpu_s()
    answer = raw_http.answer_to(url, raw, tls=tls)
    used = cpu_s() - before
    assert used < 1.0, used
    if answer:
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 415"), answer[:300]
        assert b"\r\naccept-encoding: identity" in head.lower(), head
        assert "compressed" in json.loads(body)["error"]


def serves_an_uncompressed_body(
    url: str, tls: ssl.SSLContext | None = None, path: str = "/health", status: int = 200
) -> None:
    """A body sent as it is, `Content-Encoding: identity` or none, is no reason to refuse."""
    for coding in ("Content-Encoding: identity", "X-Plain: 1"):
        raw = raw_http.with_body(url, "GET", path, b'{"plain": true}', coding)
        answer = raw_http.exchange(url, raw, tls=tls)
        assert answer.startswith(b"HTTP/1.1 %d" % status), (coding, answer[:300])


def loop_cpu_clock() -> Callable[[], float]:
    """The CPU clock of the calling thread (an in-process listener's loop), to be read from
    another (the client's)."""
    clock = time.pthread_getcpuclockid(threading.get_ident())
    return lambda: time.clock_gettime(clock)


# ------------------------------------------------------------------ the control plane


@pytest.fixture(params=["http", "https"])
async def control_admin(
    request: pytest.FixtureRequest, pki: TestPki
) -> AsyncIterator[tuple[str, ssl.SSLContext | None]]:
    """The control plane's admin API (`admin.start`) over a stand-in service: its URL and
    the TLS a client needs (an operator's certificate), None over plain HTTP."""
    https = request.param == "https"
    certs = pki.certs
    listener = control_config.AdminListener(
        host="127.0.0.1",
        port=0,
        header_timeout_s=HEAD_TIMEOUT_S,
        cert_file=str(certs.server_cert) if https else "",
        key_file=str(certs.server_key) if https else "",
        ca_file=str(certs.ca_cert) if https else "",
    )
    caught_up = asyncio.Event()
    caught_up.set()
    svc = types.SimpleNamespace(
        cfg=types.SimpleNamespace(admin=listener),
        state=state.ClusterState(),
        caught_up=caught_up,
        leading=False,
        admin_url="",
    )
    runner = await admin.start(svc)  # type: ignore[arg-type]
    try:
        yield svc.admin_url, pki.client_tls("operator", "alice") if https else None
    finally:
        await runner.cleanup()


async def test_the_control_admin_api_cuts_a_trickled_head_with_408(
    control_admin: tuple[str, ssl.SSLContext | None],
) -> None:
    url, tls = control_admin
    await asyncio.to_thread(cuts_a_trickled_head, url, tls)
    await asyncio.to_thread(serves_a_head_sent_at_once, url, tls)


async def test_the_control_admin_api_closes_a_silent_connection_at_the_head_deadline(
    control_admin: tuple[str, ssl.SSLContext | None],
) -> None:
    url, tls = control_admin
    await asyncio.to_thread(closes_a_silent_connection, url, tls)
    await asyncio.to_thread(serves_a_kept_alive_connection_after_an_idle_spell, url, tls)


async def test_the_control_admin_api_neither_echoes_nor_logs_a_malformed_key(
    control_admin: tuple[str, ssl.SSLContext | None], logged: Log
) -> None:
    url, tls = control_admin
    await asyncio.to_thread(answers_a_malformed_key_quietly, url, logged, tls)


async def test_the_control_admin_api_never_inflates_a_body(
    control_admin: tuple[str, ssl.SSLContext | None],
) -> None:
    url, tls = control_admin
    await asyncio.to_thread(refuses_a_gzip_bomb, url, loop_cpu_clock(), tls)
    await asyncio.to_thread(serves_an_uncompressed_body, url, tls)


# ------------------------------------------------------------------ the agent


@contextlib.asynccontextmanager
async def serving_agent_admin(head_timeout_s: float) -> AsyncIterator[str]:
    """The agent's admin listener (`metrics.serve`) with this head deadline: its URL."""
    live = metrics.Live(started=True, connected=True, outbox_events=0, outbox_bytes=0)
    where = agent_config.AdminListener(host="127.0.0.1", port=0, header_timeout_s=head_timeout_s)
    runner, url = await metrics.serve(metrics.AgentMetrics(lambda: live), where)
    assert runner is not None
    try:
        yield url
    finally:
        await runner.cleanup()


@pytest.fixture
async def agent_admin() -> AsyncIterator[str]:
    async with serving_agent_admin(HEAD_TIMEOUT_S) as url:
        yield url


async def test_the_agent_admin_listener_cuts_a_trickled_head_with_408(agent_admin: str) -> None:
    await asyncio.to_thread(cuts_a_trickled_head, agent_admin)
    await asyncio.to_thread(serves_a_head_sent_at_once, agent_admin)


async def test_the_agent_admin_listener_closes_a_silent_connection_at_the_head_deadline(
    agent_admin: str,
) -> None:
    await asyncio.to_thread(closes_a_silent_connection, agent_admin)
    await asyncio.to_thread(serves_a_kept_alive_connection_after_an_idle_spell, agent_admin)


async def test_a_head_sent_in_pieces_within_the_deadline_is_served() -> None:
    """The deadline runs from the connect, and a client that sends its head in pieces
    well within it is served: a deadline long enough that a busy machine's delays do not
    matter, the pieces spread over a fifth of it."""
    async with serving_agent_admin(10.0) as url:
        answer = await asyncio.to_thread(raw_http.in_pieces, url, "/health", pieces=4, every_s=0.5)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]


async def test_the_agent_admin_listener_neither_echoes_nor_logs_a_malformed_key(
    agent_admin: str, logged: Log
) -> None:
    await asyncio.to_thread(answers_a_malformed_key_quietly, agent_admin, logged)


async def test_the_agent_admin_listener_never_inflates_a_body(agent_admin: str) -> None:
    await asyncio.to_thread(refuses_a_gzip_bomb, agent_admin, loop_cpu_clock())
    await asyncio.to_thread(serves_an_uncompressed_body, agent_admin)


# ------------------------------------------------------------------ the console


@pytest.fixture(params=["http", "https"])
async def console(
    request: pytest.FixtureRequest, nats_server: TestNatsServer, tmp_path: Path
) -> AsyncIterator[tuple[str, ssl.SSLContext | None, Path, int]]:
    """`llmgw console` with a 1 s head deadline, on loopback (its token) or over HTTPS
    (operator certificates): its URL, the TLS a client needs, its log and its process id."""
    control = await connect_as(nats_server, "control", "control-a")
    await bus.provision(control.jetstream())
    await control.close()
    https = request.param == "https"
    certs = nats_server.pki.certs
    tls_args = ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key)]
    argv = console_argv(nats_server, "--header-timeout-s", str(HEAD_TIMEOUT_S),
                        *(tls_args if https else []))  # fmt: skip
    log = tmp_path / "console.log"
    service = Service("console", argv, log, r"llmgw console at (https?://\S+) as ")
    url = (await asyncio.to_thread(service.start)).group(1)
    assert service.proc is not None
    try:
        tls = nats_server.pki.client_tls("operator", "alice") if https else None
        yield url, tls, log, service.proc.pid
    finally:
        service.terminate()


async def test_the_console_cuts_a_trickled_head_with_408(
    console: tuple[str, ssl.SSLContext | None, Path, int],
) -> None:
    url, tls, _, _ = console
    await asyncio.to_thread(cuts_a_trickled_head, url, tls)
    # Without its token a loopback console answers 401; with an operator's certificate, 200.
    await asyncio.to_thread(
        serves_a_head_sent_at_once, url, tls, "/api/events", 200 if tls else 401
    )


async def test_the_console_closes_a_silent_connection_at_the_head_deadline(
    console: tuple[str, ssl.SSLContext | None, Path, int],
) -> None:
    url, tls, _, _ = console
    await asyncio.to_thread(closes_a_silent_connection, url, tls)


async def test_the_console_neither_echoes_nor_logs_a_malformed_key(
    console: tuple[str, ssl.SSLContext | None, Path, int],
) -> None:
    url, tls, log, _ = console
    await asyncio.to_thread(
        answers_a_malformed_key_quietly, url, lambda: log.read_text(errors="replace"), tls
    )


async def test_the_console_never_inflates_a_body(
    console: tuple[str, ssl.SSLContext | None, Path, int],
) -> None:
    url, tls, _, pid = console
    await asyncio.to_thread(refuses_a_gzip_bomb, url, lambda: raw_http.cpu_s(pid), tls, "/")
    # Without its token a loopback console answers 401; with an operator's certificate, 200.
    await asyncio.to_thread(
        serves_an_uncompressed_body, url, tls, "/api/events", 200 if tls else 401
    )

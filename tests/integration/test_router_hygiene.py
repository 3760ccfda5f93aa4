"""HTTP hygiene of a real `llmgw router` (and `llmgw sim`) over real sockets.

A second router on a taken port fails to start instead of sharing it, a router
restarted at once binds its ports despite its last run's closed connections, a worker
that dies, during its start or after, ends the whole router saying so, and a router tells
systemd it is ready and leaves no temporary folder behind; malformed
requests get a 400 that quotes nothing they sent, and a log line without a
traceback; deeply nested JSON is a 400; a request head that trickles in, or is
sent at once and never finished, is cut with a 408, on the admin listener too (and
a `/route` body that never ends); a connection that sends nothing is closed once the
head deadline has passed since its connect, on both listeners, and a kept-alive one's
next request after a longer idle spell is served; the `Bearer` scheme is
case-insensitive.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.router import auth
from tests.integration.router_kit import Router, Sim
from tests.kit.raw_http import (
    SECRET,
    addr,
    exchange,
    kept_alive,
    logged_without_the_key,
    silent,
    trickle,
    unfinished_head,
)

pytestmark = pytest.mark.slow

HEAD_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
EARLY_S = 0.2
"""How much before its deadline a close may be seen (timer granularity), and no more."""


@pytest.fixture(scope="module")
def sim() -> Iterator[Sim]:
    s = Sim.start("m", "--eos-min-tokens", "2", "--eos-max-tokens", "2")
    yield s
    s.stop()


class Keyed(NamedTuple):
    router: Router
    key: str
    log: Path


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, sim: Sim) -> Iterator[Keyed]:
    """A router with one API key, its stderr in `log`."""
    tmp: Path = tmp_path_factory.mktemp("router-hygiene")
    key = auth.new_key()
    keys = tmp / "keys.yaml"
    keys.write_text("keys:\n" + auth.entry_yaml("k", key))
    r = Router.start(
        tmp,
        {"s": sim},
        auth={"keys_file": str(keys)},
        header_timeout_s=HEAD_TIMEOUT_S,
        body_timeout_s=BODY_TIMEOUT_S,
        log=tmp / "router.log",
    )
    yield Keyed(r, key, tmp / "router.log")
    r.stop()


def _models(url: str, authorization: str) -> int:
    req = urllib.request.Request(url + "/v1/models", headers={"Authorization": authorization})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


# ------------------------------------------------------------------ a taken port


def _second_router(
    tmp: Path, cfg: dict[str, object], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    path = tmp / f"second-{len(list(tmp.glob('second-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return subprocess.run(
        [sys.executable, "-m", "llmgw", "router", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@pytest.mark.parametrize("first_workers", [1, 2])
def test_a_second_router_on_a_taken_port_fails_and_the_first_keeps_all_traffic(
    tmp_path: Path, sim: Sim, first_workers: int
) -> None:
    key = auth.new_key()
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n" + auth.entry_yaml("k", key))
    first = Router.start(tmp_path, {"s": sim}, workers=first_workers, auth={"keys_file": str(keys)})
    try:
        host, port = addr(first.url)
        _, admin_port = addr(first.admin)
        base: dict[str, object] = {
            "models": [{"name": "m"}],
            "endpoints": [{"id": "s", "url": sim.url, "models": ["m"]}],
            "auth": {"allow_anonymous": True},
        }
        for workers in (1, 2):
            for taken, free, setting in (
                ("listen", "admin", "listen.port"),
                ("admin", "listen", "admin.port"),
            ):
                used = port if taken == "listen" else admin_port
                cfg = {
                    **base,
                    "workers": workers,
                    taken: {"host": host, "port": used},
                    free: {"host": host, "port": 0},
                }
                done = _second_router(tmp_path, cfg)
                assert done.returncode == 1, (done.stdout, done.stderr)
                assert f"{host}:{used} ({setting}) is taken by another process" in done.stderr
                assert "Traceback" not in done.stderr
                assert "listening on" not in done.stdout
        # Every request still reaches the first router (the anonymous second one would
        # have answered 200 to a request without a key).
        assert [_models(first.url, "Bearer wrong") for _ in range(20)] == [401] * 20
        assert _models(first.url, f"Bearer {key}") == 200
    finally:
        first.stop()


def _health(url: str) -> int:
    """`GET /health` on a connection of its own, which the router closes after answering
    (urllib asks it to): the router's end of it waits in TIME_WAIT, on the router's port."""
    with urllib.request.urlopen(url + "/health", timeout=10) as resp:
        return int(resp.status)


def test_a_router_restarted_at_once_binds_its_port_despite_the_last_runs_connections(
    tmp_path: Path, sim: Sim
) -> None:
    first = Router.start(tmp_path, {"s": sim})
    host, port = addr(first.url)
    try:
        assert [_health(first.url) for _ in range(3)] == [200] * 3
        assert [_health(first.admin) for _ in range(3)] == [200] * 3
    finally:
        assert first.stop() == 0
    _, admin_port = addr(first.admin)
    again = Router.start(tmp_path, {"s": sim}, listen={"host": host, "port": port},
                         admin={"host": host, "port": admin_port})  # fmt: skip
    try:
        assert (_health(again.url), _health(again.admin)) == (200, 200)
    finally:
        again.stop()


def _backlog(port: int) -> int:
    """The backlog of the socket listening on `port`, as the kernel holds it (`ss`: a
    listener's Send-Q)."""
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True,
                         check=True).stdout.split()  # fmt: skip
    return int(out[2])


@pytest.mark.parametrize("workers", [1, 2])
def test_the_api_listener_queues_thousands_of_connections_not_aiohttps_128(
    tmp_path: Path, sim: Sim, workers: int
) -> None:
    """A thousand clients connecting at once overflowed the 128 that aiohttp's site listens
    with again as it starts (over the router's own 4096), and some of their requests were
    reset after they were sent."""
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    router = Router.start(tmp_path, {"s": sim}, workers=workers)
    try:
        assert _backlog(addr(router.url)[1]) == min(4096, somaxconn)
        assert _backlog(addr(router.admin)[1]) == min(128, somaxconn)
    finally:
        router.stop()


def test_a_worker_that_dies_during_start_ends_the_router_saying_which(
    tmp_path: Path, sim: Sim
) -> None:
    """Every worker process exits before it listens (a `sitecustomize` that ends any
    process multiprocessing spawns): the router exits 1 saying which worker and its exit
    code, not click's bare "Aborted." of the EOFError its closed pipe raised."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, sys\nif 'multiprocessing.spawn' in ' '.join(sys.orig_argv):\n    os._exit(3)\n"
    )
    cfg = {
        "models": [{"name": "m"}],
        "endpoints": [{"id": "s", "url": sim.url, "models": ["m"]}],
        "auth": {"allow_anonymous": True},
        "workers": 2,
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"host": "127.0.0.1", "port": 0},
    }
    done = _second_router(tmp_path, cfg, env={**os.environ, "PYTHONPATH": str(site)})
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "router worker router-0 exited during start (code 3)" in done.stderr
    assert "listening on" not in done.stdout


def _worker_pids(router: Router) -> list[int]:
    """The router's worker processes: its children that run `spawn_main` (not
    multiprocessing's resource tracker, which runs `python -c` too)."""
    children = Path(f"/proc/{router.pid}/task/{router.pid}/children").read_text().split()
    return [int(pid) for pid in children
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]  # fmt: skip


def test_a_worker_that_dies_ends_the_router_rather_than_serve_on_half_its_workers(
    tmp_path: Path, sim: Sim
) -> None:
    """A worker killed (the OOM killer, a crash): the router stops its other workers and
    exits 1, logging which one died, so that its supervisor restarts it whole."""
    router = Router.start(tmp_path, {"s": sim}, workers=2)
    try:
        workers = _worker_pids(router)
        assert len(workers) == 2, workers
        os.kill(workers[0], signal.SIGKILL)
        assert router.proc is not None
        assert router.proc.wait(60) == 1
    finally:
        router.stop()
    assert router.log_path is not None
    assert "worker_died" in router.log_path.read_text()
    for pid in workers[1:]:
        assert (
            not Path(f"/proc/{pid}").exists()
            or b"spawn_main" not in Path(f"/proc/{pid}/cmdline").read_bytes()
        )


@pytest.mark.parametrize("workers", [1, 2])
def test_a_router_tells_systemd_it_is_ready_and_leaves_no_folder_of_its_own_behind(
    tmp_path: Path, sim: Sim, workers: int
) -> None:
    """`Type=notify` units: READY=1 on $NOTIFY_SOCKET once every worker listens. Several
    workers share their metrics and rate limits through a folder the router makes in
    $TMPDIR; it is gone once the router stops."""
    path = tmp_path / "notify.sock"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(str(path))
        notify.settimeout(60)
        env = {"NOTIFY_SOCKET": str(path), "TMPDIR": str(tmp)}
        router = Router.start(tmp_path, {"s": sim}, workers=workers, env=env)
        try:
            assert notify.recv(4096) == b"READY=1"
            shared = list(tmp.glob("llmgw-router-metrics-*"))
            assert len(shared) == (workers > 1), shared
        finally:
            assert router.stop() == 0
    assert list(tmp.glob("llmgw-router-metrics-*")) == []


# ------------------------------------------------------------------ malformed requests


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (f"Bearer {SECRET}\x01tail", "invalid_header"),
        (f"Bearer {SECRET}" + "x" * 9000, "line_too_long"),
    ],
)
def test_a_malformed_authorization_header_is_never_echoed(
    keyed: Keyed, value: str, problem: str
) -> None:
    router = keyed.router
    host, _ = addr(router.url)
    raw = (f"GET /v1/models HTTP/1.1\r\nHost: {host}\r\nAuthorization: {value}\r\n\r\n").encode(
        "latin-1"
    )
    answer = exchange(router.url, raw)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith((b"HTTP/1.1 400", b"HTTP/1.0 400")), answer[:300]
    assert SECRET.encode() not in answer
    err = json.loads(body)["error"]
    assert err["code"] == "bad_http_request"
    assert err["type"] == "invalid_request_error"
    _logged_without_the_key(keyed, problem, 0)


def test_the_admin_listener_neither_echoes_nor_logs_a_malformed_key(keyed: Keyed) -> None:
    """`POST /route` takes a tenant's key too, and Prometheus's network reaches the admin
    listener: a malformed header there is answered and logged like the front door's."""
    router = keyed.router
    host, _ = addr(router.admin)
    raw = (
        f"POST /route HTTP/1.1\r\nHost: {host}\r\nContent-Length: 2\r\n"
        f"Authorization: Bearer {SECRET}\x01tail\r\n\r\n{{}}"
    ).encode("latin-1")
    logged_before = keyed.log.read_text(errors="replace").count("invalid_header")
    answer = exchange(router.admin, raw)
    assert answer.startswith((b"HTTP/1.1 400", b"HTTP/1.0 400")), answer[:300]
    assert SECRET.encode() not in answer
    _logged_without_the_key(keyed, "invalid_header", logged_before)


def _logged_without_the_key(keyed: Keyed, problem: str, before: int) -> None:
    logged_without_the_key(lambda: keyed.log.read_text(errors="replace"), problem, before)


def test_a_request_head_sent_at_once_and_never_finished_gets_408(keyed: Keyed) -> None:
    """The head's bytes arrive with the connection (before aiohttp's handler first waits
    for a request): the deadline runs from them all the same."""
    answer = unfinished_head(keyed.router.url)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]


def test_the_admin_listener_cuts_an_unfinished_head_with_408(keyed: Keyed) -> None:
    """Reachable wherever Prometheus scrapes: a head that never ends must not hold a
    connection of the router's process for aiohttp's hour-long keep-alive."""
    answer = unfinished_head(keyed.router.admin)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]


@pytest.mark.parametrize("listener", ["url", "admin"])
def test_a_silent_connection_is_closed_at_the_head_deadline(keyed: Keyed, listener: str) -> None:
    """A connection that never sends a byte holds a file descriptor of the router's: it is
    closed, unanswered, the head deadline after its connect (not before)."""
    answer, took = silent(getattr(keyed.router, listener), wait_s=30)
    assert answer == b"", answer[:300]
    assert HEAD_TIMEOUT_S - EARLY_S <= took < 30


def test_a_kept_alive_connection_is_served_after_an_idle_spell(keyed: Keyed) -> None:
    """The deadline covers a connection's first head, not the wait for its next request."""
    first, second = kept_alive(keyed.router.url, "/health", idle_s=2.5 * HEAD_TIMEOUT_S)
    assert first.startswith(b"HTTP/1.1 200"), first[:300]
    assert second.startswith(b"HTTP/1.1 200"), second[:300]


def test_the_admin_listener_cuts_an_unfinished_route_body_with_408(keyed: Keyed) -> None:
    """A head sent whole, then a body that never ends: cut as the front door cuts one."""
    router = keyed.router
    host, _ = addr(router.admin)
    raw = (
        f"POST /route HTTP/1.1\r\nHost: {host}\r\nContent-Length: 100\r\n"
        f'Authorization: Bearer {keyed.key}\r\n\r\n{{"model"'
    ).encode()
    answer = exchange(router.admin, raw, timeout=120)  # until the router closes
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]


# Control characters other than CR and LF (which end the header line) and HTAB (allowed).
CONTROL = st.sampled_from([bytes([c]) for c in (*range(9), *range(11, 13), *range(14, 32), 127)])


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    before=st.binary(max_size=20).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")),
    control=CONTROL,
    after=st.binary(max_size=20).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")),
)
def test_no_header_value_is_ever_echoed(
    keyed: Keyed, before: bytes, control: bytes, after: bytes
) -> None:
    router = keyed.router
    value = b"Bearer " + SECRET.encode() + before + control + after
    raw = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: " + value + b"\r\n\r\n"
    answer = exchange(router.url, raw)
    assert answer.startswith((b"HTTP/1.1 4", b"HTTP/1.0 4")), answer[:300]
    assert SECRET.encode() not in answer
    assert value not in answer


def test_deeply_nested_json_is_a_400_from_the_router_and_the_sim(keyed: Keyed, sim: Sim) -> None:
    router, key = keyed.router, keyed.key
    depth = 100_000
    body = (
        b'{"model":"m","messages":[{"role":"user","content":"x"}],"x":'
        + b"[" * depth
        + b"]" * depth
        + b"}"
    )
    for url, data, headers in (
        (router.url + "/v1/chat/completions", body, {"Authorization": f"Bearer {key}"}),
        (sim.url + "/v1/chat/completions", body, {}),
    ):
        req = urllib.request.Request(
            url,
            data=data,
            headers={"Content-Type": "application/json", **headers},
        )
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=20)
        assert info.value.code == 400, url
        err = json.loads(info.value.read())["error"]
        assert "nested" in err["message"], err


def test_a_request_head_that_trickles_in_gets_408(keyed: Keyed) -> None:
    router, key = keyed.router, keyed.key
    host, _ = addr(router.url)
    start = f"GET /v1/models HTTP/1.1\r\nHost: {host}\r\n".encode()
    # One header line every 0.25 s, for far longer than the deadline.
    lines = (f"X-Slow-{i}: {i}\r\n".encode() for i in range(200))
    answer, took = trickle(router.url, start, lines, every_s=0.25)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b'"code":"request_timeout"' in answer
    assert HEAD_TIMEOUT_S - EARLY_S <= took < HEAD_TIMEOUT_S + 20
    # A head sent at once is served on a new connection.
    assert _models(router.url, f"Bearer {key}") == 200


def test_the_bearer_scheme_is_case_insensitive(keyed: Keyed) -> None:
    router, key = keyed.router, keyed.key
    for scheme in ("Bearer", "bearer", "BEARER"):
        assert _models(router.url, f"{scheme} {key}") == 200, scheme
    assert _models(router.url, f"Basic {key}") == 401


@pytest.mark.parametrize("header", [b"Authorization: Bearer ", b"x-api-key: "])
@pytest.mark.parametrize("tail", [b"\xff", b"\xc3", b"\xed\xa0\x80", "\u00e9".encode()])
def test_a_key_with_bytes_past_ascii_is_refused_as_unknown_not_failed(
    keyed: Keyed, header: bytes, tail: bytes
) -> None:
    """A key's bytes that are not UTF-8 (or no character at all) are a key no entry holds:
    a 401 like any wrong key's, not a 500."""
    router, key = keyed.router, keyed.key
    host, _ = addr(router.url)
    raw = (
        f"GET /v1/models HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n".encode()
        + header + key.encode() + tail + b"\r\n\r\n"
    )  # fmt: skip
    answer = exchange(router.url, raw)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 401"), answer[:300]
    assert json.loads(body)["error"]["code"] == "invalid_api_key"
    assert _models(router.url, f"Bearer {key}") == 200


@pytest.mark.parametrize(
    "second",
    [
        b"Authorization: Bearer {other}",
        b"authorization: Bearer {key}",
        b"X-Api-Key: {other}",
        b"x-api-key: {other}",  # beside Authorization's key: a different one
    ],
)
@pytest.mark.parametrize("path", [b"GET /v1/models", b"POST /v1/chat/completions"])
def test_a_key_sent_twice_is_a_400_on_every_path(keyed: Keyed, second: bytes, path: bytes) -> None:
    """Two Authorization headers (or two x-api-key, or one of each with different keys)
    make which key counts a choice a proxy in front may make the other way: the real router
    refuses the request with a 400 before any model is asked, even when both copies of a
    header hold the same valid key."""
    router, key = keyed.router, keyed.key
    host, _ = addr(router.url)
    first = b"Authorization: Bearer " + key.encode()
    if second.startswith(b"X-Api-Key"):
        first = b"x-api-key: " + key.encode()
    extra = second.replace(b"{key}", key.encode()).replace(b"{other}", auth.new_key().encode())
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    raw = (
        path + f" HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n".encode() + first
        + b"\r\n" + extra + b"\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode() + b"\r\n\r\n" + body
    )  # fmt: skip
    answer = exchange(router.url, raw)
    head, _, answered = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer[:300]
    assert json.loads(answered)["error"]["code"] == "ambiguous_api_key"
    assert _models(router.url, f"Bearer {key}") == 200  # sent once, it is served


def _route(admin: str, body: bytes, authorization: str | None) -> tuple[int, dict[str, object]]:
    headers = {"Authorization": authorization} if authorization is not None else {}
    req = urllib.request.Request(admin + "/route", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_route_asks_for_a_key_that_may_use_the_model(tmp_path: Path, sim: Sim) -> None:
    """Which prompts an engine holds is a tenant's secret: the admin listener's /route,
    which Prometheus's network may reach, answers only a caller the front door would serve
    (a key that may use the model), never for a missing, unknown or other model's key,
    whatever the body; on a router that takes anonymous requests it stays open."""
    ok, elsewhere = auth.new_key(), auth.new_key()
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n" + auth.entry_yaml("ok", ok) + auth.entry_yaml("elsewhere",
                    elsewhere, ("other",)))  # fmt: skip
    r = Router.start(tmp_path, {"s": sim}, auth={"keys_file": str(keys)})
    try:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        asked = body.encode()
        for authorization in (None, "", "Bearer", "Bearer sk-not-a-key", f"Basic {ok}",
                              f"Bearer {ok}x"):  # fmt: skip
            status, answer = _route(r.admin, asked, authorization)
            assert status == 401, (authorization, answer)
            assert "endpoints" not in answer
        status, answer = _route(r.admin, asked, f"Bearer {elsewhere}")
        assert status == 404, answer  # as a model that does not exist
        assert "endpoints" not in answer
        # A model the router does not serve is a 404, as at the front door.
        status, answer = _route(r.admin, b'{"model": "other", "prompt": "hi"}', f"Bearer {ok}")
        assert status == 404, answer
        status, answer = _route(r.admin, asked, f"Bearer {ok}")
        assert status == 200, answer
        assert answer["model"] == "m"
        assert [row["id"] for row in answer["endpoints"]] == ["s"]  # type: ignore[union-attr]
    finally:
        r.stop()
    anonymous = Router.start(tmp_path, {"s": sim}, auth={"allow_anonymous": True})
    try:
        status, answer = _route(anonymous.admin, asked, None)
        assert (status, answer["model"]) == (200, "m")
    finally:
        anonymous.stop()

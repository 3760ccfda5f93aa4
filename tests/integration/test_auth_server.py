"""The nats-server configuration llmgw renders, checked by the real binary, and the server's
lifecycle as the harness and `llmgw up` drive it (start, restart on the same store, reload)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
from pathlib import Path

import nats
import pytest

from llmgw import natsconf, natsd
from llmgw.core import subjects
from llmgw.pki import authorization
from llmgw.pki.identity import KINDS, Identity
from llmgw.pki.store import CertDir
from tests.harness import Connector, TestNatsServer, TestPki, wait_for

REPO = Path(__file__).resolve().parents[2]


def check(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [natsd.binary(), "-t", "-c", str(config)],
        capture_output=True,
        text=True,
        errors="replace",  # a path's undecodable bytes, quoted in the server's words
        timeout=30,
        check=False,
    )


def test_checked_in_config_is_what_llmgw_renders() -> None:
    rendered = natsconf.render_config(natsconf.DEFAULT_CONFIG, natsconf.DEFAULT_HEADER)
    assert (REPO / "nats" / "llmgw.conf").read_text() == rendered, (
        "nats/llmgw.conf drifted from llmgw.natsconf.DEFAULT_CONFIG: regenerate it with "
        "render_config(DEFAULT_CONFIG, DEFAULT_HEADER)"
    )
    assert "sync_interval: always" in rendered
    assert 'listen: "127.0.0.1:4222"' in rendered
    assert 'http: "127.0.0.1:8222"' in rendered
    assert "verify_and_map: true" in rendered


def assert_server_reads(folder: Path, certs: CertDir) -> None:
    """Render a server config in `folder` (beside its authorization.conf) with the server
    files of `certs`, and check that nats-server reads it."""
    cfg = natsconf.ServerConfig(
        store_dir=folder / "js",
        cert_file=certs.server_cert,
        key_file=certs.server_key,
        ca_file=certs.ca_cert,
        authorization_file=Path("authorization.conf"),
        port=natsd.free_port(),
        http_port=None,
    )
    (folder / "nats.conf").write_text(natsconf.render_config(cfg))
    result = check(folder / "nats.conf")
    assert result.returncode == 0, result.stderr
    assert "is valid" in result.stdout + result.stderr


def test_rendered_authorization_for_many_identities_is_accepted(
    pki: TestPki, tmp_path: Path
) -> None:
    ids = [Identity(kind, f"{kind}-{i}") for kind in KINDS for i in range(25)]
    (tmp_path / "authorization.conf").write_text(
        authorization.render(ids, superusers=["CN=admin,OU=test,O=llmgw-test"])
    )
    assert_server_reads(tmp_path, pki.certs)


@pytest.mark.parametrize(
    "folder", ["fleet-é", 'josé\'s "fleet"', "tab\tand\\back", "ctl\x01", "bytes-\udcff"]
)
def test_any_state_directory_renders_a_config_the_server_reads(
    pki: TestPki, tmp_path: Path, folder: str
) -> None:
    # Paths were quoted as JSON, whose \u00e9 nats-server refuses ("Invalid escape
    # character 'u'"): `llmgw up --state-dir ~/fleet-é` could not start its server.
    root = tmp_path / folder
    root.mkdir()
    for source in (pki.certs.server_cert, pki.certs.server_key, pki.certs.ca_cert):
        shutil.copy(source, root / source.name)
    (root / "authorization.conf").write_text(authorization.render([]))
    assert_server_reads(root, CertDir(root))


def test_an_absolute_include_path_is_refused_with_the_reason(pki: TestPki) -> None:
    cfg = natsconf.ServerConfig(
        store_dir=Path("js"),
        cert_file=pki.certs.server_cert,
        key_file=pki.certs.server_key,
        ca_file=pki.certs.ca_cert,
        authorization_file=Path("/etc/authorization.conf"),
    )
    with pytest.raises(ValueError, match="relative to the config file's folder"):
        natsconf.render_config(cfg)


def test_a_broken_config_fails_start_with_the_servers_words(tmp_path: Path) -> None:
    config = tmp_path / "bad.conf"
    config.write_text("listen: 127.0.0.1:1\ntls { cert_file: missing.pem }\n")
    server = natsd.NatsServer(config, port=1, log_path=tmp_path / "log")
    with pytest.raises(natsd.NatsServerError, match="exited while starting"):
        server.start(timeout_s=5)


async def test_restart_keeps_the_port_and_the_stream(
    connect: Connector, nats_server: TestNatsServer
) -> None:
    back = asyncio.Event()

    async def reconnected() -> None:
        back.set()

    control = await connect("control", "control-1", reconnected_cb=reconnected)
    js = control.jetstream()
    await js.add_stream(name=subjects.STREAM, subjects=list(subjects.STREAM_SUBJECTS))
    await js.publish(subjects.control_event("leader_elected"), b"{}")
    port, pid = nats_server.port, nats_server.pid

    nats_server.stop()
    assert not nats_server.running
    nats_server.start()
    assert nats_server.port == port
    assert nats_server.pid != pid

    # The harness's clients reconnect on their own. (A flush sent before the client noticed
    # the disconnect would wait for a PONG that never comes: wait for the reconnect.)
    await asyncio.wait_for(back.wait(), 5)
    info = await js.stream_info(subjects.STREAM)
    assert info.state.messages == 1
    ack = await js.publish(subjects.control_event("leader_elected"), b"{}")
    assert ack.seq == 2


async def test_a_crashed_server_restarts_with_its_acknowledged_writes(
    pki: TestPki, tmp_path: Path
) -> None:
    # A process crash (SIGKILL) loses no acknowledged write even without fsync: the data had
    # reached the OS. What `sync_interval: always` adds — surviving a power loss — cannot be
    # shown here; this server uses it anyway, as nats/llmgw.conf does.
    server = TestNatsServer(pki, tmp_path, sync_interval="always")
    server.start()
    try:
        connector = Connector(server)
        back = asyncio.Event()

        async def reconnected() -> None:
            back.set()

        control = await connector("control", "control-1", reconnected_cb=reconnected)
        js = control.jetstream()
        await js.add_stream(name=subjects.STREAM, subjects=list(subjects.STREAM_SUBJECTS))
        for _ in range(20):
            await js.publish(subjects.control_event("leader_elected"), b"{}")
        server.kill()
        server.start()
        await asyncio.wait_for(back.wait(), 5)
        assert (await js.stream_info(subjects.STREAM)).state.messages == 20
        await connector.close()
    finally:
        server.close()


async def test_reload_does_not_drop_connected_clients(
    connect: Connector, nats_server: TestNatsServer
) -> None:
    disconnects = 0

    async def on_disconnect() -> None:
        nonlocal disconnects
        disconnects += 1

    nc = await connect("router", "router-1", disconnected_cb=on_disconnect)
    for _ in range(3):
        nats_server.reload()
    await nc.flush(timeout=2)
    assert nc.is_connected
    assert disconnects == 0


async def test_new_certificates_reload_the_server_while_clients_subscribe_and_it_survives(
    connect: Connector, nats_server: TestNatsServer
) -> None:
    """Every issued certificate is a reload, and clients subscribe at any time (each reconnect,
    each reader). nats-server 2.11 to 2.15 crash (a nil sublist in addShadowSub) when a reload
    races a subscription in an account that imports a stream; with the inbox imported as a
    stream, as llmgw once rendered it, this crashed within three reloads."""
    stop = asyncio.Event()
    rounds: dict[str, int] = {}

    async def churn(kind: str, name: str) -> None:
        nc = await connect(kind, name)
        prefix = Identity(kind, name).inbox_prefix  # type: ignore[arg-type]
        n = 0
        while not stop.is_set():
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                sub = await nc.subscribe(f"{prefix}.churn.{n}")
                await sub.unsubscribe()
                await nc.request(f"{authorization.API}.INFO", b"", timeout=2)
            n += 1
            rounds[name] = n

    churners = [
        asyncio.create_task(churn(kind, name))
        for kind, name in [("node", "churn-node"), ("router", "churn-router"), ("control", "c")]
    ]
    try:
        await asyncio.sleep(0.2)
        for i in range(6):
            await asyncio.to_thread(nats_server.pki.issue, Identity("node", f"reloaded-{i}"))
            assert nats_server.running, "nats-server died in a reload:\n" + nats_server.log_tail()
    finally:
        stop.set()
        await asyncio.gather(*churners, return_exceptions=True)
    assert "panic" not in nats_server.log_tail(400)
    assert sorted(rounds) == ["c", "churn-node", "churn-router"], rounds
    assert all(n > 0 for n in rounds.values()), rounds
    # The last identity issued connects and is answered. Its account's service imports are
    # wired by the second of its two reloads; on a loaded server a first request can still
    # find no responders for a moment, so ask until answered (bounded).
    nc = await connect("node", "reloaded-5")

    async def answered() -> bool:
        try:
            return bool((await nc.request(f"{authorization.API}.INFO", b"", timeout=2)).data)
        except nats.errors.NoRespondersError:
            return False

    await wait_for(answered, 20, "the newest identity answered", every_s=0.2)


async def test_stopped_server_refuses_and_reports_clearly(nats_server: TestNatsServer) -> None:
    nats_server.stop()
    with pytest.raises(Exception):  # noqa: B017, PT011 - nats-py raises per platform
        await nats.connect(
            nats_server.url,
            tls=nats_server.pki.client_tls("router", "router-1"),
            allow_reconnect=False,
            connect_timeout=1,
            # nats-py retries a refused initial connect max_reconnect_attempts times
            # (default 60 x 2 s) whatever allow_reconnect says; 0 means forever.
            max_reconnect_attempts=1,
            reconnect_time_wait=0.05,
        )
    with pytest.raises(natsd.NatsServerError, match="not running"):
        natsd.NatsServer(nats_server.config_path).reload()


def test_checked_in_cluster_configs_are_what_llmgw_renders() -> None:
    for index in range(1, natsconf.CLUSTER_SIZE + 1):
        path = REPO / "nats" / "cluster" / f"nats-{index}.conf"
        assert path.read_text() == natsconf.render_cluster_member(index), (
            f"{path} drifted from llmgw.natsconf.cluster_member_config: regenerate it with "
            f"render_cluster_member({index})"
        )

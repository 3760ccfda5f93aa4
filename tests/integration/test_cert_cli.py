"""`llmgw ctl cert` end to end, as an operator runs it from the repository root: init, then
`nats-server -c nats/llmgw.conf` (the checked-in file, only its ports moved to free ones),
then issuing a node while the server runs admits it through the pid file and a reload,
and removing it shuts it out."""

from __future__ import annotations

import asyncio
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import nats
import pytest
from cryptography import x509
from nats.aio.client import Client

from llmgw import bus, natsconf, natsd
from llmgw.core import events, subjects
from llmgw.pki.identity import Identity
from llmgw.pki.store import CertDir

REPO = Path(__file__).resolve().parents[2]
LLMGW = [sys.executable, "-m", "llmgw"]


def llmgw(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LLMGW, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


async def connect(root: Path, identity: Identity, url: str, **options: object) -> Client:
    ctx = CertDir(root / "nats" / "certs").client_context(identity)
    return await nats.connect(
        url, tls=ctx, inbox_prefix=identity.inbox_prefix, connect_timeout=3, **options
    )


def reloads(log: Path) -> int:
    return log.read_text().count(natsd.RELOADED)


async def wait_reloads(log: Path, count: int) -> None:
    for _ in range(500):
        if reloads(log) >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"nats-server never reported reload #{count}")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A working directory shaped like the repository: nats/llmgw.conf on free ports."""
    (tmp_path / "nats").mkdir()
    text = (REPO / "nats" / "llmgw.conf").read_text()
    port, http = natsd.free_port(), natsd.free_port()
    text = text.replace('"127.0.0.1:4222"', f'"127.0.0.1:{port}"')
    text = text.replace('"127.0.0.1:8222"', f'"127.0.0.1:{http}"')
    assert f":{port}" in text
    assert f":{http}" in text
    (tmp_path / "nats" / "llmgw.conf").write_text(text)
    (tmp_path / "port").write_text(str(port))
    return tmp_path


async def test_init_then_nats_server_from_the_repository_root(root: Path) -> None:
    init = llmgw(root, "ctl", "cert", "init", "--host", "127.0.0.1", "--host", "localhost")
    assert init.returncode == 0, init.stderr
    assert "rendered nats/authorization.conf (2 identities)" in init.stdout
    certs = CertDir(root / "nats" / "certs")
    for key in (certs.ca_key, certs.server_key, certs.key(Identity("control", "control"))):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    again = llmgw(root, "ctl", "cert", "init")
    assert again.returncode == 2
    assert "a CA already exists" in again.stderr
    assert "--force" in again.stderr

    port = int((root / "port").read_text())
    log = root / "nats.log"
    server = natsd.NatsServer(
        Path("nats/llmgw.conf"), port=port, cwd=root, log_path=log, executable=natsd.binary()
    )
    server.start()
    try:
        url = server.url
        assert (root / "nats" / "nats-server.pid").read_text().strip() == str(server.pid)
        control = await connect(root, Identity("control", "control"), url)
        await control.jetstream().add_stream(
            name=subjects.STREAM, subjects=list(subjects.STREAM_SUBJECTS)
        )
        operator = await connect(root, Identity("operator", "admin"), url)
        cordon = events.NodeCordoned(id="c-1", ts=1.0, operator="admin", node="gpu-1")
        ack = await operator.jetstream().publish(events.subject_of(cordon), events.encode(cordon))
        assert ack.seq == 1

        # A node issued while the server runs is admitted by the reload `issue` signals.
        issued = llmgw(root, "ctl", "cert", "issue", "node", "gpu-1")
        assert issued.returncode == 0, issued.stderr
        assert f"reloaded nats-server (pid {server.pid})" in issued.stdout
        assert "valid until 20" in issued.stdout  # the date it ends, the CA's end at most
        await wait_reloads(log, 1)
        errors: list[Exception] = []

        async def error_cb(exc: Exception) -> None:
            errors.append(exc)

        node = await connect(
            root, Identity("node", "gpu-1"), url, error_cb=error_cb, allow_reconnect=False
        )
        beat = events.Heartbeat(id="hb-1", ts=2.0, node="gpu-1")
        ack = await node.jetstream().publish(events.subject_of(beat), events.encode(beat))
        assert ack.seq == 2

        # Its key is not replaced by accident.
        key_before = certs.key(Identity("node", "gpu-1")).read_bytes()
        twice = llmgw(root, "ctl", "cert", "issue", "node", "gpu-1")
        assert twice.returncode == 2
        assert "--force" in twice.stderr
        assert certs.key(Identity("node", "gpu-1")).read_bytes() == key_before

        listed = llmgw(root, "ctl", "cert", "list")
        assert listed.returncode == 0
        assert [line.split()[:2] for line in listed.stdout.splitlines()] == [
            ["node", "gpu-1"],
            ["operator", "admin"],
            ["control", "control"],
        ]

        bad = llmgw(root, "ctl", "cert", "issue", "node", "gpu.1")
        assert bad.returncode == 2
        assert "cannot be used in a NATS subject" in bad.stderr

        # The server certificate is re-issued for a new name clients dial, and applied by
        # the reload: a client that checks that name is refused before and accepted after.
        async def dial_as(hostname: str) -> None:
            nc = await connect(
                root,
                Identity("operator", "admin"),
                url,
                tls_hostname=hostname,
                allow_reconnect=False,
                max_reconnect_attempts=1,
            )
            await bus.close(nc)

        with pytest.raises(Exception, match=r"(?i)hostname|certificate"):
            await dial_as("nats.internal")
        kept = llmgw(root, "ctl", "cert", "server", "--host", "127.0.0.1")
        assert kept.returncode == 2
        assert "--force" in kept.stderr
        reissued = llmgw(
            root,
            "ctl",
            "cert",
            "server",
            "--host",
            "127.0.0.1",
            "--host",
            "nats.internal",
            "--force",
        )
        assert reissued.returncode == 0, reissued.stderr
        assert "reloaded nats-server" in reissued.stdout
        await wait_reloads(log, 2)
        await dial_as("nats.internal")

        # Removing it closes its connection at the reload and refuses the next one.
        removed = llmgw(root, "ctl", "cert", "remove", "node", "gpu-1")
        assert removed.returncode == 0, removed.stderr
        await wait_reloads(log, 3)
        for _ in range(300):
            if node.is_closed:
                break
            await asyncio.sleep(0.01)
        assert node.is_closed
        assert operator.is_connected  # everyone else stays connected
        await operator.close()
        await control.close()
    finally:
        server.stop()
    # nats-server leaves its pid file behind; a stale one must not be signalled.
    stale = llmgw(root, "ctl", "cert", "render")
    assert stale.returncode == 0, stale.stderr
    assert "no running nats-server found" in stale.stdout
    # Applied by hand as llmgw applies it: a new identity's account answers only after the
    # second reload.
    assert natsd.RELOAD_ROUNDS == 2
    assert "after two reloads" in stale.stdout


def test_issue_without_a_ca_says_to_run_init(tmp_path: Path) -> None:
    out = llmgw(tmp_path, "ctl", "cert", "issue", "node", "gpu-1")
    assert out.returncode == 2
    assert "llmgw ctl cert init" in out.stderr


def test_a_server_host_longer_than_a_cn_is_still_its_name(tmp_path: Path) -> None:
    host = "a" * 60 + ".example.com"  # a valid name of 72 characters
    out = llmgw(tmp_path, "ctl", "cert", "init", "--host", host, "--host", "127.0.0.1")
    assert out.returncode == 0, out.stderr
    cert = x509.load_pem_x509_certificate((tmp_path / "nats/certs/server.pem").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert host in sans.get_values_for_type(x509.DNSName)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("issue", "robot", "r1"), "robot"),
        (("issue", "node", "gpu.1"), "cannot be used in a NATS subject"),
        (("issue", "node", ""), "node"),
        (("remove", "node", "never-issued"), "no certificate for"),
        (("route", "nats-1"), "--host"),
        (("route", "nats.1", "--host", "10.0.0.5"), "cluster member name"),
        (("server", "--host", "a b", "--force"), "neither an IP address nor a host name"),
        (("init",), "a CA already exists"),
        # Tracebacks before: OverflowError (a date past 9999), NotADirectoryError (a path
        # under a file), for --days, --dir and --authorization.
        (("issue", "node", "n1", "--days", "99999999"), "3650"),
        (("init", "--dir", "nats/certs/ca.pem/x"), "nats/certs/ca.pem/x"),
        (("issue", "node", "n2", "--authorization", "nats/certs/ca.pem/a.conf"), "render"),
        # A certificate's CN holds 64 characters: a ValueError from cryptography before.
        (("issue", "node", "n" * 65), "at most 64"),
        (("server", "--host", "a" * 64 + ".example.com", "--force"), "63"),
        (("server", "--host", ("a" * 60 + ".") * 5 + "com", "--force"), "253"),
    ],
)
def test_bad_input_exits_2_saying_what_to_do(
    tmp_path: Path, args: tuple[str, ...], says: str
) -> None:
    assert llmgw(tmp_path, "ctl", "cert", "init", "--host", "127.0.0.1").returncode == 0
    out = llmgw(tmp_path, "ctl", "cert", *args)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert says in out.stderr
    assert "Traceback" not in out.stderr


def test_a_broken_certificate_or_pid_file_does_not_end_the_command(tmp_path: Path) -> None:
    # `cert list` ended in a ValueError traceback at the first file that was not a
    # certificate; a --pid-file naming a folder in an IsADirectoryError one, after issuing.
    assert llmgw(tmp_path, "ctl", "cert", "init", "--host", "127.0.0.1").returncode == 0
    (tmp_path / "nats" / "certs" / "operator" / "admin.pem").write_text("not a certificate\n")
    out = llmgw(tmp_path, "ctl", "cert", "list")
    assert out.returncode == 0, out.stderr
    assert "admin" in out.stdout
    assert "unreadable" in out.stdout
    assert "control" in out.stdout
    out = llmgw(tmp_path, "ctl", "cert", "issue", "node", "n1", "--pid-file", "nats")
    assert out.returncode == 0, out.stderr
    assert "no running nats-server found" in out.stdout


def test_llmgw_ctl_is_listed_in_help(tmp_path: Path) -> None:
    out = llmgw(tmp_path, "--help")
    assert out.returncode == 0
    assert "ctl" in out.stdout
    assert shutil.which("nats-server") or natsd.binary()


async def test_the_checked_in_cluster_runs_from_the_repository_root(tmp_path: Path) -> None:
    """nats/cluster/nats-{1,2,3}.conf as checked in (only their ports moved to free ones),
    after `llmgw ctl cert init` and `llmgw ctl cert route`: a replicated log that keeps
    acknowledging writes with one member down."""
    root = tmp_path
    (root / "nats" / "cluster").mkdir(parents=True)
    texts = [
        (REPO / "nats" / "cluster" / f"nats-{i}.conf").read_text()
        for i in range(1, natsconf.CLUSTER_SIZE + 1)
    ]
    ports: dict[int, int] = {}
    for base in (4221, 6221, 8221):
        for i in range(1, natsconf.CLUSTER_SIZE + 1):
            ports[base + i] = natsd.free_port()
    for i, text in enumerate(texts, start=1):
        # In one pass: one by one, a new port that begins with an old one (62223 after
        # 6222) was replaced again.
        moved = re.sub(
            r"127\.0\.0\.1:(\d+)\b",
            lambda m: f"127.0.0.1:{ports.get(int(m.group(1)), int(m.group(1)))}",
            text,
        )
        (root / "nats" / "cluster" / f"nats-{i}.conf").write_text(moved)

    assert llmgw(root, "ctl", "cert", "init", "--host", "127.0.0.1").returncode == 0
    for i in range(1, natsconf.CLUSTER_SIZE + 1):
        out = llmgw(root, "ctl", "cert", "route", f"nats-{i}", "--host", "127.0.0.1")
        assert out.returncode == 0, out.stderr
    refused = llmgw(root, "ctl", "cert", "route", "nats-1", "--host", "127.0.0.1")
    assert refused.returncode == 2
    assert "--force" in refused.stderr

    servers = [
        natsd.NatsServer(
            Path(f"nats/cluster/nats-{i}.conf"),
            port=ports[4221 + i],
            cwd=root,
            log_path=root / f"nats-{i}.log",
        )
        for i in range(1, natsconf.CLUSTER_SIZE + 1)
    ]
    try:
        for server in servers:
            server.start()
        urls = [s.url for s in servers]
        control = await connect(root, Identity("control", "control"), urls[0])
        js = control.jetstream(timeout=2)
        deadline = asyncio.get_running_loop().time() + 30
        while True:  # until the cluster has elected its JetStream meta leader
            try:
                await js.add_stream(
                    name=subjects.STREAM, subjects=list(subjects.STREAM_SUBJECTS), num_replicas=3
                )
                break
            except (nats.errors.TimeoutError, nats.js.errors.Error):
                assert asyncio.get_running_loop().time() < deadline, "no JetStream meta leader"
                await asyncio.sleep(0.2)
        # Closed before its server is stopped: nats-py's close() can wait forever on a
        # client that is in the middle of reconnecting.
        await control.close()
        operator = await connect(root, Identity("operator", "admin"), urls[2])
        cordon = events.NodeCordoned(id="c-1", ts=1.0, operator="admin", node="gpu-1")
        ack = await operator.jetstream().publish(events.subject_of(cordon), events.encode(cordon))
        assert ack.seq == 1

        servers[0].stop()
        cordon2 = events.NodeCordoned(id="c-2", ts=2.0, operator="admin", node="gpu-2")
        deadline = asyncio.get_running_loop().time() + 20
        while True:  # a new stream leader may need electing
            try:
                ack = await operator.jetstream().publish(
                    events.subject_of(cordon2), events.encode(cordon2), timeout=2
                )
                break
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.Error):
                assert asyncio.get_running_loop().time() < deadline, "writes stopped"
                await asyncio.sleep(0.2)
        assert ack.seq == 2
        await operator.close()
    finally:
        for server in servers:
            server.stop()

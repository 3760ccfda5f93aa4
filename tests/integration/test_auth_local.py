"""`LocalNats`, the private nats-server `llmgw up` runs in a state directory: a throwaway CA,
mutual TLS and JetStream, identities added while it runs, and a second start on the same
directory that keeps the CA, the certificates and the log."""

from __future__ import annotations

import time
from pathlib import Path

import nats
import pytest

from llmgw import bus, natsd
from llmgw.core import subjects
from llmgw.pki.identity import Identity

CONTROL = Identity("control", "control")
NODE = Identity("node", "sim-1")


async def connect(local: natsd.LocalNats, identity: Identity) -> nats.NATS:
    return await nats.connect(
        local.url,
        tls=local.client_tls(identity),
        inbox_prefix=identity.inbox_prefix,
        allow_reconnect=False,
        max_reconnect_attempts=1,
        connect_timeout=3,
    )


async def test_local_nats_runs_admits_new_identities_and_keeps_its_state(tmp_path: Path) -> None:
    root = tmp_path / "state" / "nats"
    local = natsd.LocalNats(root)
    local.prepare([CONTROL, NODE])
    local.start()
    try:
        control = await connect(local, CONTROL)
        js = control.jetstream()
        await js.add_stream(name=subjects.STREAM, subjects=list(subjects.STREAM_SUBJECTS))
        node = await connect(local, NODE)
        ack = await node.jetstream().publish(subjects.node_event("sim-1", "heartbeat"), b"{}")
        assert ack.seq == 1

        # An agent added while the fleet runs: issued, admitted by a reload, no restart.
        late = Identity("node", "sim-2")
        extra = await connect(local, late)
        ack = await extra.jetstream().publish(subjects.node_event("sim-2", "heartbeat"), b"{}")
        assert ack.seq == 2
        for nc in (control, node, extra):
            await bus.close(nc)
    finally:
        local.stop()

    ca_before = local.certs.ca_cert.read_bytes()
    again = natsd.LocalNats(root)
    again.prepare([CONTROL, NODE])
    assert again.certs.ca_cert.read_bytes() == ca_before
    again.start()
    try:
        control = await connect(again, CONTROL)
        info = await control.jetstream().stream_info(subjects.STREAM)
        assert info.state.messages == 2
        await control.close()
    finally:
        again.stop()
    assert "sync_interval: always" in again.config_path.read_text()


async def test_local_nats_on_another_address_is_certified_for_it(tmp_path: Path) -> None:
    # Clients check the server certificate against the address they dial.
    local = natsd.LocalNats(tmp_path / "nats", host="127.0.0.2")
    local.prepare([CONTROL])
    local.start()
    try:
        assert local.url.startswith("tls://127.0.0.2:")
        control = await connect(local, CONTROL)
        assert control.is_connected
        await control.close()
    finally:
        local.stop()


def test_a_refused_reload_fails_at_once_and_the_server_keeps_running(tmp_path: Path) -> None:
    local = natsd.LocalNats(tmp_path / "nats")
    local.prepare([CONTROL])
    server = natsd.NatsServer(
        local.config_path, host=local.host, port=local.port, log_path=local.log_path
    )
    server.start()
    try:
        local.config_path.write_text(local.config_path.read_text() + "\nnot { a config\n")
        began = time.monotonic()
        with pytest.raises(natsd.NatsServerError, match="refused the reloaded configuration"):
            server.reload(timeout_s=60.0)
        assert time.monotonic() - began < 30  # the refusal, not the timeout, ended the wait
        assert server.running
    finally:
        server.stop()

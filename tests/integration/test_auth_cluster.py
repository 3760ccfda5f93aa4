"""The log on a 3-server NATS cluster (docs/design.md: where users outgrow one machine): the same
per-identity authorization on every member, a replicated stream that keeps accepting writes
with one member down, and routes that admit only route certificates.

Each test pays the cluster's JetStream meta-leader election (1.5 to 8 s, nats-server's),
so there are few of them."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import nats
import pytest

from llmgw import natsconf, natsd
from llmgw.core import events, subjects
from llmgw.pki.identity import Identity
from tests.harness import Connector, TestNatsCluster, TestNatsServer

pytestmark = pytest.mark.slow
STREAM = subjects.STREAM


async def publish_until_acked(nc: nats.NATS, event: events.Event, within_s: float = 20) -> int:
    """Publish, retrying while the cluster elects a new stream leader."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            ack = await nc.jetstream().publish(
                events.subject_of(event),
                events.encode(event),
                headers={"Nats-Msg-Id": event.id},
                timeout=2,
            )
            return ack.seq
        except (
            nats.errors.TimeoutError,
            nats.errors.NoRespondersError,
            nats.js.errors.Error,  # APIError, NoStreamResponseError: no stream leader yet
        ):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_a_replicated_log_keeps_namespaces_and_survives_a_member(
    connect_cluster: Connector, nats_cluster: TestNatsCluster
) -> None:
    control = await connect_cluster("control", "control-1")
    await control.jetstream().add_stream(
        name=STREAM, subjects=list(subjects.STREAM_SUBJECTS), num_replicas=3
    )
    first, second, third = nats_cluster.servers
    # Each client on a different member: the authorization holds on every one.
    node = await connect_cluster("node", "node-a", servers=[second.url])
    router = await connect_cluster("router", "router-1", servers=[third.url])

    beat = events.Heartbeat(id="hb-1", ts=1.0, node="node-a", seq=1)
    assert await publish_until_acked(node, beat) == 1
    with pytest.raises(nats.errors.TimeoutError):
        await node.jetstream().publish(subjects.node_event("node-b", "heartbeat"), b"{}", timeout=1)
    assert "node-b" in await connect_cluster.violation("node", "node-a")
    await router.publish(subjects.command("node-a"), b"{}")
    assert "llmgw.cmd.node-a" in await connect_cluster.violation("router", "router-1")

    got = await router.jetstream(timeout=5).get_msg(STREAM, 1)
    assert events.decode(got.data) == beat

    # One member down (whichever led the stream): two of three still acknowledge writes.
    first.stop()
    beat2 = events.Heartbeat(id="hb-2", ts=2.0, node="node-a", seq=2)
    assert await publish_until_acked(node, beat2) == 2
    got = await router.jetstream(timeout=5).get_msg(STREAM, 2)
    assert events.decode(got.data) == beat2

    # Back again, it catches up on what it missed.
    first.start()
    admin = await connect_cluster.admin(servers=[first.url])
    deadline = time.monotonic() + 20
    while True:
        try:
            info = await admin.jetstream(timeout=2).stream_info(STREAM)
            if info.state.messages == 2 and info.cluster and len(info.cluster.replicas or []) == 2:
                break
        except (nats.errors.TimeoutError, nats.js.errors.Error):
            pass
        assert time.monotonic() < deadline, "the restarted member never caught up"
        await asyncio.sleep(0.2)


async def test_a_client_certificate_cannot_join_the_cluster_as_a_route(
    nats_cluster: TestNatsCluster, tmp_path: Path
) -> None:
    pki = nats_cluster.pki
    pki.client_tls("node", "node-a")  # a genuine client certificate of this CA
    identity = Identity("node", "node-a")
    member = nats_cluster.servers[0]
    assert member.cluster is not None
    routes = member.cluster.routes

    rogue = TestNatsServer(pki, tmp_path / "rogue", server_name="rogue")
    rogue.root.mkdir()
    rogue.cluster = natsconf.ClusterConfig(
        name=nats_cluster.name,
        host="127.0.0.1",
        port=natsd.free_port(),
        routes=routes,
        cert_file=pki.certs.cert(identity).resolve(),
        key_file=pki.certs.key(identity).resolve(),
        ca_file=pki.certs.ca_cert.resolve(),
    )
    before = [s.log_path.read_text() for s in nats_cluster.servers]
    rogue.start()
    try:
        refused = "Router connection closed: Authentication Failure"
        deadline = time.monotonic() + 10
        while not any(
            refused in s.log_path.read_text()[len(b) :]
            for s, b in zip(nats_cluster.servers, before, strict=True)
        ):
            assert time.monotonic() < deadline, "no member logged refusing the rogue route"
            await asyncio.sleep(0.1)

        # And no message crosses: what a client publishes on the rogue never reaches the
        # cluster, as it would through a route.
        inside = Connector(nats_cluster)
        outside = Connector(rogue)
        try:
            listener = await inside.admin()
            sub = await listener.subscribe("probe")
            await listener.flush()
            talker = await outside.admin()
            for _ in range(10):
                await talker.publish("probe", b"hello")
                await talker.flush()
                await asyncio.sleep(0.05)
            with pytest.raises(nats.errors.TimeoutError):
                await sub.next_msg(timeout=0.5)
        finally:
            await inside.close()
            await outside.close()
    finally:
        rogue.close()

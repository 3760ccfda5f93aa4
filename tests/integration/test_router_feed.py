"""The router fed by the log: its catalog and endpoints follow the control plane's decisions.

A real nats-server with mutual TLS, a real control plane (in process), simulated agents on
the wire (tests/integration/control_kit.py) and the router's LogFeed reading as a `router`
identity, which may only read.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from llmgw import bus
from llmgw.control.service import ControlService
from llmgw.core import events
from llmgw.pki.identity import Identity
from llmgw.router.feed import LogFeed, LogSource
from llmgw.router.table import Catalog, EndpointTable
from tests.harness import TestNatsServer, connect_as, wait_for
from tests.integration.control_kit import SimAgent, control_config, model, running


def feed_for(server: TestNatsServer, name: str = "r1") -> LogFeed:
    ctx = server.pki.client_tls("router", name)
    # The CA file is what the feed checks signatures with; the TLS context comes ready-made.
    source = LogSource(servers=(server.url,), name=name, ca_file=str(server.pki.certs.ca_cert))
    return LogFeed(source, Catalog(), EndpointTable(), tls=ctx)


def ready_urls(feed: LogFeed, model_name: str) -> set[str]:
    return {ep.url for ep in feed.table.for_model(model_name) if not ep.draining}


def ready_ids(feed: LogFeed, model_name: str) -> set[str]:
    return {ep.id for ep in feed.table.for_model(model_name) if not ep.draining}


async def operator_publish(server: TestNatsServer, event: events.Event) -> None:
    nc = await connect_as(server, "operator", "alice")
    try:
        await bus.Publisher(nc.jetstream()).publish(event)
    finally:
        await bus.close(nc)


async def test_two_routers_follow_models_endpoints_and_a_rolling_drain(
    nats_server: TestNatsServer,
) -> None:
    profile = model("m1", replicas=1, aliases=("m1-latest",), fallbacks=())
    cfg = control_config(nats_server, "control-a", models=(profile,))
    agents: list[SimAgent] = []
    feeds = [await asyncio.to_thread(feed_for, nats_server, n) for n in ("r1", "r2")]
    try:
        async with running(ControlService(cfg)) as svc:
            agents.append(await SimAgent(nats_server, "node-a", gpus=1).start())
            for feed in feeds:
                feed.start()
            for feed in feeds:
                await asyncio.wait_for(feed.ready.wait(), 15)
                await wait_for(lambda f=feed: len(ready_urls(f, "m1")) == 1, 15, "m1 routable")
                assert feed.catalog.resolve("m1-latest") == feed.catalog.resolve("m1")
                assert feed.catalog.resolve("m1") is not None
            (original,) = svc.state.active_replicas("m1")

            agents.append(await SimAgent(nats_server, "node-b", gpus=1, serve_after_s=0.5).start())
            await wait_for(lambda: "node-b" in svc.state.nodes, 5, "node-b registered")
            await operator_publish(
                nats_server,
                events.NodeDrainRequested(
                    id="drain-1", ts=time.time(), operator="alice", node="node-a", grace_s=60
                ),
            )
            # At once: the node's endpoint takes no new requests, and it is not removed
            # before its replacement serves.
            await wait_for(
                lambda: feeds[0].table.by_id[original.id].draining, 5, "original draining"
            )
            for feed in feeds:
                await wait_for(
                    lambda f=feed: (
                        original.id not in f.table.by_id and len(ready_ids(f, "m1")) == 1
                    ),
                    20,
                    "traffic moved to the replacement",
                )
            assert feeds[0].rejected == 0

            await operator_publish(
                nats_server,
                events.ModelRemoved(id="rm-1", ts=time.time(), operator="alice", name="m1"),
            )
            for feed in feeds:
                await wait_for(
                    lambda f=feed: (
                        f.catalog.resolve("m1") is None and f.catalog.resolve("m1-latest") is None
                    ),
                    10,
                    "m1 removed from the catalog",
                )
    finally:
        for feed in feeds:
            await feed.close()
        for agent in agents:
            await agent.close()


async def test_routing_continues_on_last_known_endpoints_while_nats_is_down(
    nats_server: TestNatsServer,
) -> None:
    cfg = control_config(nats_server, "control-a", models=(model("m1", replicas=1),))
    agent: SimAgent | None = None
    feed = await asyncio.to_thread(feed_for, nats_server)
    try:
        async with running(ControlService(cfg)):
            agent = await SimAgent(nats_server, "node-a", gpus=1).start()
            feed.start()
            await wait_for(lambda: len(ready_urls(feed, "m1")) == 1, 15, "m1 routable")
            known = ready_urls(feed, "m1")

            await asyncio.to_thread(nats_server.stop)
            await asyncio.sleep(1.5)
            assert ready_urls(feed, "m1") == known, "endpoints lost while NATS was down"
            assert feed.catalog.resolve("m1") is not None
            await asyncio.to_thread(nats_server.start)

            # The feed reconnects and keeps following: a model declared after the restart
            # arrives. (m1 itself belongs to the control plane's config file, which the
            # control plane re-asserts when it leads again.)
            await operator_publish(
                nats_server,
                events.ModelDeclared(
                    id="decl-m2", ts=time.time(), operator="alice", profile=model("m2", replicas=0)
                ),
            )
            await wait_for(lambda: feed.catalog.resolve("m2") is not None, 30, "m2 after restart")
            assert ready_urls(feed, "m1") == known
    finally:
        await feed.close()
        if agent is not None:
            await agent.close()


async def test_a_router_starts_from_the_newest_snapshot_then_the_tail(
    nats_server: TestNatsServer,
) -> None:
    cfg = control_config(nats_server, "control-a", models=(model("m1", replicas=1),))
    agent: SimAgent | None = None
    try:
        async with running(ControlService(cfg)) as svc:
            agent = await SimAgent(nats_server, "node-a", gpus=1).start()
            await wait_for(lambda: len(svc.state.endpoints) == 1, 15, "m1 serving")
            # A snapshot written as the control plane writes them, then one more event.
            nc = await connect_as(nats_server, "control", "control-a")
            store = await bus.SnapshotStore.open(nc.jetstream())
            from llmgw.core import state

            snap_seq = svc.state.last_seq
            await store.save(state.encode_snapshot(svc.state), snap_seq)
            await bus.close(nc)
            await operator_publish(
                nats_server,
                events.ModelDeclared(
                    id="decl-2", ts=time.time(), operator="alice", profile=model("m2", replicas=0)
                ),
            )
            feed = await asyncio.to_thread(feed_for, nats_server)
            try:
                feed.start()
                await asyncio.wait_for(feed.ready.wait(), 15)
                assert feed.catalog.resolve("m2") is not None, "the tail was not folded"
                assert len(ready_urls(feed, "m1")) == 1
                # Only the tail was read: fewer events applied than the snapshot covers.
                assert feed.applied < snap_seq
            finally:
                await feed.close()
    finally:
        if agent is not None:
            await agent.close()


def test_a_router_identity_cannot_write_the_log() -> None:
    # What a router may do is rendered from its identity; it has no subject of the log to
    # publish, only its own load reports (outside the log, in llmgw-signals) and the
    # tenants' counters (llmgw-limits, llmgw-usage).
    from llmgw.pki.authorization import permissions

    allowed = permissions(Identity("router", "r1")).publish
    assert [p for p in allowed if p.startswith("llmgw.")] == [
        "llmgw.signals.router.r1.*", "llmgw.limits.>", "llmgw.usage.>"
    ]  # fmt: skip
    assert not any(p.startswith(("$JS.API.STREAM.CREATE", "$KV.", "$O.")) for p in allowed)


async def test_a_router_started_before_the_log_exists_follows_it_once_it_does(
    nats_server: TestNatsServer,
) -> None:
    """A router started before any control plane made the log (the stream does not exist
    yet, as in a fleet whose routers come up first) tries again until it can read it:
    before, its feed ended for good at the first refusal, and the router never learned of
    a model or an endpoint until restarted."""
    feed = await asyncio.to_thread(feed_for, nats_server)
    try:
        with structlog.testing.capture_logs() as logged:
            feed.start()
            await wait_for(lambda: any(e["event"] == "feed_retry" for e in logged), 30, "a retry")
            nc = await connect_as(nats_server, "control", "control-a")
            await bus.provision(nc.jetstream())
            await bus.close(nc)
            await operator_publish(
                nats_server,
                events.ModelDeclared(
                    id="decl-m3", ts=time.time(), operator="alice", profile=model("m3", replicas=0)
                ),
            )
            await wait_for(lambda: feed.catalog.resolve("m3") is not None, 60, "m3 followed")
        retry = next(e for e in logged if e["event"] == "feed_retry")
        assert "llmgw-events" in retry["error"]
        assert feed.ready.is_set()
        assert not [e for e in logged if e["event"] == "feed_ended"]
    finally:
        await feed.close()

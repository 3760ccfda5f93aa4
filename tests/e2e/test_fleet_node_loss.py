"""A lost node, with every process real (issue 8, must show).

kill -9 of node-a's agent and of its engines' process groups (engines outlive an agent
by design, so killing the agent alone is an agent restart, not a lost node). The control
plane marks the node unreachable after 2 s without heartbeats, lost after 4 s, and
places its replica on node-b; the router stops sending to the dead engine within the
heartbeat timeout; streaming clients keep being served throughout: only the streams
the dead engine was sending at the instant of the kill can break.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.e2e.fleet_kit import (
    FAST_FLEET,
    HEARTBEAT_S,
    Fleet,
    Load,
    on_node,
    openai_stream,
    serving,
    wait_for,
)

pytestmark = pytest.mark.slow


async def test_a_killed_node_is_lost_its_replica_moves_and_traffic_goes_on(
    fleet: Fleet,
) -> None:
    await fleet.start()
    rows = await fleet.replicas()
    (dead,) = [r["id"] for r in rows if on_node(r, "node-a")]
    (alive,) = [r["id"] for r in rows if on_node(r, "node-b")]

    async with Load(fleet.router_url, clients=4) as load:
        await load.wait_ok(20)
        assert (await fleet.router_sent()).get(dead, 0) > 0
        killed = time.monotonic()
        await asyncio.to_thread(fleet.kill_node, "node-a")
        # Requests sent between `killed` and here may have reached the engine before it died.
        dead_by = time.monotonic()

        async def router_dropped() -> bool:
            return (await fleet.router_ready()).get(dead) != 1.0

        dropped_s = await wait_for(router_dropped, 10, "router stops using the dead endpoint")
        # Liveness from the control plane's view: unreachable, then lost.
        liveness: dict[str, float] = {}

        async def became(state: str) -> bool:
            node = (await fleet.nodes_view())["node-a"]
            if node["liveness"] not in liveness:
                liveness[node["liveness"]] = time.monotonic() - killed
            return bool(node["liveness"] == state)

        await wait_for(lambda: became("unreachable"), 15, "node-a unreachable", every_s=0.05)
        await wait_for(lambda: became("lost"), 15, "node-a lost", every_s=0.05)
        sent_lost = await fleet.router_sent()

        # Its replica is placed on node-b and serves; the router routes to both.
        rows = await fleet.wait_routable(2, 30)
        replaced_s = time.monotonic() - killed
        assert all(on_node(r, "node-b") for r in rows), rows
        assert alive in {r["id"] for r in rows}
        (replacement,) = [r for r in rows if r["id"] != alive]
        assert replacement["id"] != dead, replacement
        sent_before = await fleet.router_sent()
        await load.wait_ok(40)
        sent_after = await fleet.router_sent()
        text = await asyncio.to_thread(openai_stream, fleet.router_url)

    # Nothing was sent to the dead endpoint once it was dropped (counted from when it was
    # lost, well after the drop), and the replacement takes traffic.
    assert sent_after.get(dead, 0) == sent_lost.get(dead, 0), (sent_lost, sent_after)
    assert sent_after[replacement["id"]] > sent_before.get(replacement["id"], 0)
    assert text, "the openai SDK streamed no text"
    # Only streams in flight on the dead engine when it died may break; every request
    # sent after the kill succeeded (the router retries a refused connection elsewhere).
    assert len(load.failures) <= load.clients, f"{load.summary()}\n{fleet.logs()}"
    assert all(f.at >= killed for f in load.failures), load.summary()
    assert not load.failed_since(dead_by), f"{load.summary()}\n{fleet.logs()}"
    assert dropped_s < FAST_FLEET.unreachable_after_s, f"router dropped it after {dropped_s}"
    # From the last heartbeat (up to one interval, or two on a busy machine, before the kill).
    assert liveness["unreachable"] >= FAST_FLEET.unreachable_after_s - 2 * HEARTBEAT_S, liveness
    rows = await fleet.replicas()
    assert not any(on_node(r, "node-a") and serving(r) for r in rows), rows
    print(
        f"router dropped the dead endpoint after {dropped_s:.2f} s; node-a "
        f"{ {k: round(v, 2) for k, v in liveness.items()} } s after the kill; replacement "
        f"routed after {replaced_s:.1f} s; {load.ok} streams ok, "
        f"{len(load.failures)} cut by the kill"
    )

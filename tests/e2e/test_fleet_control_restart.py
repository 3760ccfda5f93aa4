"""kill -9 of the control plane in the middle of a drain, then a restart (issue 8, must show).

Every process real. `llmgw ctl drain node-a` is issued without waiting; the control plane
is killed the moment the log holds the replacement's StartShard (the replacement is
starting, the original still serves: the drain is half done). Restarted with the same
config, the control plane folds the log again, takes the lease back and finishes the
drain. Checked against the log itself: its `/v1/state` digest equals a fresh fold of
the log up to the same sequence; every replica generation was placed once and started
once (one StartShard, one `starting` from its agent); streaming clients were served
throughout (serving never depends on the control plane).
"""

from __future__ import annotations

import asyncio
import collections
import time

import pytest

from llmgw.core import events, state
from tests.e2e.fleet_kit import Fleet, Load, fold, on_node, serving, wait_for
from tests.harness import TestNatsServer
from tests.integration.ctl_kit import Ctl

pytestmark = pytest.mark.slow


async def test_control_plane_killed_mid_drain_restarts_and_finishes_it(
    nats_server: TestNatsServer, fleet: Fleet
) -> None:
    await fleet.start()
    rows = await fleet.replicas()
    (moving,) = [r["id"] for r in rows if on_node(r, "node-a")]
    (staying,) = [r["id"] for r in rows if on_node(r, "node-b")]
    epoch_before = (await fleet.control_state())["epoch"]
    ctl = Ctl(nats_server)

    async with Load(fleet.router_url, clients=2) as load:
        await load.wait_ok(10)
        drain = await ctl.subprocess("drain", "node-a", "--grace", "60", "--json")
        assert drain.code == 0, drain

        replacement: events.ReplicaPlaced | None = None

        async def replacement_starting() -> bool:
            nonlocal replacement
            for r in await fleet.read_log():
                ev = r.event
                if isinstance(ev, events.ReplicaPlaced) and ev.replaces == moving:
                    replacement = ev
                if (
                    replacement is not None
                    and isinstance(ev, events.StartShard)
                    and ev.replica_id == replacement.replica_id
                ):
                    return True
            return False

        await wait_for(replacement_starting, 20, "the replacement's StartShard", every_s=0.05)
        assert fleet.control is not None
        await asyncio.to_thread(fleet.control.kill9)
        killed = time.monotonic()
        assert replacement is not None
        middle = await fleet.read_log()
        assert not any(
            isinstance(r.event, events.StopShard) and r.event.replica_id == moving for r in middle
        ), "the control plane was killed after the drain had finished; kill it earlier"

        await asyncio.to_thread(fleet.start_control)
        restarted_s = time.monotonic() - killed

        async def drained() -> bool:
            rows = await fleet.replicas()
            live = [r for r in rows if not r["retired"]]
            original = [r for r in rows if r["id"] == moving]
            # Done means the original's engine stopped too, not only that it was retired.
            return (
                all(s["phase"] == "stopped" for r in original for s in r["shards"])
                and len(live) == 2
                and all(serving(r) and on_node(r, "node-b") for r in live)
                and {r["id"] for r in live} == {staying, replacement.replica_id}
            )

        done_s = await wait_for(drained, 40, "the drain completes after the restart")
        await fleet.wait_routable(2)
        await load.wait_ok(10)

    st = await fleet.control_state()
    assert st["leading"], st
    assert st["epoch"] > epoch_before, st

    # The restarted control plane's state is exactly the log's: a fresh fold up to the
    # sequence it reports gives its digest. (Heartbeats keep arriving; they are not in
    # the digest, and the fold is cut at the same sequence.)
    async def same_digest() -> bool:
        doc = await fleet.control_state()
        records = await fleet.read_log()
        mine = fold([r for r in records if r.seq <= doc["folded_seq"]])
        return bool(state.digest(mine) == doc["digest"])

    await wait_for(same_digest, 15, "control digest equal to a fresh fold of the log")

    # No replica generation placed or started twice, by the control plane or an agent.
    records = await fleet.read_log()
    placed = collections.Counter(
        (r.event.replica_id, r.event.generation)
        for r in records
        if isinstance(r.event, events.ReplicaPlaced)
    )
    starts = collections.Counter(
        (r.event.replica_id, r.event.generation, r.event.shard)
        for r in records
        if isinstance(r.event, events.StartShard)
    )
    launched = collections.Counter(
        (r.event.replica_id, r.event.generation, r.event.shard)
        for r in records
        if isinstance(r.event, events.ShardStatus) and r.event.phase == "starting"
    )
    assert len(placed) >= 3, placed
    assert max(placed.values()) == 1, placed
    assert max(starts.values()) == 1, starts
    assert launched == starts, (launched, starts)
    assert set(placed) == {(rid, gen) for rid, gen, _ in starts}
    # The original was drained, then stopped, once each.
    drains = [r for r in records if isinstance(r.event, events.DrainShard)]
    stops = [r for r in records if isinstance(r.event, events.StopShard)]
    assert [r.event.replica_id for r in drains] == [moving], drains
    assert [r.event.replica_id for r in stops] == [moving], stops
    leaders = [r.event for r in records if isinstance(r.event, events.LeaderElected)]
    assert len(leaders) == 2, leaders

    assert not load.failures, f"{load.summary()}\n{fleet.logs()}"
    print(
        f"control restarted in {restarted_s:.1f} s after the kill, drain done "
        f"{done_s:.1f} s later; {len(records)} events; {load.ok} streams ok"
    )

"""A NATS outage longer than lost_after_s does not make the control plane declare nodes lost.

While the log is unreachable, no heartbeat can reach the control plane: that silence is
its own, not the nodes'. A real nats-server is stopped for longer than `lost_after_s`
under a control plane (in process) and two simulated agents on the wire; once everyone
is back, both nodes are still ready, and nothing was judged: no NodeUnreachable, no
NodeLost, no replica retired. (Before the fix in llmgw.control.service, this test saw a
NodeUnreachable decided during the outage and stored after it; with a replicated stream
electing a new leader, tests/e2e/test_fleet_nats_cluster.py saw both nodes declared lost
and every replica replaced.)
"""

from __future__ import annotations

import asyncio
import time

from llmgw import bus
from llmgw.control.service import ControlService
from llmgw.core import events
from tests.harness import TestNatsServer, connect_as, wait_for
from tests.integration.control_kit import FAST, SimAgent, control_config, model, read_log, running

# Every client comes back within a fraction of a second of the server: the default
# backoff (up to 10 s) would make an agent's own late return look like a lost node.
FAST_RECONNECT_CAP_S = 0.3


async def test_an_outage_longer_than_lost_after_loses_no_node(nats_server: TestNatsServer) -> None:
    cfg = control_config(nats_server, "control-a", models=(model("m1", replicas=2),))
    agents: list[SimAgent] = []
    try:
        async with running(ControlService(cfg)) as svc:
            for node in ("node-a", "node-b"):
                agents.append(await SimAgent(nats_server, node, gpus=1).start())
            await wait_for(lambda: len(svc.state.endpoints) == 2, 15, "m1 serving on both")
            replicas = {r.id for r in svc.state.active_replicas("m1")}
            for nc in [svc._nc, *(a._nc for a in agents)]:
                assert nc is not None
                nc.backoff_cap = FAST_RECONNECT_CAP_S

            await asyncio.to_thread(nats_server.stop)
            # The outage itself: a duration, longer than lost_after_s.
            await asyncio.sleep(FAST.lost_after_s + 1.5)
            await asyncio.to_thread(nats_server.start)
            back = time.time()

            def heard_again() -> bool:
                seen = svc.state.seen
                return svc.leading and all(
                    n in seen and seen[n].last_seen > back for n in ("node-a", "node-b")
                )

            await wait_for(heard_again, 20, "both nodes heard again by a leading control plane")
            # A wrong verdict would come from the first passes after the reconnect, which
            # are over by now; give a few more passes the chance to show one.
            await asyncio.sleep(5 * cfg.reconcile_interval_s)
            assert {n.liveness for n in svc.state.nodes.values()} == {"ready"}
            assert {r.id for r in svc.state.active_replicas("m1")} == replicas

        nc = await connect_as(nats_server, "operator", "alice")
        try:
            records = await read_log(nc)
        finally:
            await bus.close(nc)
        judged = [
            r.event
            for r in records
            if isinstance(r.event, events.NodeLost | events.ReplicaRetired | events.NodeUnreachable)
        ]
        assert not judged, judged
    finally:
        for agent in agents:
            await agent.close()

"""The control plane against a real nats-server: fold, lead, place, replay, verify.

Simulated agents (tests/integration/control_kit.py) publish as node identities
and answer commands; the control plane runs in-process (ControlService), with
short timings. Determinism (DESIGN.md, invariant 3) is checked on the real log:
folding from scratch and from a snapshot give the leader's digest, and every
recorded decision batch is reproduced by re-running the reconciler.
"""

from __future__ import annotations

import time

from llmgw import bus
from llmgw.control import verify
from llmgw.control.service import ControlService
from llmgw.core import events, state
from tests.harness import TestNatsServer
from tests.integration.control_kit import (
    FAST,
    SimAgent,
    connect_as,
    control_config,
    model,
    read_log,
    running,
    wait_for,
)


def serving(svc: ControlService, name: str) -> int:
    return sum(1 for r in svc.state.active_replicas(name) if r.id in svc.state.endpoints)


async def settle(svc: ControlService, nc: bus.BusClient) -> list[bus.Record]:
    """Wait until the service has folded the whole log; the log."""
    log: list[bus.Record] = []

    async def folded_all() -> bool:
        nonlocal log
        log = await read_log(nc)
        return bool(log) and svc.state.last_seq == log[-1].seq

    await wait_for(folded_all, 10, "the service folding the whole log", every_s=0.3)
    return log


async def test_a_scenario_replays_to_the_same_digest_and_the_same_decisions(
    nats_server: TestNatsServer,
) -> None:
    cfg = control_config(nats_server, "control-a", models=(model("m1", replicas=2),))
    agents: list[SimAgent] = []
    try:
        async with running(ControlService(cfg)) as svc:
            agents += [await SimAgent(nats_server, n, gpus=2).start() for n in ("node-a", "node-b")]
            await wait_for(lambda: svc.leading, 10, "control-a leading")
            await wait_for(lambda: serving(svc, "m1") == 2, 15, "two replicas of m1 serving")
            snap_seq = await svc.snapshot_now()
            # More history after the snapshot: a third replica, placed and serving.
            operator = await connect_as(nats_server, "operator", "alice")
            await bus.Publisher(operator.jetstream()).publish(
                events.ModelChanged(
                    id="op-1", ts=time.time(), operator="alice", profile=model("m1", replicas=3)
                )
            )
            await wait_for(lambda: serving(svc, "m1") == 3, 15, "three replicas of m1 serving")
            for agent in agents:
                agent.beating = False
            log = await settle(svc, operator)
            leader_digest = state.digest(svc.state)
            await operator.close()
        records = [(r.seq, r.event) for r in log]
        scratch, rejected = state.fold(records)
        assert state.digest(scratch) == leader_digest
        assert rejected == []
        store = await bus.SnapshotStore.open(
            (await connect_as(nats_server, "router", "r1")).jetstream()
        )
        snap = await store.load()
        assert snap is not None
        assert snap.seq == snap_seq
        assert verify.digests_agree(records, (snap.seq, snap.data)) == []
        # Every recorded decision batch comes back identical from the log alone.
        assert verify.verify(records, config=FAST) == []
        placed = [e for _, e in records if isinstance(e, events.ReplicaPlaced)]
        assert len(placed) == 3
        assert any(isinstance(e, events.LeaderElected) for _, e in records)
        declared = [e for _, e in records if isinstance(e, events.ModelDeclared)]
        assert [(d.operator, d.profile.name) for d in declared] == [("control-a", "m1")]
    finally:
        for agent in agents:
            await agent.close()

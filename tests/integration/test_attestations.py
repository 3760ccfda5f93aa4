"""Each event verified once: a real control plane attests what its reader checked, and a
later replay checks those events by digest, not signature, with the same outcome, on a real
nats-server. A message stored without its owner's signature (the test administrator's) is
refused by the replay because the leader refused it; one the leader accepted but that is
not what it attested cannot be confirmed."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw import bus
from llmgw.control.service import ControlService
from llmgw.core import events, subjects
from tests.harness import Connector, TestNatsServer, connect_as, wait_for
from tests.integration.control_kit import control_config, running

pytestmark = pytest.mark.slow


class CountingVerifier:
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0

    def event_refusal(self, *args: Any, **kwargs: Any) -> str | None:
        self.calls += 1
        result: str | None = self.inner.event_refusal(*args, **kwargs)
        return result


async def replay(nc: bus.BusClient, **options: Any) -> tuple[bus.Reader, list[bus.Record]]:
    out: list[bus.Record] = []
    reader = bus.Reader(nc, follow=False, name="replay", **options)
    async with reader:
        async for batch in reader.batches():
            out += batch
    return reader, out


async def test_a_replay_checks_what_the_leader_attested_by_digest(
    nats_server: TestNatsServer, connect: Connector
) -> None:
    svc = ControlService(control_config(nats_server, "control-a"))
    async with running(svc):
        svc.attester.within_s = 0.2
        await wait_for(lambda: svc.leading, 20, "control-a leads")
        node = await connect_as(nats_server, "node", "node-a")
        publisher = bus.Publisher(node.jetstream())
        for i in range(1, 41):
            await publisher.publish(
                events.ShardStatus(
                    id=f"s-{i}",
                    ts=1.0,
                    node="node-a",
                    replica_id="r",
                    generation=i,
                    phase="stopped",
                )
            )
        admin = await connect.admin()
        forged = events.StopShard(id="forged", ts=1.0, node="node-a", replica_id="r", generation=1)
        stored = await admin.jetstream().publish(
            subjects.command("node-a"), events.encode(forged), headers={"Nats-Msg-Id": "forged"}
        )

        router = await connect_as(nats_server, "router", "router-1")

        async def attested_past_forged() -> bool:
            book = await bus.load_attestations(router)
            return book.last_seq >= stored.seq

        await wait_for(attested_past_forged, 20, "an attestation past the forged command")

    # The control plane has stopped: both replays read the same log.
    try:
        plain, expected = await replay(router)
        book = await bus.load_attestations(router)
        counting = CountingVerifier(plain.verifier)
        reader, got = await replay(router, attestations=book, verifier=counting)
    finally:
        await router.close()
        await node.close()

    assert [r.seq for r in got] == [r.seq for r in expected]
    assert [r.event for r in got] == [r.event for r in expected]
    assert stored.seq not in {r.seq for r in got}
    assert stored.seq in {s.seq for s in reader.skipped}
    assert "refused it" in next(s.error for s in reader.skipped if s.seq == stored.seq)
    # Every shard report and decision up to the attestation was confirmed by digest; only
    # what came after it (the attestation itself, a few decisions) had its signature checked.
    assert reader.confirmed >= 40
    assert counting.calls < len(expected) - 30
    kinds = {type(r.event).__name__ for r in got}
    assert "LogAttested" in kinds

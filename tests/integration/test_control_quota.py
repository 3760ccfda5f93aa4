"""A node's share of the log, against a real nats-server and a real control plane.

A node floods thousands of valid shard events on its own subject. The leader
quarantines it: its later events are not folded and are deleted from the stream (the
stream stops growing with them), its heartbeats still keep it ready, nothing new is
placed on it, and the other node is unaffected. A restarted control plane (from a
snapshot) and `llmgw ctl replay` fold to the leader's digest. Once the node stays under
its budget for a window, it is released and its events fold again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import nats.js.errors
import pytest

from llmgw import bus
from llmgw.control.quota import NodeQuota
from llmgw.control.service import ControlService
from llmgw.core import events, state, subjects
from tests.harness import Connector, TestNatsServer, connect_as, wait_for
from tests.integration.control_kit import SimAgent, control_config, model, read_log, running
from tests.integration.ctl_kit import Ctl

pytestmark = pytest.mark.slow

QUOTA = NodeQuota(window_s=15.0, max_messages=300, max_bytes=4 * 1024 * 1024)
"""A window long enough for the checks made while the node is quarantined."""


def serving(svc: ControlService, name: str) -> int:
    return sum(1 for r in svc.state.active_replicas(name) if r.id in svc.state.endpoints)


def replica_on(svc: ControlService, node: str) -> state.ReplicaState:
    (replica,) = [r for r in svc.state.active_replicas() if r.shards[0].node == node]
    return replica


async def node_messages(admin: bus.BusClient, node: str) -> tuple[int, int]:
    """(messages, bytes) the stream holds on the node's registered and shard subjects."""
    js = admin.jetstream()
    count = 0
    for kind in ("registered", "shard"):
        info = await js.stream_info(
            subjects.STREAM, subjects_filter=subjects.node_event(node, kind)
        )
        count += sum((info.state.subjects or {}).values())
    total = await js.stream_info(subjects.STREAM)
    return count, int(total.state.bytes)


class Flood:
    """Publishes valid `serving` reports of the node's own replica as fast as acks come."""

    def __init__(self, agent: SimAgent, start: events.StartShard) -> None:
        self.agent = agent
        self.start = start
        self.published = 0
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def report(self) -> events.ShardStatus:
        return events.ShardStatus(
            id=self.agent._id("flood"),
            ts=time.time(),
            node=self.agent.node,
            replica_id=self.start.replica_id,
            generation=self.start.generation,
            shard=self.start.shard,
            phase="serving",
            endpoint=f"http://127.0.0.1:{self.start.launch.port}",
        )

    async def _run(self, total: int) -> None:
        assert self.agent._pub is not None
        while self.published < total and not self._stop.is_set():
            batch = [self.report() for _ in range(100)]
            await self.agent._pub.publish_all(batch)
            self.published += len(batch)

    def begin(self, total: int) -> None:
        self._task = asyncio.create_task(self._run(total))

    async def end(self) -> None:
        self._stop.set()
        await self.done()

    async def done(self) -> None:
        if self._task is not None:
            await self._task


async def test_a_flooding_node_is_quarantined_its_flood_deleted_then_released(
    nats_server: TestNatsServer, connect: Connector
) -> None:
    cfg = control_config(nats_server, "control-a", node_quota=QUOTA)
    admin = await connect.admin()
    ctl = Ctl(nats_server)
    agents: dict[str, SimAgent] = {}
    try:
        async with running(ControlService(cfg)) as svc:
            for node in ("node-a", "node-b"):
                agents[node] = await SimAgent(nats_server, node, gpus=2).start()
            await wait_for(lambda: len(svc.state.nodes) == 2, 20, "both nodes registered")
            await operate(
                nats_server,
                events.ModelDeclared(
                    id="op-1", ts=time.time(), operator="alice", profile=model("m1", replicas=2)
                ),
            )
            await wait_for(lambda: serving(svc, "m1") == 2, 20, "m1 serving on both nodes")
            assert {replica_on(svc, n).id for n in agents} == set(svc.state.replicas)
            baseline_count, baseline_bytes = await node_messages(admin, "node-b")
            start = next(c for c in agents["node-b"].commands if isinstance(c, events.StartShard))

            flood = Flood(agents["node-b"], start)
            flood.begin(6000)
            await wait_for(
                lambda: "node-b" in svc.state.quarantined, 30, "node-b quarantined", every_s=0.1
            )
            q = svc.state.quarantined["node-b"]
            assert "messages" in q.reason
            assert "node-a" not in svc.state.quarantined
            # Nothing new is placed on a quarantined node.
            await operate(
                nats_server,
                events.ModelChanged(
                    id="op-3", ts=time.time(), operator="alice", profile=model("m1", replicas=3)
                ),
            )
            await wait_for(lambda: serving(svc, "m1") == 3, 20, "a third replica serving")
            placed = [r.shards[0].node for r in svc.state.active_replicas("m1")]
            assert sorted(placed) == ["node-a", "node-a", "node-b"]
            await flood.end()
            assert flood.published >= 1000

            # Everything after the quarantine is ignored, and deleted from the stream.
            async def flood_deleted() -> bool:
                log = await read_log(admin)
                late = [
                    r
                    for r in log
                    if r.seq > q.seq
                    and isinstance(r.event, events.ShardStatus)
                    and r.event.node == "node-b"
                ]
                return not late and not svc.folded.ignored

            await wait_for(flood_deleted, 30, "the flood after the quarantine deleted", every_s=0.5)
            assert svc.folded.ignored_total > 0
            assert svc.metrics.quarantine_deleted._value.get() >= svc.folded.ignored_total - 5
            kept, kept_bytes = await node_messages(admin, "node-b")
            assert kept - baseline_count < flood.published / 2, (kept, flood.published)

            # The stream stops growing: a second flood while quarantined leaves nothing.
            second = Flood(agents["node-b"], start)
            second.begin(1500)
            await second.done()
            await wait_for(flood_deleted, 30, "the second flood deleted", every_s=0.5)
            after, after_bytes = await node_messages(admin, "node-b")
            assert after == kept
            flood_bytes = second.published * len(events.encode(second.report()))
            assert after_bytes - kept_bytes < flood_bytes / 10, (after_bytes, kept_bytes)
            assert after_bytes - baseline_bytes < 2 * flood_bytes

            # Heartbeats still count: node-b stays ready (unreachable_after_s is 2 s).
            await asyncio.sleep(max(0.0, 2.5 - (time.time() - q.ts)))
            assert svc.state.nodes["node-b"].liveness == "ready"
            # The other node is unaffected: its failure folds and its replica restarts.
            a_start = next(c for c in agents["node-a"].commands if isinstance(c, events.StartShard))
            await agents["node-a"].status(a_start, "failed", error="engine exited")
            a_replica = a_start.replica_id
            await wait_for(
                lambda: svc.state.replicas[a_replica].generation == 2 and serving(svc, "m1") == 2,
                20,
                "node-a's replica restarted",
            )

            nodes = (await ctl.subprocess("nodes", "--json")).json()
            (row,) = [n for n in nodes if n["name"] == "node-b"]
            assert row["quarantined"]
            assert "messages" in row["quarantine_reason"]

            assert "node-b" in svc.state.quarantined

            # Every reader folds the same log to the same digest.
            await svc.snapshot_now()
            replayed = (await ctl.subprocess("replay", "--json")).json()
            log = await read_log(admin)
            await wait_for(lambda: svc.state.last_seq >= log[-1].seq, 10, "folded to the end")
            leader_digest, leader_seq = state.digest(svc.state), svc.state.last_seq
            log = await read_log(admin)  # the leader may have written since the read above
            assert digest_to(log, leader_seq) == leader_digest
            assert digest_to(log, replayed["seq"]) == replayed["digest"]

        # A restarted control plane (snapshot + tail) agrees, then releases the calm node.
        async with running(ControlService(cfg)) as svc2:
            await wait_for(lambda: svc2.caught_up.is_set(), 20, "the restart caught up")
            assert svc2.snapshot_seq > 0
            log = await read_log(admin)
            assert digest_to(log, leader_seq) == leader_digest
            await wait_for(lambda: svc2.state.last_seq >= log[-1].seq, 10, "svc2 folded the log")
            # Taken together, then compared with a log read after: svc2 leads and may have
            # written (its election, node-b's release) since the read above.
            svc2_seq, svc2_digest = svc2.state.last_seq, state.digest(svc2.state)
            log = await read_log(admin)
            assert log[-1].seq >= svc2_seq
            assert digest_to(log, svc2_seq) == svc2_digest
            await wait_for(
                lambda: "node-b" not in svc2.state.quarantined, 30, "node-b released", every_s=0.2
            )
            log = await read_log(admin)
            assert any(isinstance(r.event, events.NodeReleased) for r in log)
            # Released: node-b's reports fold again.
            b_replica = replica_on_first(svc2, "node-b")
            b_start = next(
                c
                for c in reversed(agents["node-b"].commands)
                if isinstance(c, events.StartShard) and c.replica_id == b_replica
            )
            await agents["node-b"].status(b_start, "failed", error="engine exited")
            await wait_for(
                lambda: svc2.state.replicas[b_replica].generation >= 2,
                20,
                "node-b's replica restarted after its release",
            )
            await wait_for(lambda: svc2.leading, 10, "control-a leading again")
            replayed = (await ctl.subprocess("replay", "--json")).json()
            final = await read_log(admin)
            await wait_for(lambda: svc2.state.last_seq >= final[-1].seq, 10, "folded to the end")
            assert digest_to(final, replayed["seq"]) == replayed["digest"]
            assert digest_to(final, svc2.state.last_seq) == state.digest(svc2.state)
    finally:
        for agent in agents.values():
            await agent.close()
        with contextlib.suppress(Exception):
            await admin.close()


async def operate(server: TestNatsServer, event: events.Event) -> None:
    operator = await connect_as(server, "operator", "alice")
    try:
        await bus.Publisher(operator.jetstream()).publish(event)
    finally:
        await operator.close()


def digest_to(log: list[bus.Record], seq: int) -> str:
    """The digest of the log folded from zero up to `seq`."""
    return state.digest(state.fold_records([(r.seq, r.event) for r in log if r.seq <= seq])[0])


async def folds_as_the_log(svc: ControlService, admin: bus.BusClient) -> None:
    """Once it folded to the end, the leader's digest is the log's folded from zero: what
    it deleted changed no fold. (The log is read again after: its last messages may be a
    quarantined node's, deleted since.)"""
    log = await read_log(admin)
    await wait_for(lambda: svc.state.last_seq >= log[-1].seq, 10, "folded to the end")
    seq, digest = svc.state.last_seq, state.digest(svc.state)
    log = await read_log(admin)
    assert digest_to(log, seq) == digest


async def junk(agent: SimAgent, count: int) -> list[int]:
    """`count` messages no reader accepts (unsigned, undecodable) on the node's own
    subjects, with pipelined acks: their sequences."""
    assert agent._nc is not None
    js = agent._nc.jetstream()
    acks: list[int] = []
    for start in range(0, count, 100):
        futures = [
            await js.publish_async(
                subjects.node_event(agent.node, "shard" if i % 2 else "junk"),
                b"\xff not an event %d" % i,
                stream=subjects.STREAM,
            )
            for i in range(start, min(count, start + 100))
        ]
        acks += [(await f).seq for f in futures]
    return acks


async def gone(admin: bus.BusClient, seqs: list[int]) -> bool:
    """No message at any of `seqs` is in the stream any more."""
    js = admin.jetstream()
    for seq in seqs:
        try:
            await js.get_msg(subjects.STREAM, seq)
        except nats.js.errors.NotFoundError:
            continue
        return False
    return True


def replica_on_first(svc: ControlService, node: str) -> str:
    return sorted(r.id for r in svc.state.active_replicas() if r.shards[0].node == node)[0]


async def test_a_new_leader_sweeps_what_a_quarantined_node_wrote_before_it_led(
    nats_server: TestNatsServer, connect: Connector
) -> None:
    """A leader that did not delete (deletion off) leaves the flood in the log; the next
    leader deletes it once it leads, and no fold changes: the same digest before and after."""
    keep = control_config(
        nats_server,
        "control-a",
        node_quota=NodeQuota(
            window_s=60.0, max_messages=200, max_bytes=4 * 1024 * 1024, delete=False
        ),
    )
    admin = await connect.admin()
    agent: SimAgent | None = None
    try:
        async with running(ControlService(keep)) as svc:
            agent = await SimAgent(nats_server, "node-b", gpus=1).start()
            await wait_for(lambda: "node-b" in svc.state.nodes, 20, "node-b registered")
            await operate(
                nats_server,
                events.ModelDeclared(
                    id="op-1", ts=time.time(), operator="alice", profile=model("m1", replicas=1)
                ),
            )
            await wait_for(lambda: serving(svc, "m1") == 1, 20, "m1 serving")
            start = next(c for c in agent.commands if isinstance(c, events.StartShard))
            flood = Flood(agent, start)
            flood.begin(1500)
            await wait_for(lambda: "node-b" in svc.state.quarantined, 30, "node-b quarantined")
            await flood.done()
            late_junk = await junk(agent, 1200)  # more than a reader keeps of what it skips
            q_seq = svc.state.quarantined["node-b"].seq
            log = await read_log(admin)
            late = [r.seq for r in log if r.seq > q_seq and r.subject.endswith(".node-b.shard")]
            assert late, "the flood went on after the quarantine"
            beats = [
                r.seq for r in log if r.seq > q_seq and r.subject.endswith(".node-b.heartbeat")
            ]
            assert beats, "node-b beat after its quarantine"
            await wait_for(lambda: svc.state.last_seq >= log[-1].seq, 10, "folded to the end")
            # Taken together, then compared with the log read after: the leader may have
            # written since the read above.
            before_seq, before = svc.state.last_seq, state.digest(svc.state)
            assert digest_to(await read_log(admin), before_seq) == before
            assert svc.metrics.quarantine_deleted._value.get() == 0

        sweep = control_config(
            nats_server,
            "control-a",
            node_quota=NodeQuota(window_s=60.0, max_messages=200, max_bytes=4 * 1024 * 1024),
        )
        async with running(ControlService(sweep)) as svc2:

            async def swept() -> bool:
                now = await read_log(admin)
                return not [r for r in now if r.seq in set(late)]

            await wait_for(swept, 30, "the flood swept from the log", every_s=0.5)
            await wait_for(lambda: gone(admin, late_junk), 30, "the junk swept", every_s=0.5)
            await wait_for(lambda: gone(admin, beats), 30, "its heartbeats swept", every_s=0.5)
            assert svc2.metrics.quarantine_deleted._value.get() >= len(late) - 5
            after = await read_log(admin)
            assert digest_to(after, before_seq) == before
            assert "node-b" in svc2.state.quarantined
    finally:
        if agent is not None:
            await agent.close()
        with contextlib.suppress(Exception):
            await admin.close()


async def test_heartbeats_and_what_no_reader_accepts_count_and_go_once_quarantined(
    nats_server: TestNatsServer, connect: Connector
) -> None:
    """Two floods the budget did not see: node-b writes bytes no reader accepts on its own
    subjects (nothing signed, nothing decodable, no event between them), node-c valid,
    signed heartbeats with a TTL the readers allow, as fast as acks come. Both are
    quarantined; what each writes after its quarantine is deleted, node-c's heartbeats
    once folded (node-c stays ready), and the log still folds to the leader's digest."""
    cfg = control_config(nats_server, "control-a", node_quota=QUOTA)
    admin = await connect.admin()
    agents: dict[str, SimAgent] = {}

    async def beats(count: int) -> list[int]:
        agent = agents["node-c"]
        assert agent._pub is not None
        out = []
        for start in range(0, count, 100):
            batch = [
                events.Heartbeat(id=agent._id("hb"), ts=time.time(), node="node-c", seq=10**6 + i)
                for i in range(start, min(count, start + 100))
            ]
            out += [p.seq for p in await agent._pub.publish_all(batch, ttl_s=60)]
        return out

    try:
        async with running(ControlService(cfg)) as svc:
            for node in ("node-a", "node-b", "node-c"):
                agents[node] = await SimAgent(nats_server, node, gpus=1).start()
            await wait_for(lambda: len(svc.state.nodes) == 3, 20, "three nodes registered")
            before = svc.folded.undecodable
            await junk(agents["node-b"], 400)
            await beats(400)
            await wait_for(
                lambda: {"node-b", "node-c"} <= set(svc.state.quarantined),
                30,
                "node-b and node-c quarantined",
                every_s=0.1,
            )
            assert "node-a" not in svc.state.quarantined
            assert svc.folded.undecodable - before >= 400
            for node in ("node-b", "node-c"):
                assert (
                    f"budget is {QUOTA.max_messages} messages" in svc.state.quarantined[node].reason
                )

            late_junk = await junk(agents["node-b"], 300)
            late_beats = await beats(300)
            await wait_for(
                lambda: gone(admin, late_junk), 30, "node-b's later junk deleted", every_s=0.5
            )
            await wait_for(
                lambda: gone(admin, late_beats), 30, "node-c's later ones deleted", every_s=0.5
            )
            # Liveness was taken from each heartbeat before it went (unreachable_after_s 2 s).
            await asyncio.sleep(3.0)
            assert svc.state.nodes["node-c"].liveness == "ready"
            assert svc.state.seen["node-c"].seq > max(late_beats) - 1

            await folds_as_the_log(svc, admin)
    finally:
        for agent in agents.values():
            await agent.close()
        with contextlib.suppress(Exception):
            await admin.close()


async def test_a_quarantined_node_that_never_registered_has_its_heartbeats_deleted(
    nats_server: TestNatsServer, connect: Connector
) -> None:
    """A node certificate whose node never registered beats as fast as acks come. Every
    fold refuses those heartbeats (no such node), so none was "folded", and the leader kept
    all it wrote after the quarantine for their TTL. They go like the rest of its traffic;
    its registration is ignored (quarantined), and the log still folds to the digest."""
    cfg = control_config(nats_server, "control-a", node_quota=QUOTA)
    admin = await connect.admin()
    stray = await connect_as(nats_server, "node", "node-x")
    publisher = bus.JetStreamLog(stray).publisher
    n = 0

    async def beats(count: int) -> list[int]:
        nonlocal n
        out: list[int] = []
        for start in range(0, count, 100):
            batch = [
                events.Heartbeat(id=f"x-hb-{n}-{i}", ts=time.time(), node="node-x", seq=i)
                for i in range(start, min(count, start + 100))
            ]
            n += 1
            out += [p.seq for p in await publisher.publish_all(batch, ttl_s=60)]
        return out

    try:
        async with running(ControlService(cfg)) as svc:
            await beats(400)
            await wait_for(
                lambda: "node-x" in svc.state.quarantined, 30, "node-x quarantined", every_s=0.1
            )
            late = await beats(300)
            registration = events.NodeRegistered(
                id="x-reg", ts=time.time(), node="node-x", address="127.0.0.1", gpus=()
            )
            late.append((await publisher.publish(registration)).seq)
            await wait_for(lambda: gone(admin, late), 30, "its later ones deleted", every_s=0.5)
            assert "node-x" not in svc.state.nodes

            await folds_as_the_log(svc, admin)
    finally:
        await bus.close(stray)
        with contextlib.suppress(Exception):
            await admin.close()


def attested(log: list[bus.Record]) -> set[int]:
    """Every sequence the leader's attestations in `log` vouch for or refuse."""
    out: set[int] = set()
    for r in log:
        if isinstance(r.event, events.LogAttested):
            for first, last in (*r.event.accepted, *r.event.payload_accepted, *r.event.refused):
                out.update(range(first, last + 1))
    return out


async def test_what_the_leader_deletes_it_does_not_attest(
    nats_server: TestNatsServer, connect: Connector
) -> None:
    """The leader attests each message its reader checked (a digest of 16 bytes for each it
    accepted, a run for those it refused) in `control.log_attested` events, which stay in
    the log. A quarantined node's flood, deleted, left its digests there for ever: the
    node went on writing the log through the leader, about 22 bytes a message, whatever
    its quarantine."""
    cfg = control_config(nats_server, "control-a", node_quota=QUOTA)
    admin = await connect.admin()
    agents: dict[str, SimAgent] = {}
    try:
        async with running(ControlService(cfg)) as svc:
            for node in ("node-a", "node-b"):
                agents[node] = await SimAgent(nats_server, node, gpus=1).start()
            await wait_for(lambda: len(svc.state.nodes) == 2, 20, "both nodes registered")
            b = agents["node-b"]
            await junk(b, 400)
            await wait_for(
                lambda: "node-b" in svc.state.quarantined, 30, "node-b quarantined", every_s=0.1
            )
            assert b._pub is not None
            late: list[int] = []
            for _ in range(10):
                batch = [
                    events.NodeRegistered(
                        id=b._id("again"), ts=time.time(), node="node-b", address="127.0.0.1"
                    )
                    for _ in range(100)
                ]
                late += [p.seq for p in await b._pub.publish_all(batch)]
            late += await junk(b, 300)
            await wait_for(
                lambda: gone(admin, late), 30, "node-b's later ones deleted", every_s=0.5
            )
            # Something to attest after them: node-a registers again.
            await agents["node-a"].register()
            log = await read_log(admin)
            after = log[-1].seq
            await wait_for(
                lambda: svc.attester._covered >= after, 30, "attested past them", every_s=0.2
            )
            log = await read_log(admin)
            assert after in attested(log)
            assert not attested(log) & set(late)
    finally:
        for agent in agents.values():
            await agent.close()
        with contextlib.suppress(Exception):
            await admin.close()


async def test_every_heartbeat_refused_for_its_ttl_goes_however_many_come_in_a_row(
    nats_server: TestNatsServer, connect: Connector
) -> None:
    """The leader deletes heartbeats whose TTL would keep them (llmgw.core.retention) after
    each batch it folds, from the reader's list of them, which keeps the latest 10,000.
    A node writing more than that in a row, with no event between them for a batch to
    end at, kept the rest in the log for ever (here no budget applies: only the TTL rule)."""
    cfg = control_config(nats_server, "control-a", node_quota=NodeQuota(enabled=False))
    admin = await connect.admin()
    stray = await connect_as(nats_server, "node", "node-x")
    signer = nats_server.pki.signer("node", "node-x")
    subject = subjects.node_event("node-x", "heartbeat")
    js = stray.jetstream()

    async def kept() -> int:
        info = await admin.jetstream().stream_info(subjects.STREAM, subjects_filter=subject)
        return sum((info.state.subjects or {}).values())

    try:
        async with running(ControlService(cfg)) as svc:
            await wait_for(lambda: svc.leading and svc.caught_up.is_set(), 20, "leading")
            written = 0
            for start in range(0, 12_000, 500):
                futures = []
                for i in range(start, start + 500):
                    beat = events.Heartbeat(id=f"x-{i}", ts=time.time(), node="node-x", seq=i)
                    payload = events.encode(beat)
                    headers = {
                        "Nats-Msg-Id": beat.id,
                        **signer.event_headers(subject, beat.id, payload),
                        "Nats-TTL": "never",
                    }
                    futures.append(
                        await js.publish_async(
                            subject, payload, headers=headers, stream=subjects.STREAM
                        )
                    )
                written += len([await f for f in futures])
            assert written == 12_000
            await wait_for(
                lambda: svc._reader is not None and svc._reader.last_seq >= 12_000,
                60,
                "read them all",
                every_s=0.2,
            )

            async def none_kept() -> bool:
                return await kept() == 0

            await wait_for(none_kept, 60, "every one deleted", every_s=0.5)
    finally:
        await bus.close(stray)
        with contextlib.suppress(Exception):
            await admin.close()


async def test_a_heartbeat_whose_ttl_the_server_does_not_read_is_refused_and_deleted(
    nats_server: TestNatsServer, connect: Connector
) -> None:
    """The server reads a message's TTL from `Nats-TTL` as written (`nats-ttl` it ignores:
    the message never expires); readers matched the name in any case. A heartbeat with
    `nats-ttl: 60` was accepted by every reader as expiring in a minute, and stayed in the
    log for ever. Readers now read the header the server reads: it has no TTL, so it is
    refused and the leader deletes it."""
    cfg = control_config(nats_server, "control-a", node_quota=NodeQuota(enabled=False))
    admin = await connect.admin()
    stray = await connect_as(nats_server, "node", "node-x")
    signer = nats_server.pki.signer("node", "node-x")
    subject = subjects.node_event("node-x", "heartbeat")
    try:
        async with running(ControlService(cfg)) as svc:
            await wait_for(lambda: svc.leading and svc.caught_up.is_set(), 20, "leading")
            seqs = []
            for i, name in enumerate(("nats-ttl", "NATS-TTL")):
                beat = events.Heartbeat(id=f"x-{i}", ts=time.time(), node="node-x", seq=i)
                payload = events.encode(beat)
                signed = signer.event_headers(subject, beat.id, payload)
                headers = {"Nats-Msg-Id": beat.id, **signed, name: "60"}
                ack = await stray.jetstream().publish(subject, payload, headers=headers)
                seqs.append(ack.seq)
            await wait_for(lambda: gone(admin, seqs), 20, "both deleted", every_s=0.5)
    finally:
        await bus.close(stray)
        with contextlib.suppress(Exception):
            await admin.close()

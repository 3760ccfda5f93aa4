"""What `llmgw ctl` reads back to an operator, against a real nats-server: a key's settings
after a change, the log's points, diffs and status. No control plane: the stream is
provisioned as the control identity and events are published as their writers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from aiohttp import web

from llmgw import bus
from llmgw.bus import counters as bus_counters
from llmgw.core import events, state, subjects
from llmgw.core.reconcile import ReconcileConfig
from llmgw.ctl import history
from llmgw.ctl.errors import BadInput
from tests.harness import TestNatsServer, connect_as
from tests.integration.ctl_kit import Ctl, node_a_registered
from tests.kit import local_app


@pytest.fixture
async def log(nats_server: TestNatsServer) -> AsyncIterator[bus.BusClient]:
    """A provisioned log with node-a registered; yields node-a's connection."""
    async with node_a_registered(nats_server) as node:
        yield node


async def test_key_update_json_shows_the_settings_it_made(
    nats_server: TestNatsServer, log: bus.BusClient
) -> None:
    ctl = Ctl(nats_server)
    made = await ctl("key", "create", "--name", "team-a", "--rps", "10", "--team", "red")
    assert made.code == 0, made
    updated = (await ctl("key", "update", "team-a", "--rps", "5", "--json")).json()
    # What it printed is the key as it is now, not as it was before the change.
    assert updated["requests_per_s"] == 5
    assert updated["team"] == "red"  # what was not given stays
    assert updated["changed_by"] == "alice"
    shown = (await ctl("key", "show", "team-a", "--json")).json()
    assert shown == updated


class OlderServer:
    """A connection to the log as a nats-server before 2.11 answers it: a direct get by
    `start_time` is an error (not 404) there. Everything else is the real server's."""

    def __init__(self, nc: bus.BusClient) -> None:
        self._nc = nc
        self.refused = 0

    async def request(self, subject: str, payload: bytes, **options: Any) -> Any:
        if b"start_time" in payload:
            self.refused += 1
            error = {"error": {"code": 400, "err_code": 10003, "description": "bad request"}}
            return SimpleNamespace(data=json.dumps(error).encode())
        return await self._nc.request(subject, payload, **options)


def alice_cordons(event_id: str) -> events.NodeCordoned:
    """Operator alice's cordon of node-a, now."""
    return events.NodeCordoned(id=event_id, ts=time.time(), operator="alice", node="node-a")


async def test_a_time_is_found_by_sequence_on_a_server_without_start_time(
    nats_server: TestNatsServer, log: bus.BusClient
) -> None:
    operator = await connect_as(nats_server, "operator", "alice")
    publisher = bus.Publisher(operator.jetstream())
    times = []
    try:
        for i in range(4):
            times.append(time.time())
            await asyncio.sleep(0.02)
            await publisher.publish(alice_cordons(f"c{i}"))
        older = OlderServer(operator)
        found = await history.first_seq_at_or_after(older, times[2])  # type: ignore[arg-type]
        assert older.refused == 1
        assert found == 4  # 1: the registration, then the cordons 2, 3, 4, 5
        assert await history.first_seq_at_or_after(operator, times[2]) == 4
    finally:
        await bus.close(operator)


async def test_a_search_by_sequence_finds_a_message_stored_at_the_very_moment(
    nats_server: TestNatsServer, log: bus.BusClient
) -> None:
    operator = await connect_as(nats_server, "operator", "alice")
    publisher = bus.Publisher(operator.jetstream())
    try:
        for i in range(3):
            await publisher.publish(alice_cordons(f"c{i}"))
        for seq in (1, 2, 3, 4):
            got = await history._message_at_or_after(operator, seq)
            assert got is not None
            assert got[0] == seq
            # The moment it was stored, to the nanosecond the server keeps: it is found.
            assert await history.search_seq_at_or_after(operator, got[1]) == seq
    finally:
        await bus.close(operator)


async def test_replay_at_a_moment_never_starts_from_a_snapshot_of_what_came_after_it(
    nats_server: TestNatsServer, log: bus.BusClient
) -> None:
    operator = await connect_as(nats_server, "operator", "alice")
    control = await connect_as(nats_server, "control", "control-a")
    try:
        moment = time.time()
        await asyncio.sleep(0.05)
        cordon = await bus.Publisher(operator.jetstream()).publish(alice_cordons("c-1"))
        # A snapshot that includes the cordon: the first record stored after the moment.
        after = await history.rebuild(operator, to_seq=cordon.seq, use_snapshots=False)
        store = await bus.SnapshotStore.open(control.jetstream())
        await store.save(state.encode_snapshot(after.state), cordon.seq)
        then = await history.rebuild(operator, at=moment)
        assert then.snapshot_seq < cordon.seq
        assert then.target_seq == cordon.seq - 1
        assert then.at == moment  # the state as of the moment asked, ages counted from it
        assert not then.state.nodes["node-a"].cordoned
        now = await history.rebuild(operator)
        assert now.snapshot_seq == cordon.seq  # the snapshot is used where it applies
        assert now.state.nodes["node-a"].cordoned
    finally:
        for nc in (operator, control):
            await bus.close(nc)


async def test_replay_at_a_time_of_an_empty_log_says_it_is_empty(
    nats_server: TestNatsServer,
) -> None:
    control = await connect_as(nats_server, "control", "control-a")
    try:
        await bus.provision(control.jetstream())
        with pytest.raises(BadInput, match="the log is empty"):
            await history.rebuild(control, at=time.time())
        assert (await history.rebuild(control)).target_seq == 0  # its end: nothing, no error
    finally:
        await bus.close(control)


async def test_replay_at_the_moment_a_record_was_stored_includes_it(
    nats_server: TestNatsServer, log: bus.BusClient
) -> None:
    operator = await connect_as(nats_server, "operator", "alice")
    try:
        cordon = await bus.Publisher(operator.jetstream()).publish(alice_cordons("c-1"))
        got = await history._message_at_or_after(operator, cordon.seq)
        assert got is not None
        then = await history.rebuild(operator, at=got[1])
        assert then.target_seq == cordon.seq
        assert then.state.nodes["node-a"].cordoned
    finally:
        await bus.close(operator)


async def test_events_from_a_sequence_begin_at_it_and_replay_shows_every_view(
    nats_server: TestNatsServer, log: bus.BusClient
) -> None:
    ctl = Ctl(nats_server)
    for reason in ("fan", "psu"):
        assert (await ctl("cordon", "node-a", "--reason", reason)).code == 0
    shown = (await ctl("events", "--seq", "2", "--json")).lines()
    assert [e["seq"] for e in shown] == [2, 3]
    assert shown[0]["event"]["reason"] == "fan"
    everything = (await ctl("replay", "--to", "2", "--json")).json()
    assert {"nodes", "replicas", "models", "endpoints"} <= set(everything)
    assert everything["nodes"][0]["cordon_reason"] == "fan"
    only = (await ctl("replay", "--to", "2", "--view", "models", "--json")).json()
    assert "models" in only
    assert "nodes" not in only


async def test_replay_to_a_sequence_reports_only_what_came_up_to_it(
    nats_server: TestNatsServer, log: bus.BusClient
) -> None:
    import nats

    operator = await connect_as(nats_server, "operator", "alice")
    admin = await nats.connect(
        nats_server.url, tls=nats_server.pki.admin_tls(), inbox_prefix="_INBOX.admin"
    )
    try:
        publisher = bus.Publisher(operator.jetstream())
        cordons = []
        for i in range(3):
            await asyncio.sleep(0.02)  # store times apart
            cordon = events.NodeCordoned(
                id=f"c{i}", ts=time.time(), operator="alice", node="node-a", reason=f"r{i}"
            )
            cordons.append(await publisher.publish(cordon))
        garbage = await admin.jetstream().publish(
            "llmgw.events.node.node-a.heartbeat", b"\xff not json"
        )
        middle = cordons[1].seq
        stored = await history._message_at_or_after(operator, middle)
        assert stored is not None
        then = await history.rebuild(operator, to_seq=middle)
        # Its time is that of the last record folded, not of the batch's last.
        assert then.at == stored[1]
        assert then.state.nodes["node-a"].cordon_reason == "r1"
        assert then.skipped == []  # the garbage came after the point asked for
        assert [s.seq for s in (await history.rebuild(operator)).skipped] == [garbage.seq]
    finally:
        await admin.close()
        await bus.close(operator)


@contextlib.asynccontextmanager
async def admin_api(answer: dict[str, Any]) -> AsyncIterator[str]:
    """A control plane's admin API as `ctl status` reads it (GET /v1/state), answering
    `answer`: a control plane that folded the log to where and what it says."""

    async def state_of(_: web.Request) -> web.Response:
        return web.json_response(answer)

    app = web.Application()
    app.router.add_get("/v1/state", state_of)
    async with local_app.served(app) as url:
        yield url


async def test_status_compares_a_lagging_control_plane_at_its_own_sequence(
    nats_server: TestNatsServer, log: bus.BusClient
) -> None:
    ctl = Ctl(nats_server)
    assert (await ctl("cordon", "node-a")).code == 0
    reader = await connect_as(nats_server, "router", "reader")
    try:
        at_1 = await history.rebuild(reader, to_seq=1)
    finally:
        await bus.close(reader)
    behind = {"instance": "control-b", "leading": False, "folded_seq": 1,
              "digest": state.digest(at_1.state)}  # fmt: skip
    async with admin_api(behind) as url:
        doc = (await ctl("status", "--control", url, "--json")).json()
        text = await ctl("status", "--control", url)
    assert doc["seq"] == 2
    assert doc["control"]["digest_agrees"] is True
    assert doc["control"]["lag"] == 1
    assert text.code == 0
    assert "control plane control-b (standby) at seq 1 (lag 1): same state" in text.stdout


async def test_status_exits_1_when_a_control_plane_folded_the_log_otherwise(
    nats_server: TestNatsServer, log: bus.BusClient
) -> None:
    ctl = Ctl(nats_server)
    reader = await connect_as(nats_server, "router", "reader")
    try:
        mine = await history.rebuild(reader)
    finally:
        await bus.close(reader)
    wrong = {"instance": "control-a", "leading": True, "folded_seq": mine.target_seq,
             "digest": "f" * 64}  # fmt: skip
    async with admin_api(wrong) as url:
        result = await ctl("status", "--control", url)
        as_json = await ctl("status", "--control", url, "--json")
    assert (result.code, as_json.code) == (1, 1)
    doc = json.loads(as_json.stdout)
    assert "DIFFERENT state: digest ffffffffffff" in result.stdout
    assert doc["control"]["digest_agrees"] is False


async def test_key_rotate_overlap_usage_of_one_key_and_revoking_an_unknown_one(
    nats_server: TestNatsServer, log: bus.BusClient
) -> None:
    ctl = Ctl(nats_server)
    for name in ("a", "b"):
        made = await ctl("key", "create", "--name", name, "--budget-tokens", "1k/day")
        assert made.code == 0, made
    before = time.time()
    assert (await ctl("key", "rotate", "a", "--overlap", "1h")).code == 0
    shown = (await ctl("key", "show", "a", "--json")).json()
    assert before + 3600 <= shown["previous_valid_until"] <= time.time() + 3600
    # One key's usage: its budget only, not every key's.
    usage = (await ctl("usage", "--key", "a", "--json")).json()
    assert [b["key"] for b in usage["budgets"]] == ["a"]
    assert [b["key"] for b in (await ctl("usage", "--json")).json()["budgets"]] == ["a", "b"]
    # Revoking a key that is not there writes nothing.
    last = (await history.bounds(log)).last_seq
    refused = await ctl("key", "revoke", "c")
    assert refused.code == 2
    assert "no key named 'c'" in refused.stderr
    assert (await history.bounds(log)).last_seq == last


async def test_usage_since_counts_the_hours_asked_for(
    nats_server: TestNatsServer, log: bus.BusClient
) -> None:
    ctl = Ctl(nats_server)
    assert (await ctl("key", "create", "--name", "a")).code == 0
    router = await connect_as(nats_server, "router", "r1")
    try:
        hour = int(time.time() // 3600)
        counters = bus_counters.Counters(router, timeout_s=5.0)
        await counters.add(subjects.usage_counter("a", hour, "m1", "req"), 3)
        await counters.add(subjects.usage_counter("a", hour - 5, "m1", "req"), 40)
    finally:
        await bus.close(router)

    async def requests(since: str) -> list[int]:
        doc = (await ctl("usage", "--key", "a", "--since", since, "--json")).json()
        return [row["requests"] for row in doc["usage"]]

    assert await requests("1h") == [3]
    assert await requests("6h") == [43]


async def test_verify_counts_decisions_not_elections_or_observations(
    nats_server: TestNatsServer, log: bus.BusClient
) -> None:
    control = await connect_as(nats_server, "control", "control-a")
    try:
        publisher = bus.Publisher(control.jetstream())
        await publisher.publish(
            events.LeaderElected(
                id="le-1",
                ts=time.time(),
                leader="control-a",
                epoch=1,
                reconcile=msgspec.to_builtins(ReconcileConfig()),
            )
        )
        await publisher.publish(
            events.NodeUnreachable(
                id="u-1",
                ts=time.time(),
                node="node-a",
                epoch=1,
                basis_seq=2,
                last_heartbeat=time.time() - 60,
            )
        )
    finally:
        await bus.close(control)
    result = await Ctl(nats_server)("replay", "--verify", "--json")
    doc = json.loads(result.stdout)
    assert (doc["events"], doc["decision_batches"]) == (3, 0)
    assert doc["ok"] is True
    assert doc["timings"]["recorded_epochs"] == [1]
    assert doc["timings"]["unrecorded_epochs"] == []
    assert result.code == 0


async def test_status_says_when_the_last_leader_was_elected(
    nats_server: TestNatsServer, log: bus.BusClient
) -> None:
    control = await connect_as(nats_server, "control", "control-a")
    elected = time.time() - 30
    try:
        await bus.Publisher(control.jetstream()).publish(
            events.LeaderElected(id="le-1", ts=elected, leader="control-a", epoch=1)
        )
    finally:
        await bus.close(control)
    shown = await Ctl(nats_server)("status")
    assert shown.code == 0, shown
    # Nobody holds the lease: no leader now, and when the last one was elected.
    assert "NO LEADER: the lease is free" in shown.stdout
    assert f"control-a (epoch 1, at {history.format_time(elected)})" in shown.stdout

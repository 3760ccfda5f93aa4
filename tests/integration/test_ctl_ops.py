"""`llmgw ctl` mutations, audit and bad input against a real nats-server.

No control plane here: the stream is provisioned as the control identity and a
node registers as its own node identity, which is all cordon, apply and events
need. What is shown: an operator event carries the certificate's CN and nothing
else; a router certificate cannot cordon (the server refuses the write); every
kind of bad input exits 2 with one line saying what to do; `events --follow` in a
real subprocess prints events as they arrive; a real subprocess whose reader goes away
ends as `yes | head` does.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from llmgw import bus
from llmgw.core import events, subjects
from llmgw.pki.identity import Identity
from tests.harness import TestNatsServer, TestPki, connect_as, wait_for
from tests.integration.control_kit import read_log, sim_gpus
from tests.integration.ctl_kit import ROOT, Ctl, node_a_registered

MODELS = """\
models:
  - name: m1
    engine: sim
    replicas: 2
  - name: m2
    engine: sim
    aliases: [m2-latest]
"""


@pytest.fixture
async def log(nats_server: TestNatsServer) -> AsyncIterator[bus.BusClient]:
    """A provisioned log with node-a registered; yields an admin-free reader (a router)."""
    async with node_a_registered(nats_server):
        reader = await connect_as(nats_server, "router", "reader")
        try:
            yield reader
        finally:
            await bus.close(reader)


async def test_a_cordon_carries_the_certificates_identity_and_a_router_cannot_cordon(
    nats_server: TestNatsServer, log: bus.BusClient
) -> None:
    carol = Ctl(nats_server, "operator", "carol")
    done = (await carol("cordon", "node-a", "--reason", "bad fan", "--json")).json()
    assert done["operator"] == "carol"
    records = await read_log(log)
    (cordon,) = [r for r in records if isinstance(r.event, events.NodeCordoned)]
    assert cordon.seq == done["seq"]
    assert cordon.event.operator == "carol"
    assert cordon.event.reason == "bad fan"
    # The author is in the subject, where the server enforced it.
    assert cordon.subject == "llmgw.events.operator.carol.node_cordoned"
    # The audit trail as ctl shows it.
    shown = (await carol("events", "--type", "operator", "--json")).lines()
    assert [(e["type"], e["event"]["operator"]) for e in shown] == [
        ("operator.node_cordoned", "carol")
    ]
    nodes = (await carol("nodes", "--json")).json()
    assert nodes[0]["cordoned"] is True
    assert nodes[0]["cordon_reason"] == "bad fan"

    # A router's certificate may read, but the server refuses its cordon.
    router = Ctl(nats_server, "router", "r1")
    assert (await router("nodes", "--json")).json()[0]["name"] == "node-a"
    refused = await router("uncordon", "node-a")
    assert refused.code == 1
    assert "refused" in refused.stderr
    assert "operator certificate" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    after = await read_log(log)
    assert not [r for r in after if isinstance(r.event, events.NodeUncordoned)]

    back = (await carol("uncordon", "node-a", "--json")).json()
    assert back["type"] == "operator.node_uncordoned"
    assert (await carol("nodes", "--json")).json()[0]["cordoned"] is False


async def test_apply_shows_the_diff_declares_changes_and_removes(
    nats_server: TestNatsServer, log: bus.BusClient, tmp_path: Path
) -> None:
    ctl = Ctl(nats_server)
    path = tmp_path / "models.yaml"
    path.write_text(MODELS)
    asked = await ctl("apply", "-f", str(path))
    assert asked.code == 2  # not a terminal and no --yes: nothing written
    assert "pass --yes" in asked.stderr
    assert "+ declare m1" in asked.stdout
    declared = (await ctl("apply", "-f", str(path), "--yes", "--json")).json()
    assert [(o["action"], o["name"]) for o in declared["operations"]] == [
        ("declare", "m1"),
        ("declare", "m2"),
    ]
    models = {m["name"]: m for m in (await ctl("models", "--json")).json()}
    assert models["m1"]["replicas_wanted"] == 2
    assert models["m2"]["aliases"] == ["m2-latest"]
    # Nothing to do the second time.
    again = await ctl("apply", "-f", str(path), "--yes")
    assert "nothing to do" in again.stdout
    # Change m1's replicas, drop m2.
    path.write_text("- name: m1\n  engine: sim\n  replicas: 3\n")
    shown = await ctl("apply", "-f", str(path), "--yes")
    assert shown.code == 0, shown
    assert "~ change m1" in shown.stdout
    assert "replicas: 2 -> 3" in shown.stdout
    assert "- remove m2" in shown.stdout
    assert "applied 2 changes as " in shown.stdout
    models = {m["name"]: m for m in (await ctl("models", "--json")).json()}
    assert set(models) == {"m1"}
    assert models["m1"]["replicas_wanted"] == 3
    records = await read_log(log)
    ops = [
        (events.tag_of(type(r.event)), r.event.operator)
        for r in records
        if isinstance(r.event, events.OperatorEvent)
    ]
    assert ops == [
        ("operator.model_declared", "alice"),
        ("operator.model_declared", "alice"),
        ("operator.model_removed", "alice"),
        ("operator.model_changed", "alice"),
    ]
    path.write_text("- name: m1\n  engine: sim\n  replicas: 4\n")
    one = await ctl("apply", "-f", str(path), "--yes")
    assert "applied 1 change as " in one.stdout


@pytest.mark.parametrize("text", ["", "models: []\n", "[]\n", "# nothing yet\n"])
async def test_an_empty_models_file_removes_nothing_without_allow_empty(
    nats_server: TestNatsServer, log: bus.BusClient, tmp_path: Path, text: str
) -> None:
    ctl = Ctl(nats_server)
    path = tmp_path / "models.yaml"
    path.write_text(MODELS)
    assert (await ctl("apply", "-f", str(path), "--yes")).code == 0
    path.write_text(text)
    refused = await ctl("apply", "-f", str(path), "--yes")
    assert refused.code == 2, refused
    assert "lists no models" in refused.stderr
    assert "--allow-empty" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    removed = [r for r in await read_log(log) if isinstance(r.event, events.ModelRemoved)]
    assert removed == []
    assert {m["name"] for m in (await ctl("models", "--json")).json()} == {"m1", "m2"}
    # --no-prune with an empty file changes nothing; --allow-empty removes them all.
    kept = await ctl("apply", "-f", str(path), "--yes", "--no-prune")
    assert kept.code == 0, kept
    assert "nothing to do" in kept.stdout
    emptied = await ctl("apply", "-f", str(path), "--yes", "--allow-empty")
    assert emptied.code == 0, emptied
    assert (await ctl("models", "--json")).json() == []


BAD_MODELS = {
    "not yaml": ("- name: m1\n  engine: [sim\n", "not valid YAML at line"),
    "unknown engine": ("- name: m1\n  engine: vllmx\n", "engine 'vllmx' is not supported"),
    "unknown field": ("- name: m1\n  engine: sim\n  replica: 2\n", "replica"),
    "bad tp": ("- name: m1\n  engine: sim\n  tensor_parallel: 0\n", "tensor_parallel"),
    "no name": ("- engine: sim\n", "has no `name`"),
    "a string": ("just words\n", "must hold a list of model profiles"),
    "twice": ("- name: m1\n  engine: sim\n- name: m1\n  engine: sim\n", "listed twice"),
}


@pytest.mark.parametrize("case", sorted(BAD_MODELS))
async def test_a_malformed_models_yaml_is_refused_with_one_line(
    nats_server: TestNatsServer, log: bus.BusClient, tmp_path: Path, case: str
) -> None:
    text, expected = BAD_MODELS[case]
    path = tmp_path / "models.yaml"
    path.write_text(text)
    result = await Ctl(nats_server)("apply", "-f", str(path), "--yes")
    assert result.code == 2, result
    assert expected in result.stderr
    assert result.stderr.startswith("error: ")
    assert len(result.stderr.strip().splitlines()) == 1
    assert not [r for r in await read_log(log) if isinstance(r.event, events.OperatorEvent)]


async def test_bad_input_exits_2_with_a_line_that_says_what_to_do(
    nats_server: TestNatsServer, log: bus.BusClient
) -> None:
    ctl = Ctl(nats_server)
    cases = [
        (("cordon", "node-zz"), "unknown node 'node-zz'", "llmgw ctl nodes"),
        (("drain", "node-zz"), "unknown node 'node-zz'", "llmgw ctl nodes"),
        (("uncordon", "node-zz"), "unknown node 'node-zz'", "llmgw ctl nodes"),
        (("explain-placement", "nope"), "unknown model 'nope'", "llmgw ctl models"),
        (("replicas", "--model", "nope"), "unknown model 'nope'", "llmgw ctl models"),
        (("replay", "--timeline", "nothing"), "no node, replica or model 'nothing'", "ctl nodes"),
        (("replay", "--at", "2001-01-01T00:00:00Z"), "before the log begins", "later time"),
        (("replay", "--at", "yesterday-ish"), "cannot read 'yesterday-ish' as a time", "ISO"),
        (("replay", "--to", "999999"), "beyond the end of the log", "smaller"),
        (("events", "--type", "bogus"), "no event type matches 'bogus'", "use one of"),
        # The server's refusal of a sequence beyond 64 bits was reported as a stream to
        # provision; a NaN timeout made the wait for the drain spin (asyncio.wait(nan)).
        (("events", "--seq", "9" * 21), "--seq 999999999999999999999", "at most"),
        (("drain", "node-a", "--wait", "--timeout", "nan"), "--timeout", "above 0"),
        (("drain", "node-a", "--wait", "--timeout", "0"), "--timeout", "above 0"),
    ]
    for args, what, todo in cases:
        result = await ctl(*args)
        assert result.code == 2, (args, result)
        line = result.stderr.strip()
        assert len(line.splitlines()) == 1, (args, line)
        assert what in line, (args, line)
        assert todo in line, (args, line)
    # The same through the real command line: exit status and stderr of the process.
    real = await ctl.subprocess("replay", "--at", "2001-01-01T00:00:00Z")
    assert real.code == 2
    assert "before the log begins" in real.stderr
    assert len(real.stderr.strip().splitlines()) == 1
    real = await ctl.subprocess("cordon", "node-zz")
    assert real.code == 2
    assert real.stderr.startswith("error: unknown node 'node-zz'")


async def test_an_event_the_logs_readers_would_refuse_is_not_written(
    nats_server: TestNatsServer, log: bus.BusClient
) -> None:
    # ctl printed "node-a cordoned (seq 2)" for a 20,000-character reason and "drain
    # requested" for --grace 1e308 or inf, but every reader skips an event outside the
    # bounds of llmgw.core.limits: the operator's cordon or drain silently did nothing.
    ctl = Ctl(nats_server)
    cases = [
        (("cordon", "node-a", "--reason", "x" * 20_000), "reason"),
        (("drain", "node-a", "--grace", "1e308"), "--grace"),
        (("drain", "node-a", "--grace", "inf"), "--grace"),
    ]
    for args, what in cases:
        result = await ctl(*args)
        assert result.code == 2, (args[:3], result)
        line = result.stderr.strip()
        assert len(line.splitlines()) == 1, line
        assert what in line, line
        assert "nothing was written" in line or "seconds" in line, line
    assert (await log.jetstream().stream_info(subjects.STREAM)).state.messages == 1


async def test_unreachable_nats_is_an_operational_failure(
    nats_server: TestNatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMGW_CTL__CONNECT_TIMEOUT_S", "1")
    ctl = Ctl(nats_server)
    ctl.flags[1] = "tls://127.0.0.1:1"
    result = await ctl("nodes")
    assert result.code == 1
    assert "cannot connect to NATS" in result.stderr


async def test_a_certificate_that_cannot_connect_says_why(
    nats_server: TestNatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An expired certificate, or a --ca that did not sign the server's, was reported after
    # the whole connect timeout as "cannot connect to NATS ...: TimeoutError".
    monkeypatch.setenv("LLMGW_CTL__CONNECT_TIMEOUT_S", "1")
    ctl = Ctl(nats_server, name="old")
    nats_server.pki.expired_tls("operator", "old")
    result = await ctl("nodes")
    assert result.code == 2, result
    assert "expired on" in result.stderr
    assert "llmgw ctl cert issue operator old" in result.stderr
    ctl = Ctl(nats_server)
    ctl.flags[3] = str(TestPki(tmp_path / "other").certs.ca_cert)
    result = await ctl("nodes")
    assert result.code == 1, result
    assert "TimeoutError" not in result.stderr
    assert "unable to get local issuer certificate" in result.stderr
    assert "--ca" in result.stderr


async def test_a_certificate_the_servers_authorization_does_not_list_says_to_reload(
    nats_server: TestNatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issued by the CA (the handshake passes) after the server last loaded its
    # authorization: ctl said "check --server, that nats-server runs, and that this
    # certificate was issued by the fleet's CA", none of which was the matter.
    monkeypatch.setenv("LLMGW_CTL__CONNECT_TIMEOUT_S", "2")
    ctl = Ctl(nats_server)
    newcomer = nats_server.pki.issue(Identity("operator", "newcomer"), reload=False)
    ctl.flags[5] = str(nats_server.pki.certs.cert(newcomer))
    result = await ctl("nodes")
    assert result.code == 1, result
    line = result.stderr.strip()
    assert "does not list operator/newcomer" in line, line
    assert "reload" in line, line
    assert "llmgw ctl cert list" in line, line
    assert "issued by the fleet's CA" not in line, line


def _with_a_long_timeout(argv: list[str]) -> tuple[subprocess.CompletedProcess[str], float]:
    """`llmgw ARGV...` (ctl, console) as a real process with a 60 s connect timeout: how it
    ended, and the seconds it took (killed, and a failure, past 150)."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "llmgw", *argv],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=ROOT,
        env={**os.environ, "NO_COLOR": "1", "LLMGW_CTL__CONNECT_TIMEOUT_S": "60"},
    )
    return done, time.monotonic() - started


async def test_a_ca_that_did_not_sign_the_servers_certificate_fails_at_once(
    nats_server: TestNatsServer, tmp_path: Path
) -> None:
    """A refused handshake is not an outage: ctl said so only after its connect timeout
    (twice over, with its tries), here a minute; now at the first refusal, well within."""
    ctl = Ctl(nats_server)
    wrong_ca = TestPki(tmp_path / "other").certs.ca_cert
    ctl.flags[3] = str(wrong_ca)
    done, took = await asyncio.to_thread(_with_a_long_timeout, ctl.argv("nodes"))
    assert done.returncode == 1, done
    said = done.stderr.strip()
    assert len(said.splitlines()) == 1, said
    assert (
        f"the server's certificate at {nats_server.url} is not signed by the CA in {wrong_ca}"
        in said
    )
    assert said.endswith("pass the fleet's CA with --ca"), said
    assert took < 30, (took, said)


async def test_the_console_with_a_ca_that_did_not_sign_the_servers_certificate_fails_at_once(
    nats_server: TestNatsServer, tmp_path: Path
) -> None:
    """`llmgw console` connects as ctl does, and reconnects for ever once connected: its
    start is refused at once all the same."""
    ctl = Ctl(nats_server)
    wrong_ca = TestPki(tmp_path / "other").certs.ca_cert
    ctl.flags[3] = str(wrong_ca)
    argv = ["console", "--port", "0", *ctl.flags]
    done, took = await asyncio.to_thread(_with_a_long_timeout, argv)
    assert done.returncode == 1, done
    assert f"is not signed by the CA in {wrong_ca}" in done.stderr, done.stderr
    assert took < 30, (took, done.stderr)


async def test_a_certificate_the_server_refuses_fails_at_once(
    nats_server: TestNatsServer,
) -> None:
    ctl = Ctl(nats_server)
    nats_server.pki.foreign_tls("operator", "alice")  # the same DN, another CA's signature
    foreign = nats_server.pki.root / "foreign" / "operator-alice.pem"
    ctl.flags[5] = str(foreign)  # its key beside it, as ctl looks for it
    done, took = await asyncio.to_thread(_with_a_long_timeout, ctl.argv("nodes"))
    assert done.returncode == 1, done
    said = done.stderr.strip()
    assert len(said.splitlines()) == 1, said
    assert f"the server at {nats_server.url} refused this identity's certificate" in said
    assert str(foreign) in said
    assert "--cert" in said
    assert took < 30, (took, said)


async def test_events_filters_and_follow_in_a_real_process(
    nats_server: TestNatsServer, log: bus.BusClient
) -> None:
    ctl = Ctl(nats_server)
    assert (await ctl("cordon", "node-a")).code == 0
    everything = (await ctl("events", "--json")).lines()
    assert [e["type"] for e in everything] == ["node.registered", "operator.node_cordoned"]
    assert everything[0]["seq"] == 1
    assert [e["seq"] for e in (await ctl("events", "--seq", "2", "--json")).lines()] == [2]
    assert (await ctl("events", "--node", "node-b", "--json")).lines() == []
    assert len((await ctl("events", "--node", "node-a", "--json")).lines()) == 2
    assert len((await ctl("events", "--since", "10m", "--json")).lines()) == 2
    text = await ctl("events")
    assert "node-a cordoned by alice" in text.stdout
    assert "\x1b[" not in text.stdout  # no colour off a terminal

    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "llmgw",
        *ctl.argv("events", "--follow", "--json"),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
        env={**os.environ, "NO_COLOR": "1"},
    )
    try:
        assert proc.stdout is not None
        stdout = proc.stdout

        async def read_one() -> dict[str, object]:
            line = await asyncio.wait_for(stdout.readline(), 30)
            return json.loads(line)  # type: ignore[no-any-return]

        lines = [await read_one(), await read_one()]
        await ctl("uncordon", "node-a")
        lines.append(await read_one())
        assert [e["type"] for e in lines] == [
            "node.registered",
            "operator.node_cordoned",
            "operator.node_uncordoned",
        ]
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)


async def test_replay_shows_what_the_fold_refused_and_what_did_not_decode(
    nats_server: TestNatsServer, log: bus.BusClient
) -> None:
    import nats

    admin = await nats.connect(
        nats_server.url, tls=nats_server.pki.admin_tls(), inbox_prefix="_INBOX.admin"
    )
    try:
        js = admin.jetstream()
        garbage = await js.publish("llmgw.events.node.node-a.heartbeat", b"\xff not json")
        node = await connect_as(nats_server, "node", "node-a")
        refused = await bus.Publisher(node.jetstream()).publish(
            events.ShardStatus(
                id="st-1", ts=time.time(), node="node-a", replica_id="ghost", generation=1,
                phase="serving",
            )
        )  # fmt: skip
        await node.close()
    finally:
        await admin.close()
    ctl = Ctl(nats_server)
    doc = (await ctl("replay", "--json")).json()
    assert [x["seq"] for x in doc["skipped"]] == [garbage.seq]
    assert doc["skipped"][0]["subject"] == "llmgw.events.node.node-a.heartbeat"
    assert [x["seq"] for x in doc["rejected"]] == [refused.seq]
    assert "never placed" in doc["rejected"][0]["reason"]
    text = (await ctl("replay")).stdout
    assert f"seq {garbage.seq} llmgw.events.node.node-a.heartbeat" in text
    assert f"seq {refused.seq}: status for shard 0 of replica 'ghost'" in text
    assert "1 refused by the fold; 1 undecodable skipped" in text
    # And the events listing goes on past the garbage.
    assert [e["seq"] for e in (await ctl("events", "--json")).lines()] == [1, refused.seq]


async def test_a_log_that_was_never_provisioned_says_how_to_provision_it(
    nats_server: TestNatsServer,
) -> None:
    result = await Ctl(nats_server)("nodes")
    assert result.code == 1
    assert "llmgw control" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


async def test_drain_of_an_empty_node_is_done_at_once(
    nats_server: TestNatsServer, log: bus.BusClient
) -> None:
    ctl = Ctl(nats_server)
    empty = (await ctl("drain", "node-a", "--wait", "--json")).json()
    assert empty["moves"] == []
    assert empty["progress"]["done"]
    assert (await ctl("nodes", "--json")).json()[0]["draining"]


async def test_a_time_finds_the_same_sequence_with_or_without_start_time(
    nats_server: TestNatsServer, log: bus.BusClient
) -> None:
    from llmgw.ctl import history

    operator = await connect_as(nats_server, "operator", "alice")
    publisher = bus.Publisher(operator.jetstream())
    times = []
    for i in range(6):
        times.append(time.time())
        await asyncio.sleep(0.02)
        await publisher.publish(
            events.NodeCordoned(id=f"c{i}", ts=time.time(), operator="alice", node="node-a")
        )
    try:
        for when in [0.0, *times, time.time() + 10]:
            direct = await history.first_seq_at_or_after(operator, when)
            searched = await history.search_seq_at_or_after(operator, when)
            assert direct == searched, when
        assert await history.first_seq_at_or_after(operator, times[3]) == 5  # 1: registration
    finally:
        await operator.close()


async def test_replay_of_a_moment_whose_heartbeats_expired_says_their_age_is_unknown(
    nats_server: TestNatsServer, log: bus.BusClient
) -> None:
    node = await connect_as(nats_server, "node", "node-a")
    pub = bus.Publisher(node.jetstream())
    try:
        early = await pub.publish(
            events.Heartbeat(id="hb-1", ts=time.time(), node="node-a", seq=1), ttl_s=1
        )
        assert early.seq > 1
        await asyncio.sleep(0.05)
        moment = f"@{time.time():.3f}"  # the moment replayed: just after that heartbeat

        async def expired() -> bool:
            doc = (await Ctl(nats_server)("events", "--json")).lines()
            return early.seq not in [e["seq"] for e in doc]

        await wait_for(expired, 30, "the short-lived heartbeat expiring", every_s=0.3)
        await pub.publish(
            events.Heartbeat(id="hb-2", ts=time.time(), node="node-a", seq=2), ttl_s=600
        )
    finally:
        await node.close()
    ctl = Ctl(nats_server)
    doc = (await ctl("replay", "--at", moment, "--view", "nodes", "--json")).json()
    row = doc["nodes"][0]
    # Without the heartbeat, its last sign of life is the registration: an age counted
    # from there would say how long ago it registered. Unknown, and said so.
    assert row["heartbeat_age_s"] is None
    assert row["heartbeat_expired"] is True
    assert doc["heartbeats_expired_before"] is not None
    text = (await ctl("replay", "--at", moment, "--view", "nodes")).stdout
    assert "have expired from the log" in text
    assert "expired" in text.splitlines()[-1]
    # The end of the log, with a live heartbeat: an age.
    now = (await ctl("nodes", "--json")).json()
    assert now[0]["heartbeat_age_s"] is not None


def spawn_into_pipe(argv: list[str]) -> tuple[subprocess.Popen[bytes], int]:
    """`python -m llmgw ARGV` with its stdout into a new pipe: the process and the pipe's
    read end."""
    read_end, write_end = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmgw", *argv],
            stdin=subprocess.DEVNULL,
            stdout=write_end,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env={**os.environ, "NO_COLOR": "1"},
        )
    finally:
        os.close(write_end)
    return proc, read_end


def read_one_line(read_end: int) -> bytes:
    """One line of the pipe, read a byte at a time (nothing beyond it), then its end closed:
    the pipe's only reader is gone, as `head -1`'s is."""
    with os.fdopen(read_end, "rb", buffering=0) as reader:
        line = b""
        while not line.endswith(b"\n"):
            byte = reader.read(1)
            if not byte:
                break
            line += byte
    return line


async def publish_registrations(server: TestNatsServer, count: int) -> None:
    node = await connect_as(server, "node", "node-a")
    try:
        publisher = bus.Publisher(node.jetstream())
        for _ in range(count):
            await publisher.publish(
                events.NodeRegistered(id=os.urandom(8).hex(), ts=time.time(), node="node-a",
                                      address="127.0.0.1", gpus=sim_gpus(2))
            )  # fmt: skip
    finally:
        await bus.close(node)


async def test_a_command_whose_reader_goes_away_ends_quietly_as_sigpipe_would(
    nats_server: TestNatsServer, log: bus.BusClient
) -> None:
    """`llmgw ctl events | head -1` exited 1: a command whose output meets a closed pipe
    ends with a shell's status for a process killed by SIGPIPE (141, as `yes | head`
    does), printing nothing: one following the log whose reader read a line and left
    before the next event, and ones whose reader was gone before they printed."""
    await publish_registrations(nats_server, 100)
    ctl = Ctl(nats_server)
    for args in (["events", "--follow"], ["events", "--follow", "--json"]):
        proc, read_end = spawn_into_pipe(ctl.argv(*args))
        line = await asyncio.to_thread(read_one_line, read_end)
        assert line, args
        await publish_registrations(nats_server, 1)  # printed once the reader is gone
        _, err = await asyncio.to_thread(proc.communicate, timeout=120)
        assert (proc.returncode, err) == (141, b""), args
    for argv in (ctl.argv("events"), ctl.argv("events", "--json"), ctl.argv("nodes"),
                 ["ctl", "--help"], ["version"]):  # fmt: skip
        proc, read_end = spawn_into_pipe(argv)
        os.close(read_end)
        _, err = await asyncio.to_thread(proc.communicate, timeout=120)
        assert (proc.returncode, err) == (141, b""), argv

"""The bus's pure parts, and the reader's message intake fed directly (no server).

The integration tests (tests/integration/test_bus.py) show the behaviour against a
real nats-server; these pin down the computations and the robustness of the one
function that sees every byte a server sends to a reader.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nats.js import api

from llmgw import bus
from llmgw.bus import counters as bus_counters
from llmgw.bus import natspy, provisioning, publisher, reader, snapshots
from llmgw.core import events, retention, subjects
from llmgw.pki import signing
from llmgw.pki.ca import CertificateAuthority
from llmgw.pki.identity import Identity

# The intake tests feed unsigned events: a verifier that takes them as a log written
# before signing existed (tests/unit/test_signing.py covers signed intake).
_NOW = datetime.datetime.now(datetime.UTC)
_CA = CertificateAuthority.create(now=_NOW, name="unit CA")
LEGACY = signing.Verifier(_CA.cert, accept_unsigned_before=10**12)
_NODE_A = _CA.issue_client(Identity("node", "node-a"), now=_NOW)
NODE_A = signing.Signer.from_pem(_NODE_A.cert_pem, _NODE_A.key_pem)


def shard(i: int) -> events.ShardStatus:
    return events.ShardStatus(
        id=f"s{i}", ts=float(i), node="node-a", replica_id="r", generation=1, phase="serving"
    )


# --------------------------------------------------------------------------- backoff


@given(attempt=st.integers(1, 200), seed=st.integers(0, 2**32))
def test_backoff_stays_inside_its_growing_window(attempt: int, seed: int) -> None:
    delay = bus.backoff_delay(attempt, base=0.25, cap=10.0, rand=random.Random(seed))
    window = min(10.0, 0.25 * 2 ** (attempt - 1))
    assert 0.1 * window <= delay <= window


def test_backoff_is_jittered_and_grows() -> None:
    rand = random.Random(7)
    firsts = {bus.backoff_delay(1, base=1.0, cap=60.0, rand=rand) for _ in range(50)}
    assert len(firsts) > 40  # clients restarted together do not retry in lockstep
    late = [bus.backoff_delay(8, base=1.0, cap=60.0, rand=rand) for _ in range(200)]
    assert sum(late) / len(late) > 10 * sum(firsts) / len(firsts)


# --------------------------------------------------------------------------- provisioning


def test_the_stream_llmgw_needs() -> None:
    config = provisioning.stream_config(bus.StreamSettings(replicas=3))
    assert config.name == subjects.STREAM == "llmgw-events"
    assert config.subjects == ["llmgw.events.>", "llmgw.cmd.>"]
    assert config.storage == api.StorageType.FILE
    assert config.num_replicas == 3
    assert config.allow_direct
    assert config.allow_msg_ttl
    assert provisioning.stream_conflicts(config, config) == []


def test_every_conflict_is_named() -> None:
    wanted = provisioning.stream_config(bus.StreamSettings())
    existing = provisioning.stream_config(bus.StreamSettings(replicas=3, duplicate_window_s=5))
    existing.subjects = ["llmgw.>"]
    existing.storage = api.StorageType.MEMORY
    existing.allow_msg_ttl = False
    existing.max_age = 3600.0
    existing.max_msgs_per_subject = 10
    problems = provisioning.stream_conflicts(existing, wanted)
    joined = "; ".join(problems)
    for fragment in (
        "subjects are ['llmgw.>']",
        "storage is 'memory' (llmgw needs 'file')",
        "replicas is 3 (configured: 1)",
        "duplicate_window is 5s (configured: 120s)",
        "allow_msg_ttl is False",
        "max_age is 3600s",
        "max_msgs_per_subject is 10",
    ):
        assert fragment in joined
    assert len(problems) == 7


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"subjects": ["llmgw.events.>", "llmgw.cmd.>", "other.>"]}, "subjects are"),
        ({"duplicate_window": 120.5}, "duplicate_window is 120.5s (configured: 120s)"),
        ({"max_msgs": 1}, "max_msgs is 1: the log would lose history"),
        ({"max_bytes": 1}, "max_bytes is 1: the log would lose history"),
        ({"sealed": True}, "the stream is sealed"),
        ({"discard": api.DiscardPolicy.NEW}, "discard is 'new' (llmgw needs 'old')"),
        ({"retention": api.RetentionPolicy.WORK_QUEUE}, "retention is 'workqueue'"),
    ],
)
def test_each_conflict_alone_is_named(change: dict[str, object], fragment: str) -> None:
    wanted = provisioning.stream_config(bus.StreamSettings())
    existing = provisioning.stream_config(bus.StreamSettings())
    for field, value in change.items():
        setattr(existing, field, value)
    [problem] = provisioning.stream_conflicts(existing, wanted)
    assert fragment in problem


def test_the_counter_streams_keep_one_total_per_subject() -> None:
    settings = bus.StreamSettings()
    limits = provisioning.limits_stream_config(settings)
    usage = provisioning.usage_stream_config(settings)
    for cfg in (limits, usage):
        assert cfg.allow_msg_counter
        assert cfg.max_msgs_per_subject == 1
    assert limits.storage == api.StorageType.MEMORY  # a restart forgives the current window
    assert usage.storage == api.StorageType.FILE  # budgets outlive a restart


# --------------------------------------------------------------------------- publishing


def test_publish_headers_carry_id_ttl_fence_and_signature() -> None:
    fence = bus.Fence(subjects.CONTROL_EVENTS_ALL, 41)
    event = events.Heartbeat(id="s1", ts=1.0, node="node-a", seq=1)
    subject, payload = events.subject_of(event), events.encode(event)
    headers = publisher._headers(NODE_A, subject, event, payload, 1.2, fence)
    sig, cert = headers.pop("Llmgw-Sig"), headers.pop("Llmgw-Cert")
    assert headers == {
        "Nats-Msg-Id": "s1",
        "Nats-TTL": "2s",  # rounded up: never expire early
        "Nats-Expected-Last-Subject-Sequence": "41",
        "Nats-Expected-Last-Subject-Sequence-Subject": "llmgw.events.control.>",
    }
    signed = signing.event_message(subject, "s1", payload)
    assert LEGACY.verify(signed, sig, cert, time.time()) == Identity("node", "node-a")
    # A heartbeat always expires; nothing else may.
    beat = publisher._headers(NODE_A, subject, event, payload, None, None)
    assert beat["Nats-TTL"] == f"{publisher.DEFAULT_HEARTBEAT_TTL_S:.0f}s"
    assert publisher._headers(NODE_A, subject, event, payload, 10**9, None)["Nats-TTL"] == (
        f"{retention.MAX_HEARTBEAT_TTL_S:.0f}s"
    )
    other = shard(1)
    other_subject, other_payload = events.subject_of(other), events.encode(other)
    plain = publisher._headers(NODE_A, other_subject, other, other_payload, None, None)
    assert set(plain) == {"Nats-Msg-Id", "Llmgw-Sig", "Llmgw-Cert"}
    with pytest.raises(ValueError, match="only heartbeats"):
        publisher._headers(NODE_A, other_subject, other, other_payload, 60, None)
    with pytest.raises(ValueError, match="ttl_s must be positive"):
        publisher._headers(NODE_A, subject, event, payload, 0, None)


# --------------------------------------------------------------------------- snapshots


@given(st.integers(0, 10**19))
def test_snapshot_names_round_trip_and_sort_like_sequences(seq: int) -> None:
    name = snapshots.object_name(seq)
    assert snapshots.seq_of(name) == seq
    assert (name < snapshots.object_name(seq + 1)) is True


@given(st.lists(st.integers(0, 1000), max_size=20), st.none() | st.integers(0, 1000))
def test_choose_picks_the_newest_at_or_before(seqs: list[int], limit: int | None) -> None:
    chosen = snapshots.choose(seqs, limit)
    eligible = [s for s in seqs if limit is None or s <= limit]
    assert chosen == (max(eligible) if eligible else None)


def test_other_objects_are_not_snapshots() -> None:
    assert snapshots.seq_of("state-12") is None
    assert snapshots.seq_of("notes.txt") is None
    # A snapshot's name with anything after it is another object, not that snapshot.
    name = snapshots.object_name(12)
    assert snapshots.seq_of(name) == 12
    assert snapshots.seq_of(name + ".bak") is None
    assert snapshots.seq_of(name + "0") is None


# --------------------------------------------------------------------------- reader intake


def ack_subject(seq: int, cseq: int, pending: int, ts_ns: int = 1_800_000_000 * 10**9) -> bytes:
    return f"$JS.ACK.llmgw-events.reader-x.1.{seq}.{cseq}.{ts_ns}.{pending}".encode()


class _NoClient:
    """Stands in for the connection: intake tests never touch the network."""


def intake() -> reader.Reader:
    return reader.Reader(_NoClient(), after_seq=0, verifier=LEGACY)  # type: ignore[arg-type]


async def test_intake_decodes_in_order_and_skips_garbage_with_its_sequence() -> None:
    r = intake()
    r._outstanding = 10
    subject = b"llmgw.events.node.node-a.shard"
    r._on_raw(subject, ack_subject(5, 1, 2), events.encode(shard(1)), b"NATS/1.0\r\n")
    r._on_raw(subject, ack_subject(6, 2, 1), b"\x00garbage", b"")
    r._on_raw(subject, ack_subject(7, 3, 0), events.encode(shard(2)), b"")
    assert [(rec.seq, rec.event) for rec in r._buf] == [(5, shard(1)), (7, shard(2))]
    assert r._buf[0].subject == "llmgw.events.node.node-a.shard"
    assert r._buf[0].time == 1_800_000_000.0
    assert r.undecodable == 1
    assert [s.seq for s in r.skipped] == [6]
    assert r.last_seq == 7
    assert r.caught_up.is_set()


async def test_intake_a_gap_in_consumer_sequence_asks_for_a_reset() -> None:
    r = intake()
    r._outstanding = 10
    subject = b"llmgw.events.node.node-a.shard"
    r._on_raw(subject, ack_subject(5, 1, 9), events.encode(shard(1)), b"")
    r._on_raw(subject, ack_subject(9, 3, 5), events.encode(shard(2)), b"")  # cseq 2 lost
    r._on_raw(subject, ack_subject(10, 4, 4), events.encode(shard(3)), b"")
    assert [rec.seq for rec in r._buf] == [5]
    assert r._reset_needed
    assert r.last_seq == 5  # the new consumer starts after 5: nothing is missed


async def test_intake_an_empty_message_is_skipped_and_asks_for_a_new_consumer_after_it() -> None:
    # The server ends a response it streams to another account at a message with neither
    # payload nor headers: nothing more of the pull request comes.
    r = intake()
    r._outstanding = 10
    subject = b"llmgw.events.node.node-a.shard"
    r._on_raw(subject, ack_subject(5, 1, 2), events.encode(shard(1)), b"")
    assert not r._reset_needed
    r._on_raw(subject, ack_subject(6, 2, 1), b"", b"")
    assert r._reset_needed
    assert r.last_seq == 6  # the new consumer starts after it
    assert [rec.seq for rec in r._buf] == [5]
    assert [s.seq for s in r.skipped] == [6]
    # Headers, or a payload, do not end the response.
    for data, headers in ((b"", b"NATS/1.0\r\nX: y\r\n\r\n"), (b"x", b"")):
        other = intake()
        other._outstanding = 10
        other._on_raw(subject, ack_subject(6, 1, 1), data, headers)
        assert not other._reset_needed
        assert other.last_seq == 6


def test_a_counters_answer_that_is_an_error_says_the_servers_words() -> None:
    refused = b'{"error": {"code": 400, "description": "message counters is disabled"}}'
    with pytest.raises(bus_counters.CounterError, match=r"x\.y: message counters is disabled"):
        bus_counters.total_of(refused, "x.y")
    with pytest.raises(bus_counters.CounterError, match="not a counter's answer"):
        bus_counters.total_of(b'{"val": "many"}', "x.y")
    assert bus_counters.total_of(b'{"val": "-3"}', "x.y") == -3


async def test_intake_status_messages_end_the_request() -> None:
    r = intake()
    r._request_open = True
    r._on_raw(b"_INBOX.x", b"", b"", b"NATS/1.0 100 Idle Heartbeat\r\n\r\n")
    assert r._request_open
    r._on_raw(b"_INBOX.x", b"", b"", b"NATS/1.0 408 Request Timeout\r\n\r\n")
    assert not r._request_open
    assert not r._reset_needed
    r._request_open = True
    r._on_raw(b"_INBOX.x", b"", b"", b"NATS/1.0 409 Consumer Deleted\r\n\r\n")
    assert r._reset_needed


@settings(max_examples=300, deadline=None)
@given(
    subject=st.binary(max_size=40),
    reply=st.one_of(
        st.binary(max_size=80),
        st.lists(st.binary(max_size=12), min_size=1, max_size=14).map(
            lambda parts: b"$JS.ACK." + b".".join(parts)
        ),
    ),
    data=st.binary(max_size=200),
    headers=st.one_of(st.binary(max_size=60), st.binary(max_size=40).map(b"NATS/1.0 ".__add__)),
)
def test_intake_never_raises_whatever_arrives(
    subject: bytes, reply: bytes, data: bytes, headers: bytes
) -> None:
    async def feed() -> None:
        r = intake()
        r._outstanding = 5
        r._on_raw(subject, reply, data, headers)
        assert r.undecodable + len(r._buf) <= 1

    asyncio.run(feed())


def test_start_time_is_rfc3339_utc() -> None:
    assert reader._start_time(0.5) == "1970-01-01T00:00:00.500000Z"
    aware = datetime.datetime(
        2026, 11, 29, 4, 12, tzinfo=datetime.timezone(datetime.timedelta(hours=1))
    )
    assert reader._start_time(aware) == "2026-11-29T03:12:00Z"


def test_consumer_start_points() -> None:
    def config(**kwargs: object) -> dict[str, object]:
        made = reader.Reader(_NoClient(), verifier=LEGACY, **kwargs)  # type: ignore[arg-type]
        return made._consumer_config("c")

    assert config()["deliver_policy"] == "all"
    after = config(after_seq=41)
    assert (after["deliver_policy"], after["opt_start_seq"]) == ("by_start_sequence", 42)
    since = config(since=0.5)
    assert (since["deliver_policy"], since["opt_start_time"]) == (
        "by_start_time",
        "1970-01-01T00:00:00.500000Z",
    )
    # After messages arrived, a reset resumes after the last one, whatever the start was.
    r = reader.Reader(_NoClient(), since=0.5, verifier=LEGACY)  # type: ignore[arg-type]
    r.last_seq = 7
    assert r._consumer_config("c")["opt_start_seq"] == 8
    assert "filter_subject" not in config()
    one = config(subjects_filter=["llmgw.cmd.node-a"])
    assert one["filter_subject"] == "llmgw.cmd.node-a"
    two = config(subjects_filter=["llmgw.events.control.>", "llmgw.cmd.>"])
    assert two["filter_subjects"] == ["llmgw.events.control.>", "llmgw.cmd.>"]


async def test_a_client_that_may_give_up_does_give_up_on_a_dead_server() -> None:
    import socket

    import nats.errors

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(nats.errors.NoServersError):
        await bus.connect(
            f"nats://127.0.0.1:{port}",
            tls=None,
            identity=None,
            name="gives-up",
            max_reconnect_attempts=2,
            connect_timeout=1,
        )
    assert time.monotonic() - started < 10


async def _attempts_after_short_connections(connections: int) -> int:
    """Connect to a server that answers CONNECT and drops each connection soon after; the
    client's backoff attempt count once the server has seen `connections` connections."""
    seen: list[int] = []
    enough = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(len(seen) + 1)
        writer.write(b'INFO {"server_id":"drops","version":"2.10.0","max_payload":1048576}\r\n')
        await writer.drain()
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while b"PING" not in await reader.readline():
                pass
            writer.write(b"PONG\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.close()
        if len(seen) >= connections:
            enough.set()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    nc = await bus.connect(f"nats://127.0.0.1:{port}", tls=None, identity=None, name="flaps")
    try:
        await asyncio.wait_for(enough.wait(), timeout=60)
        return nc._failed_attempts
    finally:
        await bus.close(nc)
        server.close()


async def test_a_server_that_drops_its_clients_soon_after_connect_sees_them_back_ever_slower() -> (
    None
):
    # Each drop after a short connection keeps counting: the waits grow.
    assert await _attempts_after_short_connections(5) >= 3


async def test_a_connection_that_lasted_starts_the_backoff_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(natspy, "STABLE_S", 0.0)
    assert await _attempts_after_short_connections(4) <= 1

"""What a Reader accepts of the raw messages it is handed: the TTL rule, attestations in
place of signature checks, the other streams' readers' own records (with the real signing
code, no network)."""

from __future__ import annotations

import base64
import datetime
import time
from typing import Any

import pytest

from llmgw.bus import attestations, intake, kvlog, reader, signals
from llmgw.control.attesting import Attester
from llmgw.core import attestation, events, kvblocks, loadreport, subjects
from llmgw.pki import signing
from llmgw.pki.identity import Identity
from tests.unit.test_signing import CA, SIGNERS, VERIFIER, _NoClient, ack, block

NODE = SIGNERS[Identity("node", "a")]


class CountingVerifier:
    """The real verifier, counting how often it is asked."""

    def __init__(self) -> None:
        self.calls = 0

    def event_refusal(self, *args: Any, **kwargs: Any) -> str | None:
        self.calls += 1
        return VERIFIER.event_refusal(*args, **kwargs)


def signed(event: events.Event, ttl: str | None = None) -> tuple[bytes, bytes, bytes]:
    subject = events.subject_of(event)
    payload = events.encode(event)
    headers = {"Nats-Msg-Id": event.id, **NODE.event_headers(subject, event.id, payload)}
    if ttl is not None:
        headers["Nats-TTL"] = ttl
    return subject.encode(), payload, block(headers)


def feed(r: reader.Reader, messages: list[tuple[bytes, bytes, bytes]], first: int = 1) -> None:
    r._outstanding = len(messages) + 1
    for i, (subject, payload, headers) in enumerate(messages):
        pending = len(messages) - i - 1
        r._expect_cseq = first + i
        r._on_raw(subject, ack(first + i, first + i, pending), payload, headers)


def beat(i: int) -> events.Heartbeat:
    return events.Heartbeat(id=f"hb-{i}", ts=1.0, node="a", seq=i)


def shard(i: int) -> events.ShardStatus:
    return events.ShardStatus(
        id=f"s-{i}", ts=1.0, node="a", replica_id="r", generation=i, phase="starting"
    )


def test_only_heartbeats_expire_and_every_heartbeat_does() -> None:
    r = reader.Reader(_NoClient(), verifier=VERIFIER)  # type: ignore[arg-type]
    feed(
        r,
        [
            signed(beat(1), "60s"),  # accepted
            signed(beat(2)),  # no TTL: would stay forever
            signed(beat(3), "never"),
            signed(beat(4), "2h"),
            signed(shard(5)),  # accepted
            signed(shard(6), "60s"),  # would vanish from later replays
        ],
    )
    assert [rec.seq for rec in r._buf] == [1, 5]
    assert list(r.ttl_refused) == [2, 3, 4, 6]
    assert all("refused:" in s.error for s in r.skipped)


def attested_by_leader(
    log: list[tuple[bytes, bytes, bytes]],
) -> tuple[attestation.Attestations, reader.Reader, events.LogAttested]:
    """What a leader's reader of `log` attests, as a later reader loads it; the leader's
    reader; its attestation."""
    att = Attester(every=100, within_s=0.0, clock=lambda: 0.0)
    leader = reader.Reader(_NoClient(), verifier=VERIFIER, attester=att)  # type: ignore[arg-type]
    feed(leader, log)
    event = att.take(event_id="att-1", epoch=1, basis_seq=len(log))
    assert event is not None
    item = attestations.of_event(event)
    assert item is not None
    book = attestation.Attestations()
    book.add(item)
    return book, leader, event


def test_an_attestation_replaces_the_signature_check_and_confirms_only_what_it_saw() -> None:
    msgs = [signed(shard(i)) for i in range(1, 9)]
    forged = (
        subjects.node_event("a", "shard").encode(),
        events.encode(shard(3)),
        block({"Nats-Msg-Id": "s-3"}),  # unsigned: the leader refuses it
    )
    log = [*msgs[:2], forged, *msgs[3:]]
    # The leader reads and verifies everything, and attests what it accepted.
    book, leader, event = attested_by_leader(log[:6])
    assert [rec.seq for rec in leader._buf] == [1, 2, 4, 5, 6]
    assert (event.first_seq, event.last_seq, event.refused) == (1, 6, ((3, 3),))

    # A later reader checks no signature in the attested range, and one per message after.
    counting = CountingVerifier()
    later = reader.Reader(
        _NoClient(),  # type: ignore[arg-type]
        verifier=counting,  # type: ignore[arg-type]
        attestations=book,
    )
    tampered = (log[4][0], log[4][1] + b" ", log[4][2])
    feed(later, [*log[:4], tampered, *log[5:]])
    assert [rec.seq for rec in later._buf] == [1, 2, 4, 6, 7, 8]
    assert later.confirmed == 4
    assert counting.calls == 2  # seqs 7 and 8, after the attestation
    refusals = {s.seq: s.error for s in later.skipped}
    assert "refused it" in refusals[3]
    assert "differs" in refusals[5]


def test_a_reader_without_an_attester_or_attestations_hashes_nothing(monkeypatch: Any) -> None:
    def boom(*args: object) -> bytes:
        raise AssertionError("hashed")

    monkeypatch.setattr(attestation, "digest_after", boom)
    monkeypatch.setattr(attestation, "digest_v1", boom)
    r = reader.Reader(_NoClient(), verifier=VERIFIER)  # type: ignore[arg-type]
    feed(r, [signed(shard(1))])
    assert [rec.seq for rec in r._buf] == [1]
    assert signing  # the real signing module signed these messages


def test_an_attested_message_is_folded_without_its_headers_being_read(monkeypatch: Any) -> None:
    """The attestation covers what is folded (subject and payload): the header block, whose
    signature its signer checked, is not parsed. A message with a TTL the log refuses is
    attested as refused by the leader that refused it, so no later reader needs a confirmed
    one's TTL; a later reader refuses that one for its TTL too, for a control plane that
    reads so after a restart to delete (its `ttl_refused`)."""
    log = [signed(shard(1)), signed(shard(2)), signed(shard(3), "60s"), signed(shard(4))]
    book, leader, event = attested_by_leader(log)
    assert list(leader.ttl_refused) == [3]
    assert (event.payload_accepted, event.refused) == (((1, 2), (4, 4)), ((3, 3),))
    read: list[bytes] = []
    real = intake.message_headers

    def counting(raw: bytes) -> Any:
        read.append(raw)
        return real(raw)

    monkeypatch.setattr(intake, "message_headers", counting)
    counting_verifier = CountingVerifier()
    later = reader.Reader(
        _NoClient(),  # type: ignore[arg-type]
        verifier=counting_verifier,  # type: ignore[arg-type]
        attestations=book,
    )
    feed(later, log)
    assert [rec.seq for rec in later._buf] == [1, 2, 4]
    assert "only heartbeats expire" in later.skipped[-1].error
    assert list(later.ttl_refused) == [3]
    assert read == [log[2][2]]  # only the refused one's block was read
    assert counting_verifier.calls == 0
    assert later.confirmed == 3


def test_attestations_of_the_older_scheme_still_confirm_byte_for_byte() -> None:
    """Logs attested before digests covered only the subject and payload (scheme 1: id and
    signature too) replay without a signature check, and a changed id is still refused."""
    log = [signed(shard(i)) for i in range(1, 5)]
    digests = []
    for subject, payload, headers in log:
        found = intake.message_headers(headers)
        assert found is not None
        msg_id, sig, _cert, _ttl = found
        digests.append(attestation.digest_v1(subject, msg_id or b"", payload, sig or b""))
    item = attestation.Attested.of(
        1, 4, [(1, 4)], attestation.encode_digests(digests), (), scheme=1
    )
    assert item is not None
    book = attestation.Attestations()
    book.add(item)
    counting = CountingVerifier()
    later = reader.Reader(
        _NoClient(),  # type: ignore[arg-type]
        verifier=counting,  # type: ignore[arg-type]
        attestations=book,
    )
    other_id = log[3][2].replace(b"s-4", b"s-9")
    assert other_id != log[3][2]
    feed(later, [*log[:3], (log[3][0], log[3][1], other_id)])
    assert [rec.seq for rec in later._buf] == [1, 2, 3]
    assert (later.confirmed, counting.calls) == (3, 0)
    assert "differs" in later.skipped[-1].error


def signed_as(identity: Identity, subject: str, payload: bytes) -> tuple[bytes, bytes, bytes]:
    headers = {"Nats-Msg-Id": "m-1", **SIGNERS[identity].event_headers(subject, "m-1", payload)}
    return subject.encode(), payload, block(headers)


REPORT = loadreport.LoadReport(ts=1.0)
UPDATE = kvblocks.KvUpdate(endpoint="e1", model="m", block_size=16, instance="i", seq=1)


@pytest.mark.parametrize(
    ("make", "subject", "owner", "payload", "record"),
    [
        (signals.SignalsReader, subjects.router_signals("a", 0), Identity("router", "a"),
         loadreport.encode(REPORT), REPORT),
        (kvlog.KvReader, subjects.kv_updates("a", "e1"), Identity("node", "a"),
         kvblocks.encode_update(UPDATE), UPDATE),
    ],
)  # fmt: skip
def test_the_other_streams_readers_decode_their_own_records_behind_the_same_checks(
    make: Any, subject: str, owner: Identity, payload: bytes, record: object
) -> None:
    # The load-report and KV-update readers share the log reader's order and signature
    # checks and decode with their own `_accept`: a genuine message of theirs is kept as
    # their record, a forged one (another identity's subject) is refused before decoding.
    r = make(_NoClient(), verifier=VERIFIER)
    stranger = Identity(owner.kind, "b")
    feed(r, [signed_as(owner, subject, payload), signed_as(stranger, subject, payload)])
    assert [rec.event for rec in r._buf] == [record]
    assert (r.refused, r.undecodable) == (1, 1)


def delivered(r: reader.Reader, *messages: tuple[int, int, tuple[bytes, bytes, bytes]]) -> None:
    """Hand `r` messages as its consumer delivers them: (stream seq, delivery seq, message)."""
    r._outstanding = len(messages) + 1
    for seq, cseq, (subject, payload, headers) in messages:
        r._on_raw(subject, ack(seq, cseq, 0), payload, headers)


def test_a_lost_delivery_stops_the_reader_until_it_starts_over() -> None:
    # Delivery 2 never came (a disconnect): what follows is not folded, or the fold would
    # never see the event it missed; the reader starts over after the last one it has.
    r = reader.Reader(_NoClient(), verifier=VERIFIER)  # type: ignore[arg-type]
    delivered(r, (1, 1, signed(shard(1))), (3, 3, signed(shard(3))), (4, 4, signed(shard(4))))
    assert [rec.seq for rec in r._buf] == [1]
    assert r.last_seq == 1
    assert r._reset_needed


def test_a_signed_event_is_refused_where_it_does_not_belong() -> None:
    # Node a may write its own subjects, and signs there a control plane's decision and
    # node b's heartbeat: the signature holds, the events are not trusted.
    retired = events.ReplicaRetired(id="x", ts=1.0, replica_id="r1")
    other = events.Heartbeat(id="hb", ts=1.0, node="b", seq=1)
    own = subjects.node_event("a", "heartbeat")
    r = reader.Reader(_NoClient(), verifier=VERIFIER)  # type: ignore[arg-type]
    feed(r, [signed_as(Identity("node", "a"), own, events.encode(e)) for e in (retired, other)])
    assert r._buf == []
    assert (r.refused, r.undecodable) == (0, 2)
    assert all("does not belong on" in s.error for s in r.skipped)


class BrokenVerifier:
    def event_refusal(self, *args: Any, **kwargs: Any) -> str | None:
        raise RuntimeError("verifier bug")


def test_a_signature_that_cannot_be_checked_is_refused() -> None:
    r = reader.Reader(_NoClient(), verifier=BrokenVerifier())  # type: ignore[arg-type]
    feed(r, [signed(shard(1))])
    assert r._buf == []
    assert r.refused == 1
    assert "could not be checked" in r.skipped[0].error


def test_heartbeats_are_never_attested() -> None:
    # They expire: a digest of one would be kept forever for nothing.
    att = Attester(every=100, within_s=0.0, clock=lambda: 0.0)
    leader = reader.Reader(_NoClient(), verifier=VERIFIER, attester=att)  # type: ignore[arg-type]
    feed(leader, [signed(beat(1), "60s"), signed(shard(2)), signed(beat(3), "60s")])
    assert [rec.seq for rec in leader._buf] == [1, 2, 3]
    event = att.take(event_id="att-1", epoch=1, basis_seq=3)
    assert event is not None
    assert (event.first_seq, event.last_seq, event.payload_accepted) == (2, 2, ((2, 2),))


def test_a_kv_reader_starts_its_window_back_unless_told_when() -> None:
    """A router's index is warm at once only if the reader starts early enough for two of
    every engine's full updates."""
    before = time.time()
    config = kvlog.KvReader(_NoClient(), verifier=VERIFIER)._consumer_config("c")  # type: ignore[arg-type]
    after = time.time()
    assert config["deliver_policy"] == "by_start_time"
    start = datetime.datetime.fromisoformat(config["opt_start_time"]).timestamp()
    assert before - kvlog.START_WINDOW_S - 0.001 <= start <= after - kvlog.START_WINDOW_S
    told = kvlog.KvReader(_NoClient(), since=0.5, verifier=VERIFIER)._consumer_config("c")  # type: ignore[arg-type]
    assert told["opt_start_time"] == "1970-01-01T00:00:00.500000Z"


def test_every_message_passed_over_reaches_the_sink_with_its_size_past_the_kept_window() -> None:
    """`skipped` keeps the latest few; a node's share of the log is measured from the sink,
    which hears of each (llmgw.control.folding), however many come in a row."""
    heard: list[reader.Skipped] = []
    r = reader.Reader(
        _NoClient(),  # type: ignore[arg-type]
        verifier=VERIFIER,
        max_skipped_kept=3,
        on_skip=heard.append,
    )
    own = subjects.node_event("a", "shard")
    junk = [signed_as(Identity("node", "a"), own, b"\x00" * (10 + i)) for i in range(6)]
    unsigned = (own.encode(), b"x" * 40, b"")
    forged = signed_as(Identity("node", "b"), own, events.encode(shard(9)))
    feed(r, [*junk, unsigned, forged, signed(beat(9)), signed(shard(10))])
    assert [item.seq for item in heard] == list(range(1, 10))
    assert len(r.skipped) == 3
    assert r.undecodable == 9
    assert r.refused == 2
    assert [rec.seq for rec in r._buf] == [10]
    messages = [*junk, unsigned, forged, signed(beat(9))]
    assert [item.size for item in heard] == [len(m[0]) + len(m[1]) + len(m[2]) for m in messages]
    assert all(item.size > 0 for item in heard)


def test_a_failing_sink_never_stops_the_reading() -> None:
    def broken(item: reader.Skipped) -> None:
        raise RuntimeError("sink bug")

    r = reader.Reader(_NoClient(), verifier=VERIFIER, on_skip=broken)  # type: ignore[arg-type]
    own = subjects.node_event("a", "shard")
    feed(r, [signed_as(Identity("node", "a"), own, b"junk"), signed(shard(2))])
    assert [rec.seq for rec in r._buf] == [2]
    assert r.undecodable == 1
    assert r.last_seq == 2


def test_what_a_reader_keeps_does_not_grow_with_the_size_of_what_a_node_writes() -> None:
    """A node chooses its subjects below `llmgw.events.node.<node>.` (the server takes about
    4 KiB), its TTL header and its certificate header (up to the server's 64 KiB of
    headers; `1s1s1s...` is a valid duration). A reader kept each new subject, each new
    (subject, TTL), each certificate's verdict (by its bytes) and each refusal's text
    whole, up to 100,000 (10,000 certificates) of each: a node writing a few thousand such
    messages, even quarantined (the leader reads each before it deletes it), made every
    reader of the log hold gigabytes."""
    import gc
    import tracemalloc

    r = reader.Reader(_NoClient(), verifier=signing.Verifier(CA.cert))  # type: ignore[arg-type]
    count = 200
    own = subjects.node_event("a", "shard").encode()
    long_certs = [
        (own, b"junk", block({"Nats-Msg-Id": f"c-{i}", "Llmgw-Sig": "x", "Llmgw-Cert": cert}))
        for i in range(count)
        for cert in [base64.b64encode(b"%04d" % i + b"\x00" * 30_000).decode()]
    ]
    long_subjects = [
        signed_as(Identity("node", "a"), f"llmgw.events.node.a.{i:04d}{'x' * 4000}", b"junk")
        for i in range(count)
    ]
    long_ttls = [signed(shard(i), f"{'1s' * 15_000}{i}s") for i in range(count)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        feed(r, long_subjects + long_ttls + long_certs)
        r._buf.clear()
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert r.undecodable == 3 * count
    assert r.refused == count
    assert list(r.ttl_refused) == list(range(count + 1, 2 * count + 1))
    # The recent refusals it keeps name their subject; nothing else keeps what they wrote.
    assert kept < 2 * count * 4096 + 1_000_000, kept
    assert all(len(s.error) < 1000 for s in r.skipped)


def test_a_messages_size_counts_its_subject_as_the_log_stores_it() -> None:
    """The server stores each message's subject, and a node chooses it (about 4 KiB below
    its own): a budget that counted payload and headers only let 4 KiB messages pass for
    a byte each."""
    heard: list[reader.Skipped] = []
    r = reader.Reader(_NoClient(), verifier=VERIFIER, on_skip=heard.append)  # type: ignore[arg-type]
    long = f"llmgw.events.node.a.{'x' * 4000}"
    messages = [signed_as(Identity("node", "a"), long, b"j"), signed(shard(2))]
    feed(r, messages)
    sizes = [len(s) + len(p) + len(h) for s, p, h in messages]
    assert [item.size for item in heard] == sizes[:1]
    assert sizes[0] > 4000
    assert [rec.size for rec in r._buf] == sizes[1:]


class _Lines:
    """Stands in for a module's logger: the lines it was asked to write."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.lines.append((event, fields))

    error = info = warning


def test_a_run_of_messages_passed_over_is_logged_in_a_bounded_number_of_lines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each message a reader passed over was a log line, which cost more than ten times
    the reading of an unsigned one: a node writing junk on its own subjects as fast as the
    server takes it had every reader of the log (control planes, routers) spend its time
    and disk writing lines. Each is still counted and told to the sink."""
    from llmgw.bus import intake

    lines = _Lines()
    now = [1000.0]
    monkeypatch.setattr(intake, "log", lines)
    monkeypatch.setattr(intake, "_clock", lambda: now[0], raising=False)
    heard: list[reader.Skipped] = []
    r = reader.Reader(_NoClient(), verifier=VERIFIER, on_skip=heard.append)  # type: ignore[arg-type]
    own = subjects.node_event("a", "shard").encode()
    feed(r, [(own, b"junk %d" % i, b"") for i in range(5000)])
    assert r.undecodable == 5000
    assert len(heard) == 5000
    logged = [fields["seq"] for event, fields in lines.lines if event == "bus.signature_refused"]
    assert logged == list(range(1, 101))
    assert len(lines.lines) == 100
    now[0] += 10.0  # a period later, the next one says how many went unlogged
    feed(r, [(own, b"junk", b"")], first=5001)
    assert lines.lines[100] == (
        "skipped_unlogged",
        {"count": 4900, "last_seq": 5000, "last_subject": own.decode(), "period_s": 10.0},
    )
    assert lines.lines[101][1]["seq"] == 5001


def test_a_reader_says_how_far_behind_the_log_it_is() -> None:
    """Where the last message it read stands: when the server stored it, and whether more
    was stored after it (the leader judges no heartbeat silence while far behind)."""
    from tests.unit.test_signing import NOW

    r = reader.Reader(_NoClient(), verifier=VERIFIER)  # type: ignore[arg-type]
    assert (r.last_time, r.more_pending) == (0.0, False)
    r._outstanding = 10
    subject, payload, headers = signed(shard(1))
    r._on_raw(subject, ack(1, 1, 2), payload, headers)  # two more stored after it
    assert r.more_pending
    assert abs(r.last_time - NOW.timestamp()) < 1e-3
    r._on_raw(subjects.node_event("a", "x").encode(), ack(2, 2, 1), b"junk", b"")
    assert r.more_pending  # a message passed over moves it too
    assert r.last_seq == 2
    subject, payload, headers = signed(shard(3))
    r._on_raw(subject, ack(3, 3, 0), payload, headers)
    assert not r.more_pending


@pytest.mark.parametrize("filters", [[], [""], ["llmgw.events.>", ""], [" "], ["a b"]])
def test_a_reader_refuses_filters_no_server_would_take(filters: list[str]) -> None:
    # An empty list, or an empty subject, made the consumer's creation fail at the server
    # with an error that named neither: refused where the mistake is made.
    with pytest.raises(ValueError, match="subjects_filter"):
        reader.Reader(_NoClient(), verifier=VERIFIER, subjects_filter=filters)  # type: ignore[arg-type]

"""Attestations confirm exactly the messages their signer accepted, byte for byte."""

from __future__ import annotations

import hashlib

import msgspec
from hypothesis import example, given, settings
from hypothesis import strategies as st

from llmgw.bus.attestations import of_event
from llmgw.core import attestation, events
from llmgw.core.attestation import NOT_COVERED, OTHER_SCHEME, Attestations, Attested

Message = tuple[bytes, bytes, bytes, bytes]
"""(subject, message id, payload, signature)."""
message = st.tuples(
    st.binary(min_size=1, max_size=40),
    st.binary(max_size=20),
    st.binary(max_size=200),
    st.binary(max_size=72),
)


def digest_of(msg: Message, scheme: int = attestation.SCHEME) -> bytes:
    """A message's digest by either scheme."""
    subject, msg_id, payload, signature = msg
    if scheme == 1:
        return attestation.digest_v1(subject, msg_id, payload, signature)
    return attestation.digest(subject, payload)


def attest(
    first: int, log: dict[int, Message], accepted: set[int], scheme: int = attestation.SCHEME
) -> Attested:
    seqs = sorted(s for s in log if s in accepted)
    digests = attestation.encode_digests(digest_of(log[s], scheme) for s in seqs)
    refused = attestation.runs(sorted(s for s in log if s not in accepted))
    item = Attested.of(first, max(log), attestation.runs(seqs), digests, refused, scheme=scheme)
    assert item is not None
    return item


@given(
    msgs=st.lists(message, min_size=1, max_size=60),
    accepted_mask=st.lists(st.booleans(), min_size=60, max_size=60),
    first=st.integers(1, 10_000),
    tamper=st.integers(0, 59),
    field=st.integers(0, 3),
    scheme=st.sampled_from(attestation.SCHEMES),
)
def test_confirmed_exactly_when_accepted_and_unchanged(
    msgs: list[Message],
    accepted_mask: list[bool],
    first: int,
    tamper: int,
    field: int,
    scheme: int,
) -> None:
    log = {first + i: m for i, m in enumerate(msgs)}
    accepted = {s for i, s in enumerate(log) if accepted_mask[i]}
    book = Attestations()
    book.add(attest(first, log, accepted, scheme))
    for seq, msg in log.items():
        verdict = book.check(seq, digest_of(msg, scheme), scheme)
        assert (verdict is None) == (seq in accepted)
    # One byte changed of what the scheme digests (scheme 2: the subject and payload, what a
    # reader folds; 1: every field): refused, never confirmed.
    seq = first + tamper % len(msgs)
    parts = list(log[seq])
    if scheme == 2:
        field = field // 2 * 2
    parts[field] = parts[field] + b"x"
    tampered = digest_of((parts[0], parts[1], parts[2], parts[3]), scheme)
    assert book.check(seq, tampered, scheme) is not None
    # Outside every range: not covered, so the signature is checked instead.
    assert book.check(first + len(msgs), b"\0" * 16, scheme) == NOT_COVERED
    assert book.check(first - 1, b"\0" * 16, scheme) == NOT_COVERED
    # Asked by the other scheme: told to ask by the attestation's own.
    other = 3 - scheme
    if accepted:
        assert book.check(min(accepted), digest_of(log[min(accepted)], other), other) == (
            OTHER_SCHEME
        )


@given(
    spans=st.lists(
        st.tuples(
            st.integers(1, 40),
            st.integers(0, 30),
            st.lists(st.booleans(), min_size=31, max_size=31),
            st.sampled_from(attestation.SCHEMES),
        ),
        min_size=1,
        max_size=5,
    ),
    queries=st.lists(st.tuples(st.integers(0, 80), st.booleans()), max_size=120),
    in_order=st.booleans(),
)
@example(  # a later attestation refuses what an earlier one accepted: the later decides
    spans=[(1, 9, [True] * 31, 2), (5, 9, [False] * 31, 2)],
    queries=[(s, False) for s in range(1, 15)],
    in_order=True,
)
@settings(max_examples=300)
def test_a_book_checked_many_times_answers_as_a_fresh_one(
    spans: list[tuple[int, int, list[bool], int]],
    queries: list[tuple[int, bool]],
    in_order: bool,
) -> None:
    """What one book remembers between checks (the stretch a run decides) never changes a
    verdict: overlapping attestations of either scheme, holes, refusals, tampered digests,
    any order."""
    message = {s: (b"s", str(s).encode(), str(s).encode(), b"g") for s in range(1, 81)}
    items = []
    for first, length, mask, scheme in spans:
        log = {s: message[s] for s in range(first, first + length + 1)}
        accepted = {s for i, s in enumerate(log) if mask[i]}
        items.append(attest(first, log, accepted, scheme))
    book = Attestations()
    for item in items:
        book.add(item)
    if in_order:
        queries = sorted(queries)
    for seq, tampered in queries:
        for scheme in attestation.SCHEMES:
            digest = digest_of(message.get(seq, (b"", b"", b"", b"")), scheme)
            if tampered:
                digest = bytes([digest[0] ^ 1]) + digest[1:]
            fresh = Attestations()
            for item in items:
                fresh.add(item)
            assert book.check(seq, digest, scheme) == fresh.check(seq, digest, scheme), seq


@given(message)
def test_the_digest_is_the_attested_encoding(msg: Message) -> None:
    """What leaders attested stays what readers compute. Scheme 2: BLAKE2b-128 over the
    domain, the subject with its 4-byte big-endian length, and the payload, however it is
    computed. Scheme 1 (attestations already in logs): SHA-256 over the domain and each
    field with its length, cut to 16 bytes."""
    subject, msg_id, payload, signature = msg
    encoding = b"llmgw-attested-v2\x00" + len(subject).to_bytes(4, "big") + subject + payload
    expected = hashlib.blake2b(encoding, digest_size=16).digest()
    assert attestation.digest(subject, payload) == expected
    prefix = attestation.subject_prefix(subject)
    assert attestation.digest_after(prefix, payload) == expected
    encoding = b"llmgw-attested-v1\x00" + b"".join(
        len(part).to_bytes(4, "big") + part for part in (subject, msg_id, payload, signature)
    )
    assert attestation.digest_v1(*msg) == hashlib.sha256(encoding).digest()[:16]


def test_fields_are_length_prefixed() -> None:
    assert attestation.digest(b"ab", b"c") != attestation.digest(b"a", b"bc")
    assert attestation.digest_v1(b"ab", b"c", b"", b"") != attestation.digest_v1(
        b"a", b"bc", b"", b""
    )


def test_an_attestation_of_a_scheme_this_reader_does_not_know_confirms_nothing() -> None:
    one = attestation.encode_digests([b"\1" * 16])
    assert Attested.of(5, 10, [(6, 6)], one, (), scheme=3) is None
    assert Attested.of(5, 10, [(6, 6)], one, (), scheme=0) is None


@given(st.lists(st.integers(1, 500), unique=True))
def test_runs_cover_exactly_the_sequences(seqs: list[int]) -> None:
    seqs.sort()
    got = [s for a, b in attestation.runs(seqs) for s in range(a, b + 1)]
    assert got == seqs


def test_an_attestation_that_does_not_hold_together_confirms_nothing() -> None:
    one = attestation.encode_digests([b"\1" * 16])
    assert Attested.of(5, 10, [(4, 4)], one, scheme=2) is None  # run before the range
    assert Attested.of(5, 10, [(11, 11)], one, scheme=2) is None  # after it
    assert Attested.of(5, 10, [(6, 7)], one, scheme=2) is None  # two sequences, one digest
    assert Attested.of(5, 10, [(6, 6), (6, 6)], one + "", scheme=2) is None  # overlapping runs
    assert Attested.of(5, 10, [(6, 6)], "not base64!", scheme=2) is None
    assert Attested.of(10, 5, [], "", scheme=2) is None
    assert (
        Attested.of(5, 10, [(6, 6)], one, [(11, 12)], scheme=2) is None
    )  # refused after the range
    assert (
        Attested.of(5, 10, [(6, 6)], one, [(8, 9), (9, 9)], scheme=2) is None
    )  # refused overlapping
    assert Attested.of(5, 10, [(6, 6)], one, scheme=2) is not None


def test_overlapping_attestations_each_confirm_their_own() -> None:
    log = {s: (b"s", str(s).encode(), b"p", b"sig") for s in range(1, 21)}
    book = Attestations()
    book.add(attest(1, {s: log[s] for s in range(1, 11)}, set(range(1, 11))))
    book.add(attest(6, {s: log[s] for s in range(6, 21)}, set(range(6, 21))))
    assert all(book.check(s, digest_of(log[s])) is None for s in log)
    assert book.last_seq == 20


def test_the_event_round_trips_and_changes_no_state() -> None:
    from llmgw.core.state import ClusterState, apply, digest

    log = {s: (b"s", b"i", b"p", b"g") for s in range(3, 8)}
    item = attest(3, log, {3, 4, 6})
    event = events.LogAttested(
        id="a-1",
        ts=1.0,
        first_seq=3,
        last_seq=7,
        accepted=((3, 4), (6, 6)),
        digests=attestation.encode_digests(item.digests[i : i + 16] for i in range(0, 48, 16)),
    )
    assert events.decode(events.encode(event)) == event
    state = ClusterState()
    before = digest(state)
    assert apply(state, event, 9) is None
    assert state.last_seq == 9
    state.last_seq = 0
    assert digest(state) == before


def test_the_attester_attests_what_its_reader_checked_and_forgets_what_the_log_has() -> None:
    from llmgw.control.attesting import Attester

    now = [0.0]
    att = Attester(every=3, within_s=5.0, clock=lambda: now[0])
    assert not att.due()
    for seq in (1, 2):
        att.accepted(seq, bytes([seq]) * 16)
    att.refused(3)
    now[0] = 6.0
    assert att.due()
    first = att.take(event_id="a", epoch=1, basis_seq=3)
    assert first is not None
    assert (first.first_seq, first.last_seq) == (1, 3)
    assert (first.payload_accepted, first.refused) == (((1, 2),), ((3, 3),))
    assert (first.accepted, first.digests) == ((), "")  # the older scheme's fields
    item = of_event(first)
    assert item is not None
    assert item.scheme == attestation.SCHEME
    book = Attestations()
    book.add(item)
    assert book.check(2, b"\2" * 16) is None
    assert "refused" in (book.check(3, b"\3" * 16) or "")
    # Until the attestation is folded back, a failed write is attested again.
    again = att.take(event_id="b", epoch=1, basis_seq=3)
    assert again is not None
    assert again.payload_accepted == first.payload_accepted
    att.attested(first)
    assert att.pending == 0
    assert att.take(event_id="c", epoch=1, basis_seq=3) is None
    # An attestation alone (the one just folded) makes none due.
    att.accepted(4, b"\4" * 16)
    att.quiet(4)
    now[0] = 60.0
    assert not att.due()
    for seq in (5, 6, 7):
        att.accepted(seq, b"\5" * 16)
    assert att.due()  # three or more
    nxt = att.take(event_id="d", epoch=1, basis_seq=7)
    assert nxt is not None
    assert (nxt.first_seq, nxt.last_seq, nxt.payload_accepted) == (4, 6, ((4, 6),))


def test_a_sequence_neither_accepted_nor_refused_is_left_to_its_signature() -> None:
    one = attestation.encode_digests([b"\1" * 16])
    item = Attested.of(1, 10, [(2, 2)], one, [(5, 6)], scheme=2)
    assert item is not None
    book = Attestations()
    book.add(item)
    assert book.check(2, b"\1" * 16) is None
    assert book.check(3, b"\0" * 16) == NOT_COVERED  # a heartbeat, say
    assert book.check(6, b"\0" * 16) not in (None, NOT_COVERED)
    # Accepted and refused at once does not hold together.
    assert Attested.of(1, 10, [(2, 2)], one, [(2, 3)], scheme=2) is None


def test_the_attester_leaves_out_what_the_leader_deletes_and_what_the_fold_has_not_passed() -> None:
    """An attestation stays in the log: one of a message the leader deletes (a quarantined
    node's flood) was the leader writing, for ever, a digest for each message of the flood.
    And a message the fold has not passed yet may still be one it deletes."""
    from llmgw.control.attesting import Attester

    att = Attester(every=10, within_s=0.0, clock=lambda: 0.0)
    for seq in (1, 2, 3, 4):
        att.accepted(seq, bytes([seq]) * 16)
    att.refused(5)
    att.refused(6)
    for seq in (2, 6, 9):  # 9 was never read here (a heartbeat, say): nothing to leave out
        att.drop(seq)
    assert att.pending == 4
    first = att.take(event_id="a", epoch=1, basis_seq=4)
    assert first is not None
    assert (first.first_seq, first.last_seq) == (1, 4)
    assert (first.payload_accepted, first.refused) == (((1, 1), (3, 4)), ())
    item = of_event(first)
    assert item is not None
    assert [item.lookup(s) for s in (1, 2, 3, 4)] == [b"\1" * 16, None, b"\3" * 16, b"\4" * 16]
    att.attested(first)
    assert att.pending == 1
    assert att.take(event_id="b", epoch=1, basis_seq=4) is None  # 5: not folded yet
    later = att.take(event_id="c", epoch=1, basis_seq=6)
    assert later is not None
    assert (later.first_seq, later.last_seq, later.refused) == (5, 5, ((5, 5),))


def test_what_the_attester_leaves_out_does_not_pile_up() -> None:
    """A quarantined node's flood, every message of it left out, with nothing else to
    attest: what the attester keeps stays small however long the flood."""
    import gc
    import tracemalloc

    from llmgw.control.attesting import Attester

    att = Attester(every=4096, within_s=0.0, clock=lambda: 0.0)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for seq in range(1, 200_001, 2):
            att.accepted(seq, seq.to_bytes(16, "big"))
            att.refused(seq + 1)
            att.drop(seq + 1)  # refused junk: left out as it comes
            if seq > 10:
                att.drop(seq - 10)  # an event the fold ignored a little later
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert att.pending == 5  # the last few accepted, not (yet) left out
    assert kept < 1_000_000, kept


def test_a_reader_from_before_confirms_nothing_by_a_new_attestation_and_still_refuses() -> None:
    """The two schemes' digests travel in different fields: a reader that knows only
    `accepted` and `digests` finds none in an attestation written now, so it checks those
    messages' signatures (rather than refusing each for a digest that differs), and still
    refuses what the leader refused. One that holds both kinds confirms nothing."""
    log = {s: (b"s", str(s).encode(), str(s).encode(), b"g") for s in range(1, 7)}
    new = events.LogAttested(id="a", ts=0.0, first_seq=1, last_seq=6,
                             payload_accepted=((1, 4),), refused=((5, 6),),
                             payload_digests=attestation.encode_digests(
                                 digest_of(log[s]) for s in range(1, 5)))  # fmt: skip
    before = Attested.of(new.first_seq, new.last_seq, new.accepted, new.digests, new.refused,
                         scheme=1)  # fmt: skip
    assert before is not None
    old_reader = Attestations()
    old_reader.add(before)
    for seq in range(1, 5):
        assert old_reader.check(seq, digest_of(log[seq], 1), 1) == NOT_COVERED
    assert old_reader.check(5, digest_of(log[5], 1), 1) not in (None, NOT_COVERED)
    now = of_event(new)
    assert now is not None
    assert now.scheme == 2
    assert all(now.lookup(s) == digest_of(log[s]) for s in range(1, 5))
    both = msgspec.structs.replace(new, accepted=((1, 1),), digests=new.payload_digests[:24])
    assert of_event(both) is None

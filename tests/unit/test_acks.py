"""Reading JetStream's ack reply subjects: both forms, and anything else refused."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llmgw.bus import acks

numbers = st.integers(min_value=0, max_value=2**63)
names = st.from_regex(r"[A-Za-z0-9_-]{1,20}", fullmatch=True)


def v1(stream: str, consumer: str, n: int, seq: int, cseq: int, ts: int, pending: int) -> bytes:
    return f"$JS.ACK.{stream}.{consumer}.{n}.{seq}.{cseq}.{ts}.{pending}".encode()


def v2(stream: str, consumer: str, n: int, seq: int, cseq: int, ts: int, pending: int) -> bytes:
    return f"$JS.ACK._.ACCHASH.{stream}.{consumer}.{n}.{seq}.{cseq}.{ts}.{pending}.r4nd".encode()


@given(names, names, numbers, numbers, numbers, numbers, numbers, st.sampled_from([v1, v2]))
def test_both_forms_give_the_numbers_they_carry(
    stream: str, consumer: str, n: int, seq: int, cseq: int, ts: int, pending: int, form: object
) -> None:
    assert callable(form)
    info = acks.parse(form(stream, consumer, n, seq, cseq, ts, pending))
    assert info == (seq, cseq, ts, pending == 0)


def test_the_v2_form_without_its_random_token_and_with_later_additions() -> None:
    base = "$JS.ACK.dom.ACC.llmgw-events.router-r.1.42.7.1700000000000000000.0"
    assert acks.parse(base.encode()) == (42, 7, 1700000000000000000, True)
    assert acks.parse(f"{base}.tok.future".encode()) == (42, 7, 1700000000000000000, True)
    assert acks.parse(f"{base[:-1]}3.tok".encode()) == (42, 7, 1700000000000000000, False)


@given(st.binary(max_size=200))
def test_anything_else_is_none_never_an_exception(raw: bytes) -> None:
    info = acks.parse(raw)
    if info is not None:
        assert raw.startswith(acks.PREFIX)


def test_subjects_that_are_not_acks_or_are_damaged() -> None:
    for bad in (
        b"_INBOX.abc.1",
        b"$JS.ACK.s.c.1.2.3",  # too short for either form
        b"$JS.ACK.s.c.1.x.3.4.0",  # a sequence that is not a number
        b"$JS.ACKS.s.c.1.2.3.4.0",  # another prefix
        b"$JS.ACK.s.c.1.2.3.",  # an empty timestamp
        b"$JS.ACK.a.b.s.c.1.2.3.4",  # ten tokens: neither form
    ):
        assert acks.parse(bad) is None, bad

"""The reader's header block: the publisher's own shape is read as any block is."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llmgw.bus import headers

keys = st.sampled_from(
    [
        b"Nats-Msg-Id",
        b"Llmgw-Sig",
        b"Llmgw-Cert",
        b"Nats-TTL",
        b"nats-ttl",
        b" Llmgw-Sig",
        b"Llmgw-Sig ",
        b"Nats-Expected-Stream",
        b"X",
        b"",
    ]
)
values = st.binary(max_size=12) | st.sampled_from([b" v", b"v ", b" a:b ", b"\n", b"\r", b""])
line = st.tuples(keys, st.sampled_from([b":", b"", b": "]), values).map(b"".join)
first = st.sampled_from([b"NATS/1.0", b"NATS/1.0 100 Idle", b""])


@given(
    first=first, lines=st.lists(line, max_size=7), end=st.sampled_from([b"\r\n\r\n", b"\r\n", b""])
)
def test_any_block_reads_as_the_general_reading(
    first: bytes, lines: list[bytes], end: bytes
) -> None:
    raw = first + b"".join(b"\r\n" + x for x in lines) + end
    assert headers.message_headers(raw) == headers._general(raw.split(b"\r\n"))


@given(msg_id=values, sig=values, cert=values, first=first)
def test_the_publishers_shape_reads_as_the_general_reading(
    msg_id: bytes, sig: bytes, cert: bytes, first: bytes
) -> None:
    raw = first + b"\r\nNats-Msg-Id: " + msg_id + b"\r\nLlmgw-Sig:" + sig
    raw += b"\r\nLlmgw-Cert: " + cert + b"\r\n\r\n"
    found = headers.message_headers(raw)
    assert found == headers._general(raw.split(b"\r\n"))
    if b"\r\n" not in msg_id + sig + cert and b"\r" not in msg_id + sig + cert:
        assert found == (msg_id.strip(), sig.strip(), cert.strip(), None)

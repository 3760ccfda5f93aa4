"""JetStream's ack reply subjects: where a delivered message stands in its stream.

The server delivers each message of a pull consumer with a reply subject that carries
its metadata, in one of two forms (the original, and the v2 with domain and account hash that recent
servers send):

    $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<ns>.<pending>
    $JS.ACK.<domain>.<account>.<stream>.<consumer>.<delivered>.<stream seq>
           .<consumer seq>.<ns>.<pending>.<token>...   (one subject, wrapped here)

The reader places every message by these numbers (the consumer sequence must grow by
one, or a message was lost), so their reading lives here, with its property tests
(tests/unit/test_acks.py). Pure.
"""

from __future__ import annotations

from typing import NamedTuple

PREFIX = b"$JS.ACK."


class AckInfo(NamedTuple):
    stream_seq: int
    consumer_seq: int
    timestamp_ns: int
    caught_up: bool
    """No message of the consumer's filter is pending after this one."""


def parse(reply: bytes) -> AckInfo | None:
    """The metadata of an ack reply subject; None for any other subject."""
    if not reply.startswith(PREFIX):
        return None
    tokens = reply.split(b".")
    # v1 has exactly 9 tokens; v2 at least 11 (a random token follows, and the format
    # reserves later tokens for additions).
    first = 5 if len(tokens) == 9 else 7 if len(tokens) >= 11 else 0
    if not first:
        return None
    try:
        seq, cseq, ts = int(tokens[first]), int(tokens[first + 1]), int(tokens[first + 2])
    except ValueError:
        return None
    if min(seq, cseq, ts) < 0 or not tokens[first + 3].isdigit():
        return None
    return AckInfo(seq, cseq, ts, tokens[first + 3] == b"0")

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

PREFIX = b"$JS.ACK."


AckInfo = tuple[int, int, int, bool]
"""(stream sequence, consumer sequence, timestamp in ns, caught up: nothing of the
consumer's filter pending after this message). A plain tuple: this runs once per message
of a replay, and a NamedTuple's construction alone cost a third of the time."""


def parse(reply: bytes) -> AckInfo | None:
    """The metadata of an ack reply subject; None for any other subject, or one whose
    numbers are not numbers. Never raises."""
    tokens = reply.split(b".")
    n = len(tokens)
    # v1 has exactly 9 tokens; v2 at least 11 (a random token follows, and the format
    # reserves later tokens for additions).
    first = 5 if n == 9 else 7 if n >= 11 else 0
    if not first or tokens[0] != b"$JS" or tokens[1] != b"ACK":
        return None
    try:
        return (
            int(tokens[first]),
            int(tokens[first + 1]),
            int(tokens[first + 2]),
            tokens[first + 3] == b"0",
        )
    except ValueError:
        return None

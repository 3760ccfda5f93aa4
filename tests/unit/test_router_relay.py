"""The relay's cutting of an engine's bytes into whole events (llmgw.router.relay)."""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.profile import ModelProfile
from llmgw.router import relay
from llmgw.router.relay import ClientStream, EngineStream
from tests.unit.test_router_sse import Copied


class NoHooks:
    def usage(self, *_: Any) -> None:
        pass


def engine_stream() -> EngineStream:
    async def made() -> EngineStream:
        client = ClientStream(None, "r", 0.0, kind="chat", stream=True, drop_usage=False,  # type: ignore[arg-type]
                              principal=None)  # fmt: skip
        return EngineStream(client, None, ModelProfile(name="m"), NoHooks(), 0.0, "e")  # type: ignore[arg-type]

    return asyncio.run(made())


def test_an_event_that_trickles_in_is_not_copied_again_with_every_piece() -> None:
    """An engine sends a long event (no blank line yet) a kilobyte per read: each read is
    kept, not appended to a copy of all the others (4 MB so held the loop 8 s)."""
    s = engine_stream()
    piece = Copied(b"x" * 1000)
    Copied.total = 0
    out = [s.take(piece) for _ in range(2000)]
    assert not any(out)
    assert s.take(Copied(b"\n\ndata: next")) == b"x" * 2_000_000 + b"\n\n"
    assert Copied.total <= 4 * 2_000_000


@given(st.lists(st.sampled_from([b"data: a", b"\n", b"\n\n", b"b", b"\n\ndata: c\n"]),
                max_size=12))  # fmt: skip
def test_every_byte_comes_out_once_in_whole_events_however_the_bytes_are_cut(
    pieces: list[bytes],
) -> None:
    s = engine_stream()
    outs = [s.take(p) for p in [*pieces, b"\n\n"]]
    assert all(o.endswith(b"\n\n") for o in outs if o)
    assert b"".join(outs) == b"".join(pieces) + b"\n\n"


def test_an_event_past_the_limit_is_relayed_as_it_is() -> None:
    s = engine_stream()
    big = b"x" * (relay.MAX_EVENT_BYTES // 2)
    assert s.take(big) == b""
    assert s.take(big) == b""
    assert s.take(b"y") == big + big + b"y"
    assert s.take(b"z\n\n") == b"z\n\n"


class Transport:
    """The client's transport, as the direct path writes to it."""

    def __init__(self) -> None:
        self.sent = bytearray()

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0

    def write(self, data: bytes) -> None:
        self.sent += data


class Upstream:
    def at_eof(self) -> bool:
        return False

    def relay_to(self, _: object) -> None:
        pass


def test_an_engine_that_ends_every_read_with_done_does_not_have_its_stream_held() -> None:
    """The events of a read that ends with [DONE] are held to leave with the end of the
    body; an engine that sends [DONE] after every event must not have the whole stream
    held (and copied again with each read) until it ends."""
    s = engine_stream()
    client = Transport()
    s.client.request = type("Request", (), {"transport": client})()  # type: ignore[assignment]
    s.upstream, s.transport, s.t_first = Upstream(), client, 1.0  # type: ignore[assignment]
    event = b'data: {"choices":[{"index":0,"delta":{"content":"token"}}]}\n\n' + relay.DONE
    for _ in range(2000):
        s.sink(event)
    assert not s.failed
    assert len(s.held) <= relay.END_NOW_MAX
    sent, pos = bytearray(), 0
    while pos < len(client.sent):  # the chunk frames the direct path wrote
        line = client.sent.index(b"\r\n", pos)
        size = int(client.sent[pos:line], 16)
        sent += client.sent[line + 2 : line + 2 + size]
        pos = line + 4 + size
    assert sent + s.held == event * 2000

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

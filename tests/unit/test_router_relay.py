"""The relay's cutting of an engine's bytes into whole events (llmgw.router.relay)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from llmgw.core.profile import ModelProfile
from llmgw.router import relay
from llmgw.router.accounting import Accounting
from llmgw.router.relay import ClientStream, EngineStream
from tests.unit.test_router_sse import Copied


class NoHooks:
    def usage(self, *_: Any) -> None:
        pass


def engine_stream(
    hooks: Any = None, *, drop_usage: bool = False, kind: Any = "chat"
) -> EngineStream:
    async def made() -> EngineStream:
        client = ClientStream(None, "r", 0.0, kind=kind, stream=True, drop_usage=drop_usage,  # type: ignore[arg-type]
                              principal=None)  # fmt: skip
        return EngineStream(client, None, ModelProfile(name="m"), hooks or NoHooks(), 0.0, "e")  # type: ignore[arg-type]

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
    outs, waiting = [], b""
    for p in [*pieces, b"\n\n"]:
        outs.append(s.take(p))
        # Each event leaves with the read that completes it, though its blank line began
        # in the read before ("data: a\n", "\n"): held, an engine's last event would wait
        # for a read that never comes, and the stream end as if cut.
        waiting += p
        whole = waiting.rfind(b"\n\n")
        assert outs[-1] == (waiting[: whole + 2] if whole >= 0 else b"")
        waiting = waiting[len(outs[-1]) :]
    assert all(o.endswith(b"\n\n") for o in outs if o)
    assert b"".join(outs) == b"".join(pieces) + b"\n\n"


CHAT_STREAM = (
    b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
    + b"".join(b'data: {"choices":[{"delta":{"content":"t%d"}}]}\n\n' % i for i in range(3))
    + b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}\n\n'
    + b"data: [DONE]\n\n"
)


@given(st.lists(st.integers(0, len(CHAT_STREAM)), max_size=8))
def test_the_events_counted_are_those_relayed_however_the_bytes_are_cut(cuts: list[int]) -> None:
    """What a stream cut before its usage is charged by: every whole event that went out,
    none twice, and not the usage-only event the router asked for and drops."""
    s = engine_stream(drop_usage=True)
    bounds = [0, *sorted(cuts), len(CHAT_STREAM)]
    for a, b in itertools.pairwise(bounds):
        s.take(CHAT_STREAM[a:b])
    assert s.events == 5  # the role chunk, three tokens, [DONE]


def test_an_event_past_the_limit_is_relayed_as_it_is() -> None:
    s = engine_stream()
    big = b"x" * (relay.MAX_EVENT_BYTES // 2)
    assert s.take(big) == b""
    assert s.take(big) == b""
    assert s.take(b"y") == big + big + b"y"
    assert s.take(b"z\n\n") == b"z\n\n"
    # The limit counts the part of an event that came with the end of the one before.
    rest = b"x" * (relay.MAX_EVENT_BYTES - 10)
    assert s.take(b"data: a\n\n" + rest) == b"data: a\n\n"
    assert s.take(b"y" * 20) == rest + b"y" * 20
    # And starts again with each event: one under it is held whole, however it trickles in.
    s = engine_stream()
    assert s.take(rest[:-1]) == b""
    assert s.take(b"x\n\n") == rest + b"\n\n"
    assert s.take(b"data: " + rest[:-16]) == b""
    assert s.take(b"z" * 10) == b""
    assert s.take(b"\n\n") == b"data: " + rest[:-16] + b"z" * 10 + b"\n\n"


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
    # Numbered: what was held leaves before what came after it.
    event = b'data: {"choices":[{"index":0,"delta":{"content":"t%d"}}]}\n\n' + relay.DONE
    for i in range(2000):
        s.sink(event % i)
    assert not s.failed
    assert len(s.held) <= relay.END_NOW_MAX
    sent, pos = bytearray(), 0
    while pos < len(client.sent):  # the chunk frames the direct path wrote
        line = client.sent.index(b"\r\n", pos)
        size = int(client.sent[pos:line], 16)
        sent += client.sent[line + 2 : line + 2 + size]
        pos = line + 4 + size
    assert sent + s.held == b"".join(event % i for i in range(2000))


class Counting:
    """The dispatcher's usage hook as it is (`Accounting.usage`), its metrics, quotas and
    KV routing recorded."""

    usage = Accounting.usage

    def __init__(self) -> None:
        self.metrics = self.kv = self
        self.tokens = [0, 0]
        self.cache: list[int] = []
        self.compared: list[tuple[str, int, int]] = []

    def count_tokens(self, _: str, prompt: int, completion: int) -> None:
        self.tokens[0] += prompt
        self.tokens[1] += completion

    def cache_delivered(self, _: str, cached: int) -> None:
        self.cache.append(cached)

    def delivered(self, endpoint: str, predicted: int, cached: int) -> None:
        self.compared.append((endpoint, predicted, cached))


def test_the_cached_tokens_of_a_stream_repeating_its_usage_are_counted_once() -> None:
    """vLLM with `stream_options.continuous_usage_stats`: every chunk carries the usage so
    far, and only the last, usage-only one the prompt's cached tokens. That one adds no
    token, and its cached tokens went uncounted with it (the metric, and the KV routing's
    comparison with its prediction)."""
    hooks = Counting()
    s = engine_stream(hooks)
    s.client.cached_predicted, s.client.cached_endpoint = 8, "e"
    head = b'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"m",'
    for n in range(1, 4):
        s.take(head + b'"choices":[{"index":0,"delta":{"content":"t"},"finish_reason":null}],'
               b'"usage":{"prompt_tokens":10,"completion_tokens":%d}}\n\n' % n)  # fmt: skip
    last = head + (b'"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":3,'
                   b'"prompt_tokens_details":{"cached_tokens":8}}}\n\n')  # fmt: skip
    s.take(last)
    assert hooks.tokens == [10, 3]
    assert hooks.cache == [8]
    assert hooks.compared == [("e", 8, 8)]
    s.take(last)  # the same usage again (an engine that repeats it): counted once
    assert (hooks.tokens, hooks.cache, hooks.compared) == ([10, 3], [8], [("e", 8, 8)])


def test_opening_events_trickling_in_are_looked_at_once_each(monkeypatch: Any) -> None:
    """An engine held before its first token sends opening events (or bare blank lines)
    two bytes a read: every read looked at all the held bytes again, 80 s of the router's
    loop for 64 KiB of them, from one request. Each read's bytes are looked at once."""
    looked = [0]
    only_openers = relay.sse.only_openers

    def counted(data: bytes) -> bool:
        looked[0] += len(data)
        return only_openers(data)

    monkeypatch.setattr(relay.sse, "only_openers", counted)
    s = engine_stream()
    for piece in [b"\n\n"] * 4000 + [b"event: ping\n\n"] * 1000:
        assert s.feed(piece, 1.0) == b""
    held = 4000 * 2 + 1000 * 13
    assert s.first == b"\n\n" * 4000 + b"event: ping\n\n" * 1000
    assert looked[0] <= 2 * held


MESSAGES_STREAM = (
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"m","type":"message",'
    b'"role":"assistant","content":[],"usage":{"input_tokens":10,"output_tokens":0}}}\n\n'
    + b"".join(
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":"t%d"}}\n\n' % i
        for i in range(6)
    )
    + b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
)


def test_a_whole_stream_whose_engine_told_only_its_prompt_is_charged_for_its_answer() -> None:
    """The Messages API tells the prompt's tokens in message_start; an engine that then
    never tells the answer's (no usage in message_delta) still had its answer charged,
    estimated, as one that told nothing: counting the prompt alone made the answer free."""
    hooks = Counting()
    accounting = Accounting(hooks, hooks, None)  # type: ignore[arg-type]
    s = engine_stream(accounting, kind="messages")
    assert s.take(MESSAGES_STREAM) == MESSAGES_STREAM
    assert hooks.tokens == [10, 0]
    accounting.ended(s.prof, s.client, s.events)
    assert s.events == 8
    assert hooks.tokens == [10, 8]
    accounting.ended(s.prof, s.client, s.events)  # told now: not charged again
    assert hooks.tokens == [10, 8]


def test_a_cut_stream_is_charged_the_prompt_its_engine_told_not_an_estimate() -> None:
    """A Messages stream cut after its engine told the prompt's tokens: those are charged,
    not the estimate from the prompt's characters (four times as many here), and each
    event relayed counts a completion token."""
    hooks = Counting()
    accounting = Accounting(hooks, hooks, None)  # type: ignore[arg-type]
    s = engine_stream(accounting, kind="messages")
    s.client.prompt_chars = 160
    cut = MESSAGES_STREAM.index(b"event: content_block_delta", 200)
    s.take(MESSAGES_STREAM[:cut])
    accounting.cut(s.prof, s.client, s.events)
    assert s.events == 2  # message_start and one text delta
    assert hooks.tokens == [10, 2]


class Clock:
    """The attempt's deadline as the relay moves it (`Deadline`), its firing in the test's
    hands; the hooks the first token is told to."""

    def __init__(self, *, fired: bool = False) -> None:
        self.when = 100.0
        self.fired = fired
        self.firsts: list[float] = []

    def expired(self) -> bool:
        return self.fired

    def reschedule(self, when: float) -> None:
        self.when = when

    def first_token(self, _: str, after_s: float) -> None:
        self.firsts.append(after_s)

    def usage(self, *_: Any) -> None:
        pass


def test_openers_are_held_up_to_a_bound_then_relayed() -> None:
    """An engine that sends opening events and never a token: past OPENERS_HELD bytes they
    start the response rather than pile up in the router until the first-token deadline."""
    clock = Clock()
    s = engine_stream(clock)
    s.deadline = clock  # type: ignore[assignment]
    ping = b"event: ping\ndata: {}\n\n"
    sent = b""
    while len(sent) < 2 * relay.OPENERS_HELD:
        out = s.feed(ping, 1.0)
        sent += ping
        if out:
            break
    assert out == sent
    assert len(sent) <= relay.OPENERS_HELD + len(ping)
    assert s.t_first == 1.0
    assert len(clock.firsts) == 1


def test_a_token_after_the_first_token_deadline_fired_is_not_relayed() -> None:
    """The deadline fired (the request moves to another endpoint) and a token arrives
    before the relay is woken: relayed, the client would get this engine's first token
    and then another engine's whole answer."""
    clock = Clock(fired=True)
    s = engine_stream(clock)
    s.deadline = clock  # type: ignore[assignment]
    assert s.feed(b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n', 1.0) == b""
    assert s.t_first == 0.0
    assert clock.firsts == []


def test_each_chunk_moves_the_idle_deadline_but_never_past_the_total() -> None:
    clock = Clock()
    s = engine_stream(clock)
    s.deadline, s.idle, s.total_at = clock, 5.0, 10.0  # type: ignore[assignment]
    s.feed(b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n', 1.0)
    assert clock.when == 6.0  # the first token: the idle gap from here
    s.feed(b'data: {"choices":[{"index":0,"delta":{"content":"b"}}]}\n\n', 3.0)
    assert clock.when == 8.0
    s.feed(b'data: {"choices":[{"index":0,"delta":{"content":"c"}}]}\n\n', 7.0)
    assert clock.when == 10.0  # the request's total deadline, not 12
    # What the mean gap between chunks is taken from: three chunks, 1.0 to 7.0.
    assert (s.chunks, s.t_first, s.t_last) == (3, 1.0, 7.0)


@given(st.sampled_from(["chat", "messages"]), st.booleans())
def test_a_messages_stream_reaches_its_client_opened_by_message_start(
    kind: str, engine_opens: bool
) -> None:
    """llama-server may leave a Messages stream's message_start out: the relay writes it
    before the first token (Anthropic's SDKs fail a stream without it), once, and never
    into another API's stream."""
    clock = Clock()
    s = engine_stream(clock, kind=kind)
    s.deadline = clock  # type: ignore[assignment]
    engine = (
        MESSAGES_STREAM if engine_opens else MESSAGES_STREAM[MESSAGES_STREAM.index(b"\n\n") + 2 :]
    )
    out = s.feed(engine[: engine.index(b"\n\n") + 2], 1.0) + s.feed(
        engine[engine.index(b"\n\n") + 2 :], 1.5
    )
    opened = out.startswith(b"event: message_start\n")
    assert opened == (kind == "messages" or engine_opens)
    assert out.count(b"event: message_start\n") == (1 if opened else 0)
    assert out.endswith(engine)

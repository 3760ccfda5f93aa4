"""Dispatch (llmgw.router.dispatch) through the router's front door, in-process: the body
each attempt sends, fallbacks and the keys they are tried for, ranking's hooks, breakers,
room on endpoints, prefixes and sessions remembered."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
import pytest
from aiohttp import web

from llmgw.core.profile import Queueing
from llmgw.router import dispatch, queueing
from llmgw.router.attempts import Attempt
from llmgw.router.errors import Retry
from llmgw.router.relay import ClientStream
from tests.unit import route_kit
from tests.unit.route_kit import Recording


async def test_an_alias_reaches_the_engine_as_the_models_name() -> None:
    fleet = Recording()
    try:
        assert (await fleet.chat("ma")).status == 200
        assert [(model, body["model"]) for model, _, body in fleet.sent] == [("m", "m")]
        assert fleet.sent[0][2]["messages"] == [{"role": "user", "content": "hi"}]
    finally:
        fleet.close()


async def test_a_fallback_gets_the_body_renamed_and_counts_once() -> None:
    fleet = Recording(failing=("m",))
    fallbacks = fleet.router.metrics.fallbacks.values
    sources = fleet.router.metrics.cache_sources.values
    try:
        assert (await fleet.chat("ma")).status == 200
        tried = [(model, body["model"]) for model, _, body in fleet.sent]
        assert tried[-1] == ("f", "f")
        assert set(tried[:-1]) == {("m", "m")}
        assert fallbacks == {("m", "f"): 1.0}
        # Ranked on the cache of `m`, served by `f`: no prediction of `m` to measure.
        assert sources == {}
        fleet.failing = ()
        assert (await fleet.chat("m")).status == 200
        assert fleet.sent[-1][0] == "m"
        assert fallbacks == {("m", "f"): 1.0}  # the model asked for is no fallback
        assert sum(sources.values()) == 1.0
        # Requests are counted for the model asked, once each, whoever served them.
        assert fleet.router.dispatcher.received == {"m": 2}
    finally:
        fleet.close()


async def test_scorer_values_are_observed_for_one_ranked_request_in_a_sample() -> None:
    fleet = Recording()
    scores = fleet.router.metrics.scores.values
    try:
        for n in range(1, 2 * dispatch.SCORE_SAMPLE + 1):
            assert (await fleet.chat("w")).status == 200  # ranked by weights
            sampled = n // dispatch.SCORE_SAMPLE
            assert {sum(counts[:-1]) for counts in scores.values()} <= {float(sampled)}, n
            assert bool(scores) is (sampled > 0), n
    finally:
        fleet.close()


async def test_a_fallback_the_key_may_not_use_is_never_tried() -> None:
    fleet = Recording(failing=("m",))
    try:
        headers = route_kit.auth_headers("kc", None)  # may use m (and ma), not f
        resp = await fleet.chat("m", headers)
        assert resp.status == 503
        assert fleet.sent
        assert {model for model, _, _ in fleet.sent} == {"m"}
        assert fleet.router.metrics.fallbacks.values == {}
    finally:
        fleet.close()


async def test_an_engines_429_never_counts_against_its_breaker_and_a_503_does() -> None:
    """A 429 is the engine's load: its breaker stays closed however many come, while as
    many 503s open it (the attempts themselves, their answers made up at the exchange)."""
    fleet = Recording()
    d = fleet.router.dispatcher
    del d._attempt  # the dispatcher's own attempts, breakers and all
    answers: list[Retry] = []

    async def exchange(at: Attempt, body: bytes, state: ClientStream) -> web.StreamResponse:
        raise answers.pop()

    d._exchange = exchange  # type: ignore[method-assign]
    e2 = fleet.endpoint("e2")  # the only endpoint of `f`, which has no fallback
    try:
        for _ in range(2 * fleet.router.cfg.breaker.failures_to_open):
            answers.append(Retry("status_429", 429, "busy", fault=False))
            assert (await fleet.chat("f")).status == 429
            assert e2.breaker.state == "closed"
            assert e2.inflight == 0
        # A 429 between 503s neither counts nor clears the 503s before it.
        for n in range(fleet.router.cfg.breaker.failures_to_open):
            answers.append(Retry("status_503", 503, "down"))
            assert (await fleet.chat("f")).status == 503
            if n == 0:
                answers.append(Retry("status_429", 429, "busy", fault=False))
                assert (await fleet.chat("f")).status == 429
        assert e2.breaker.state == "open"
        assert e2.inflight == 0
    finally:
        fleet.close()


async def test_a_full_endpoint_is_never_ranked_even_for_its_session() -> None:
    """Under a per-endpoint bound, a session's endpoint that is full is passed over for one
    with room (the session counts most in ranking, room comes first)."""
    fleet = Recording()
    capped = msgspec.structs.replace(
        route_kit.MODELS[2], queue=Queueing(max_inflight_per_endpoint=1)
    )
    fleet.router.catalog.put(capped)
    session = {route_kit.SESSION: "conversation"}
    try:
        assert (await fleet.chat("w", session)).status == 200
        first = fleet.attempts[-1][0]
        assert (await fleet.chat("w", session)).status == 200
        assert fleet.attempts[-1][0] == first  # the session's endpoint, while it has room
        fleet.endpoint(first).inflight = 1
        assert (await fleet.chat("w", session)).status == 200
        assert fleet.attempts[-1][0] in {"e0", "e1"} - {first}
    finally:
        fleet.close()


async def _until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(what)


async def test_a_request_waiting_for_room_goes_as_soon_as_an_attempt_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The end of an attempt lets out the request waiting for its room: it does not wait
    for the queue's regular look for room (made an hour apart here)."""
    monkeypatch.setattr(queueing, "PUMP_S", 3600.0)
    fleet = Recording()
    d = fleet.router.dispatcher
    del d._attempt
    go = asyncio.Event()

    async def exchange(at: Attempt, body: bytes, state: ClientStream) -> web.StreamResponse:
        await go.wait()
        return web.Response(status=200, body=b"{}", content_type="application/json")

    d._exchange = exchange  # type: ignore[method-assign]
    one = msgspec.structs.replace(route_kit.MODELS[1], queue=Queueing(max_inflight_per_endpoint=1))
    fleet.router.catalog.put(one)  # `f`: one endpoint, e2, one request at a time
    try:
        first = asyncio.create_task(fleet.chat("f"))
        await _until(lambda: fleet.endpoint("e2").inflight == 1, "the first never went")
        second = asyncio.create_task(fleet.chat("f"))
        await _until(lambda: d.queues.waiting.get("f") == 1, "the second never waited")
        go.set()
        assert (await first).status == 200
        async with asyncio.timeout(10):
            assert (await second).status == 200
    finally:
        fleet.close()


async def test_a_prompt_sent_again_goes_where_its_prefix_went() -> None:
    """A model ranked by weights: the endpoint that answered a prompt is remembered as
    holding its prefix, and the same prompt goes there again."""
    fleet = Recording()
    text = " ".join(f"part {i} of a long shared system prompt" for i in range(200))
    messages = [{"role": "system", "content": text}, {"role": "user", "content": "q"}]
    try:
        for _ in range(10):
            assert (await fleet.chat("w", messages=messages)).status == 200
        assert len({ep for ep, _ in fleet.attempts}) == 1
        assert fleet.attempts[0][0] in {"e0", "e1"}
    finally:
        fleet.close()


async def test_a_session_in_use_is_the_last_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    """The router remembers the latest SESSIONS_KEPT sessions: one that keeps coming back
    to its endpoint stays remembered while older, idle ones are forgotten."""
    monkeypatch.setattr(dispatch, "SESSIONS_KEPT", 3)
    fleet = Recording()
    sessions = fleet.router.dispatcher.sessions
    try:

        async def turn(session: str) -> None:
            assert (await fleet.chat("w", {route_kit.SESSION: session})).status == 200

        await turn("hot")
        for n in range(6):
            await turn(f"idle-{n}")
            # Newer than every idle session but the one just begun: still remembered.
            assert [key for key in sessions if "hot" in key], n
            assert len(sessions) == min(n + 2, 3)
            await turn("hot")  # the same endpoint again: its conversation goes on
        assert {ep for ep, _ in fleet.attempts[::2]} == {fleet.attempts[0][0]}
        assert not any("idle-3" in key for key in sessions)
        assert [key for key in sessions if "idle-5" in key]
    finally:
        fleet.close()

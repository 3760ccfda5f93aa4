"""What a key is charged for a stream, whole or cut, and how its usage counts it: a router
served in this process in front of a canned engine (aiohttp, on its own thread) that
streams chunks without a usage chunk unless it is asked for one, and that holds a stream
after a few chunks (until the module's end) when the test means the client to hang up, and
that ignores the request for a usage chunk when told to be deaf."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web

from llmgw.core import tenancy
from llmgw.router import auth
from llmgw.router.app import Router
from llmgw.router.config import RouterConfig
from llmgw.router.front import build_server
from tests.kit.threaded_http import ThreadedApp, engine_app

pytestmark = pytest.mark.slow

SECRET = auth.new_key()
CHUNKS = 12
"""The content chunks every stream of the engine has."""
HELD_AFTER = 5
"""Where the engine holds a stream the client is to cut: after this many chunks."""


class StreamingEngine(ThreadedApp):
    """Streams CHUNKS chunks of one token each, then its usage (when the request asks for
    it, unless its prompt says "deaf") and [DONE]; a request whose prompt says "hold" stops
    after HELD_AFTER chunks and waits until `let_go`, one that says "break" ends there; one
    that says "refuse" gets a 400, "fail" a 500, and one that says "empty" a stream that ends
    before its first token."""

    def __init__(self) -> None:
        self.held: list[asyncio.Event] = []
        super().__init__(engine_app(self._chat))

    def let_go(self) -> None:
        """End the streams held (their clients are long gone)."""

        def release() -> None:
            for e in self.held:
                e.set()

        self.loop.call_soon_threadsafe(release)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body["messages"][0]["content"]
        held, deaf = "hold" in prompt, "deaf" in prompt
        if "fail" in prompt:  # an engine's fault (a "late" one after a while)
            await asyncio.sleep(0.5 if "late" in prompt else 0)
            return web.json_response({"error": {"message": "failed"}}, status=500)
        if "refuse" in prompt:  # an engine's 4xx, its body the length of an answer
            error = {"message": "no " * 400, "type": "invalid_request_error"}
            # Labelled as a stream by a careless engine or proxy when the prompt says so.
            kind = "text/event-stream" if "labelled" in prompt else "application/json"
            return web.json_response({"error": error}, status=400, content_type=kind)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if "empty" in prompt:  # the role-only opener, then the end: no token
            await resp.write(event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}))
            return resp
        for i in range(CHUNKS):
            if held and i == HELD_AFTER:
                self.held.append(asyncio.Event())
                await self.held[-1].wait()
                return resp
            if "break" in prompt and i == HELD_AFTER:
                return resp  # the body ends, no [DONE]: the engine broke off
            await resp.write(event({"choices": [{"index": 0, "delta": {"content": "w"}}]}))
        if (body.get("stream_options") or {}).get("include_usage") and not deaf:
            usage = {"prompt_tokens": 7, "completion_tokens": CHUNKS, "total_tokens": 7 + CHUNKS}
            await resp.write(event({"choices": [], "usage": usage}))
        await resp.write(b"data: [DONE]\n\n")
        return resp


def event(doc: dict[str, Any]) -> bytes:
    chunk = {"id": "c", "object": "chat.completion.chunk", **doc}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


@pytest.fixture(scope="module")
def engine() -> Iterator[StreamingEngine]:
    e = StreamingEngine()
    yield e
    e.let_go()
    e.stop()


async def serve(
    engine_url: str, count_stream_tokens: bool, **settings: Any
) -> AsyncIterator[tuple[Router, str]]:
    """A router (with `settings`) in front of the engine that knows SECRET as a key of the
    fleet's log."""
    cfg = msgspec.convert(
        {
            "auth": {"allow_anonymous": True},
            "models": [{"name": "m"}],
            "endpoints": [{"id": "e", "url": engine_url, "models": ["m"]}],
            "probe_interval_s": 60,
            "count_stream_tokens": count_stream_tokens,
            **settings,
        },
        RouterConfig,
    )
    router = Router(cfg)
    router.table.add("e", engine_url, ["m"], ready=True)
    await router.start()
    principal = auth.Principal(tenancy.KeySettings(name="tenant"), auth.digest(SECRET), 0.0)
    principal.fleet = True  # as `auth.merged` makes a key of the log
    router.keys = auth.Keys([principal])
    runner = web.ServerRunner(build_server(router))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield router, f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
        await router.stop()


@pytest.fixture(params=[True, False], ids=["counting", "not-counting"])
async def served(
    request: pytest.FixtureRequest, engine: StreamingEngine
) -> AsyncIterator[tuple[Router, str]]:
    async for pair in serve(engine.url, request.param):
        yield pair


def body(prompt: str, *, include_usage: bool = False) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "model": "m", "stream": True, "messages": [{"role": "user", "content": prompt}],
    }  # fmt: skip
    if include_usage:
        doc["stream_options"] = {"include_usage": True}
    return doc


async def whole_stream(url: str, doc: dict[str, Any]) -> bytes:
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/chat/completions", json=doc, headers=bearer()) as resp,
    ):
        assert resp.status == 200, await resp.text()
        return await resp.read()


async def cut_stream(url: str, doc: dict[str, Any]) -> None:
    """Read the stream until the engine holds it, then hang up."""
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/chat/completions", json=doc, headers=bearer()) as resp,
    ):
        assert resp.status == 200, await resp.text()
        got = b""
        while got.count(b"data:") < HELD_AFTER:
            got += await resp.content.readany()


def bearer() -> dict[str, str]:
    return {"Authorization": f"Bearer {SECRET}"}


async def done(router: Router, requests: int) -> None:
    """Until the router has recorded `requests` requests of the key (30 s at most)."""
    async with asyncio.timeout(30):
        while True:
            if sum(router.metrics.key_requests.values.values()) >= requests:
                return
            await asyncio.sleep(0.05)


def charged(router: Router) -> tuple[float, float]:
    tokens = router.metrics.key_tokens.values
    return tokens.get(("tenant", "", "m", "in"), 0.0), tokens.get(("tenant", "", "m", "out"), 0.0)


def usage_row(router: Router) -> list[int]:
    """The key's tokens in, out and requests waiting for the usage counters."""
    return router.dispatcher.quotas.usage.row("tenant", "m")


async def test_a_whole_and_a_cut_stream_are_charged_alike_whatever_count_stream_tokens(
    served: tuple[Router, str],
) -> None:
    """A stream whose engine says no usage (none was asked for) was charged nothing whole
    and an estimate when the client cut it: with `count_stream_tokens: false` hanging up
    cost more than reading to the end. Both are now counted alike: with the setting on,
    the usage the router asks for and, cut, its estimate; off, neither."""
    router, url = served
    await whole_stream(url, body("all of it"))
    await done(router, 1)
    whole = charged(router)
    await cut_stream(url, body("hold"))
    await done(router, 2)
    cut = [after - before for after, before in zip(charged(router), whole, strict=True)]
    if router.cfg.count_stream_tokens:
        assert whole == (7, CHUNKS)
        assert cut[1] >= HELD_AFTER
        assert cut[0] > 0
    else:
        assert whole == (0, 0)
        assert cut == [0, 0]


async def test_a_stream_whose_client_asked_for_usage_is_charged_cut_even_when_not_counting(
    engine: StreamingEngine,
) -> None:
    """With `count_stream_tokens: false` a client that asks for the usage chunk is charged
    by it; cut before it came, by its estimate, as with the setting on."""
    async for router, url in serve(engine.url, count_stream_tokens=False):
        await whole_stream(url, body("all of it", include_usage=True))
        await done(router, 1)
        assert charged(router) == (7, CHUNKS)
        await cut_stream(url, body("hold", include_usage=True))
        await done(router, 2)
        prompt, completion = charged(router)
        assert completion - CHUNKS >= HELD_AFTER
        assert prompt > 7


async def test_a_stream_the_client_cut_counts_as_a_request_in_the_keys_usage(
    engine: StreamingEngine,
) -> None:
    """A stream cut by its client (recorded as 499) is charged its tokens: the usage that
    `llmgw ctl usage` sums counted its tokens without the request they were charged to."""
    async for router, url in serve(engine.url, count_stream_tokens=True):
        await cut_stream(url, body("hold"))
        await done(router, 1)
        assert router.metrics.key_requests.values == {("tenant", "", "m", "499"): 1.0}
        tokens_in, tokens_out, requests = usage_row(router)
        assert tokens_out >= HELD_AFTER
        assert tokens_in > 0
        assert requests == 1


@pytest.mark.parametrize("ending", ["whole", "cut"])
@pytest.mark.parametrize("engine_usage", [True, False], ids=["usage-chunk", "no-usage-chunk"])
async def test_a_counted_stream_is_charged_whether_or_not_its_engine_sends_usage(
    engine: StreamingEngine, ending: str, engine_usage: bool
) -> None:
    """With `count_stream_tokens` on, a stream whose engine ignores the usage the router
    asks for was charged nothing when it ended whole (an estimate only when cut): either
    end, usage chunk or none, is now charged: the engine's usage, else its estimate."""
    prompt = ("hold " if ending == "cut" else "all of it ") + ("" if engine_usage else "deaf")
    async for router, url in serve(engine.url, count_stream_tokens=True):
        if ending == "cut":
            await cut_stream(url, body(prompt))
        else:
            await whole_stream(url, body(prompt))
        await done(router, 1)
        prompt_tokens, completion_tokens = charged(router)
        if ending == "whole" and engine_usage:
            assert (prompt_tokens, completion_tokens) == (7, CHUNKS)
        else:
            assert prompt_tokens > 0
            assert completion_tokens >= (CHUNKS if ending == "whole" else HELD_AFTER)


@pytest.mark.parametrize("prompt", ["refuse", "refuse labelled", "empty"])
async def test_a_request_the_engine_refused_or_left_unanswered_is_charged_nothing(
    engine: StreamingEngine, prompt: str
) -> None:
    """The engine's 400 (its body as long as an answer) reaches the client as it is; a
    stream that ended before its first token is a 502 after every endpoint was tried. No
    token of either reached the client: charging the 400 as an answer, or the failed
    attempt as a cut stream, billed the key for an error."""
    async for router, url in serve(engine.url, count_stream_tokens=True):
        async with (
            aiohttp.ClientSession() as http,
            http.post(url + "/v1/chat/completions", json=body(prompt), headers=bearer()) as resp,
        ):
            assert resp.status == (400 if "refuse" in prompt else 502), await resp.text()
        await done(router, 1)
        assert charged(router) == (0, 0)
        assert usage_row(router)[:2] == [0, 0]


async def test_a_stream_its_engine_broke_off_is_charged_and_faults_the_endpoint(
    engine: StreamingEngine,
) -> None:
    """The engine ended the body after HELD_AFTER tokens, without [DONE]: the client gets
    them and an error event, the key is charged for them, and the endpoint's breaker
    counts a failure (taken for a success, a replica that cut every answer short stayed
    in rotation)."""
    async for router, url in serve(engine.url, count_stream_tokens=True):
        got = await whole_stream(url, body("break"))
        await done(router, 1)
        assert got.count(b'"content": "w"') == HELD_AFTER
        assert b"engine_disconnected" in got.rsplit(b"\n\n", 2)[-2]
        prompt_tokens, completion_tokens = charged(router)
        assert prompt_tokens > 0
        assert completion_tokens >= HELD_AFTER
        assert router.table.by_id["e"].breaker.failures == 1
        assert router.table.by_id["e"].inflight == 0  # what ranking reads of its load
        # Its status, where metrics and the access log record it: the error event's.
        assert router.metrics.key_requests.values == {("tenant", "", "m", "502"): 1.0}


async def test_a_stream_cut_at_its_idle_deadline_is_recorded_as_a_504(
    engine: StreamingEngine,
) -> None:
    models = [{"name": "m", "deadlines": {"idle_s": 0.3}}]
    async for router, url in serve(engine.url, count_stream_tokens=True, models=models):
        got = await whole_stream(url, body("hold"))
        await done(router, 1)
        assert b"idle_timeout" in got.rsplit(b"\n\n", 2)[-2]
        assert router.metrics.key_requests.values == {("tenant", "", "m", "504"): 1.0}


async def test_a_probe_its_client_cut_lets_the_next_request_probe(
    engine: StreamingEngine,
) -> None:
    """The endpoint's breaker is open; after its cool-down one request probes it, and that
    client hangs up: no verdict, and the next request may probe. (Left probing, the
    breaker refused every request to the endpoint for good.)"""
    breaker = {"failures_to_open": 1, "open_s": 0.2}
    async for router, url in serve(engine.url, count_stream_tokens=True, breaker=breaker):
        async with (
            aiohttp.ClientSession() as http,
            http.post(url + "/v1/chat/completions", json=body("fail"), headers=bearer()) as resp,
        ):
            assert resp.status == 502
        ep = router.table.by_id["e"]
        assert ep.breaker.state == "open"
        await asyncio.sleep(0.3)
        await cut_stream(url, body("hold"))  # the probe, cut by its client
        await done(router, 2)
        assert ep.breaker.state == "half_open"
        assert not ep.breaker.probing
        assert b"[DONE]" in await whole_stream(url, body("all of it"))
        assert ep.breaker.state == "closed"
        assert ep.inflight == 0  # the failed, the cut and the whole attempt each ended


async def test_a_failure_after_keepalive_comments_ends_the_stream_with_an_error_event(
    engine: StreamingEngine,
) -> None:
    """Keep-alive comments began the response as a 200 stream; every endpoint then failed:
    the status can no longer change, so the stream ends with the failure's error event
    (a refusal's own response could no longer be sent: the client waited for ever)."""
    async for router, url in serve(engine.url, count_stream_tokens=True, keepalive_s=0.05):
        async with asyncio.timeout(30):  # (the stream left open, the client waited for ever)
            got = await whole_stream(url, body("late fail"))
        await done(router, 1)
        assert got.startswith(b": keep-alive\n\n")
        last = json.loads(got.rstrip(b"\n").rsplit(b"\n\n", 1)[-1].removeprefix(b"data: "))
        assert last["error"]["code"] == "status_500"
        assert router.metrics.key_requests.values == {("tenant", "", "m", "502"): 1.0}
        assert charged(router) == (0, 0)

"""What a broken or compromised engine sends never crashes a request in the router, nor
skews what it counts: usage with absurd or negative numbers, answers nested too deeply to
decode. A canned engine (aiohttp, on its own thread) behind a real router."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest
from aiohttp import web

from llmgw.router.metrics import KNOWN_STATUSES
from tests.integration.router_kit import Router
from tests.kit.threaded_http import ThreadedApp, engine_app

pytestmark = pytest.mark.slow

CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


class CannedEngine(ThreadedApp):
    """An engine that answers every chat request with `body` (JSON, or SSE when `sse`)."""

    def __init__(self) -> None:
        self.body = b"{}"
        self.sse = False
        self.status = 200
        self.endless = 0
        """When set, the answer is this many bytes (or until the router hangs up), sent in
        64 KiB writes: an engine that does not stop."""
        self.written = 0
        super().__init__(engine_app(self._chat))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        if self.endless:
            return await self._endless(request)
        kind = "text/event-stream" if self.sse else "application/json"
        return web.Response(status=self.status, body=self.body, headers={"Content-Type": kind})

    async def _endless(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        self.written = 0
        try:
            while self.written < self.endless:
                await resp.write(b" " * 65_536)
                self.written += 65_536
            await resp.write_eof()
        except (ConnectionError, RuntimeError):
            pass  # the router hung up
        return resp


@pytest.fixture(scope="module")
def engine() -> Iterator[CannedEngine]:
    e = CannedEngine()
    yield e
    e.stop()


@pytest.fixture(scope="module")
def router(engine: CannedEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    r = Router.start(tmp_path_factory.mktemp("hostile-engine"), {"e": engine.url})
    yield r
    r.stop()


def answer(usage: str) -> bytes:
    """A chat completion whose usage object is `usage` (JSON text, as the engine wrote it)."""
    message = {"role": "assistant", "content": "ok"}
    choices = json.dumps([{"index": 0, "finish_reason": "stop", "message": message}])
    return f'{{"id":"x","object":"chat.completion","choices":{choices},"usage":{usage}}}'.encode()


def tokens_counted(router: Router) -> tuple[float, float]:
    m = router.metrics()
    return (
        m.get('llmgw_router_tokens_total{direction="in",model="m"}', 0.0),
        m.get('llmgw_router_tokens_total{direction="out",model="m"}', 0.0),
    )


def test_an_engines_usage_is_counted(engine: CannedEngine, router: Router) -> None:
    engine.sse, engine.body = False, answer('{"prompt_tokens":3,"completion_tokens":2}')
    before = tokens_counted(router)
    with httpx.Client(base_url=router.url, timeout=10) as h:
        assert h.post("/v1/chat/completions", json=CHAT).status_code == 200
    after = tokens_counted(router)
    assert (after[0] - before[0], after[1] - before[1]) == (3, 2)


@pytest.mark.parametrize("usage", [None, "null"], ids=["no-usage", "usage-null"])
def test_a_whole_answer_without_usage_is_charged_its_estimate(
    engine: CannedEngine, router: Router, usage: str | None
) -> None:
    """An engine that reports no usage on a whole answer cost its keys nothing: it is
    charged the estimate, as a stream without usage is (a token per four characters of the
    prompt's body and of the answer)."""
    body = answer("0")
    if usage is None:
        body = body.replace(b',"usage":0', b"")
    else:
        body = body.replace(b',"usage":0', b',"usage":' + usage.encode())
    engine.sse, engine.body = False, body
    before = tokens_counted(router)
    with httpx.Client(base_url=router.url, timeout=10) as h:
        assert h.post("/v1/chat/completions", json=CHAT).status_code == 200
    counted = [after - was for after, was in zip(tokens_counted(router), before, strict=True)]
    assert 0 < counted[0] <= len(json.dumps(CHAT)), counted
    assert counted[1] == len(body) // 4, counted


@pytest.mark.parametrize(
    "usage",
    [
        '{"prompt_tokens":1' + "0" * 400 + ',"completion_tokens":1}',  # past a float
        '{"prompt_tokens":-1000000,"completion_tokens":-5}',
        '{"prompt_tokens":1,"completion_tokens":18446744073709551615}',
        '{"prompt_tokens":1,"prompt_tokens_details":{"cached_tokens":-7}}',
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_absurd_usage_is_not_counted_and_the_answer_still_arrives(
    engine: CannedEngine, router: Router, usage: str, stream: bool
) -> None:
    body = answer(usage)
    engine.sse = stream
    engine.body = b"data: " + body + b"\n\ndata: [DONE]\n\n" if stream else body
    before = tokens_counted(router)
    with httpx.Client(base_url=router.url, timeout=10) as h:
        r = h.post("/v1/chat/completions", json={**CHAT, "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        assert r.text.endswith("data: [DONE]\n\n"), r.text
    else:
        assert r.json()["choices"][0]["message"]["content"] == "ok"
    counted = [after - was for after, was in zip(tokens_counted(router), before, strict=True)]
    # A usage the router cannot take is no usage: the answer is charged the estimate of one
    # whose engine sent none (a token per four characters of the prompt's body; one per
    # event of a stream, per four characters of a whole answer), never the engine's numbers.
    assert 0 < counted[0] <= len(json.dumps(CHAT)), counted
    assert 0 < counted[1] <= (2 if stream else len(body) // 4), counted


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("asked", "reported", "counted"),
    [
        ({"max_tokens": 5}, 2_000_000_000, 5),
        ({"max_tokens": 5, "n": 2}, 10, 10),  # each answer at its maximum: all of it
        ({"max_tokens": 5, "n": 2}, 11, 10),
        ({"max_completion_tokens": 7, "max_tokens": 3}, 9, 7),  # the larger one vLLM reads
        ({}, 2_000_000_000, 2_000_000_000),  # no maximum, no context known: as reported
    ],
)
def test_an_answer_is_charged_no_more_tokens_than_its_request_allowed(
    engine: CannedEngine,
    router: Router,
    stream: bool,
    asked: dict[str, int],
    reported: int,
    counted: int,
) -> None:
    """An engine says how many tokens its answer took; one that says billions charged the
    key billions, its budget spent and its windows in debt for weeks. No engine generates
    more than the request's maximum for each of its answers: what is counted stops there."""
    body = answer(f'{{"prompt_tokens":3,"completion_tokens":{reported}}}')
    engine.sse = stream
    engine.body = b"data: " + body + b"\n\ndata: [DONE]\n\n" if stream else body
    before = tokens_counted(router)
    with httpx.Client(base_url=router.url, timeout=10) as h:
        r = h.post("/v1/chat/completions", json={**CHAT, **asked, "stream": stream})
    assert r.status_code == 200, r.text
    after = tokens_counted(router)
    assert (after[0] - before[0], after[1] - before[1]) == (3, counted)


def test_an_answer_is_charged_no_more_tokens_than_the_models_context(
    engine: CannedEngine, tmp_path: Path
) -> None:
    """Where the model's profile names its context (`max_model_len`), no prompt is longer
    and no answer takes more, whatever the engine says (per answer asked for)."""
    r = Router.start(tmp_path, {"e": engine.url}, models=[{"name": "m", "max_model_len": 1000}])
    try:
        engine.sse = False
        engine.body = answer('{"prompt_tokens":2000000000,"completion_tokens":2000000000}')
        with httpx.Client(base_url=r.url, timeout=10) as h:
            for asked in ({}, {"n": 3}, {"max_tokens": 10}):
                before = tokens_counted(r)
                got = h.post("/v1/chat/completions", json={**CHAT, **asked})
                assert got.status_code == 200, got.text
                after = tokens_counted(r)
                expected = 10 if asked.get("max_tokens") else 1000 * asked.get("n", 1)
                assert (after[0] - before[0], after[1] - before[1]) == (1000, expected), asked
    finally:
        r.stop()


def test_a_llama_server_answer_may_be_longer_than_its_context(
    engine: CannedEngine, tmp_path: Path
) -> None:
    """llama-server with `--context-shift` writes on past its context: an answer that names
    no maximum is counted as its engine says, the prompt still at most the context."""
    llama = [{"name": "m", "engine": "llamacpp", "max_model_len": 1000}]
    r = Router.start(tmp_path, {"e": engine.url}, models=llama)
    try:
        engine.sse = False
        engine.body = answer('{"prompt_tokens":5000,"completion_tokens":5000}')
        with httpx.Client(base_url=r.url, timeout=10) as h:
            assert h.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert tokens_counted(r) == (1000, 5000)
    finally:
        r.stop()


def test_an_answer_nested_too_deeply_to_decode_is_still_relayed(
    engine: CannedEngine, router: Router
) -> None:
    """The router reads only the usage of an engine's answer; a field nested past what
    its decoder takes is the client's to deal with, not a crash of the request."""
    deep = b"[" * 100_000 + b"]" * 100_000
    engine.sse = False
    engine.body = answer('{"prompt_tokens":3,"completion_tokens":2}')[:-1] + b',"x":' + deep + b"}"
    with httpx.Client(base_url=router.url, timeout=10) as h:
        r = h.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, r.text[:300]
    assert r.content == engine.body


def test_the_statuses_an_engine_answers_add_few_series_to_the_metrics(
    engine: CannedEngine, router: Router
) -> None:
    """The router relays an engine's 2xx, 3xx and 4xx as they are, and its metrics counted
    each request under its status: an engine answering a new status each time (any of 300
    in 2xx to 4xx) added a series per status to every key and model it served, hundreds
    times what honest engines add. A status the router knows is its own label; any other
    is counted under its class ("2xx", "3xx", "4xx")."""
    engine.sse, engine.body = False, b'{"error":{"message":"no","type":"x"}}'
    odd = [s for s in range(201, 500) if s not in (204, 304, 401, 429)][::7]
    seen: list[int] = []
    try:
        with httpx.Client(base_url=router.url, timeout=10) as h:
            for status in odd:
                engine.status = status
                seen.append(h.post("/v1/chat/completions", json=CHAT).status_code)
    finally:
        engine.status = 200
    assert seen == odd  # the client still gets what the engine answered
    labels = {
        k.partition('status="')[2].rstrip('"}')
        for k in router.metrics()
        if k.startswith('llmgw_router_requests_total{model="m",')
    }
    assert labels <= {"2xx", "3xx", "4xx", *map(str, KNOWN_STATUSES)}, labels
    assert len(labels) <= 5, labels  # the classes, 200 and 499 (the engine answered one)


def test_the_failures_an_engine_answers_add_few_retry_reasons(
    engine: CannedEngine, tmp_path: Path
) -> None:
    """An engine's 5xx (and anything past 599) is retried elsewhere, the reason named in the
    retries' metrics, the attempt's span and the client's error code: a status the router
    does not know is named by its class, not one series per status an engine makes up."""
    engine.sse, engine.body = False, b'{"error":{"message":"no","type":"x"}}'
    odd = [505, 517, 598, 600, 777, 999]
    router = Router.start(tmp_path, {"e": engine.url}, breaker={"failures_to_open": 100})
    try:
        with httpx.Client(base_url=router.url, timeout=10) as h:
            for status in odd:
                engine.status = status
                got = h.post("/v1/chat/completions", json=CHAT)
                assert got.status_code == 502
                assert f"engine answered {status}" in got.json()["error"]["message"]
        reasons = {
            k.partition('reason="')[2].rstrip('"}')
            for k in router.metrics()
            if k.startswith('llmgw_router_retries_total{model="m",')
        }
    finally:
        engine.status = 200
        router.stop()
    assert reasons <= {"status_5xx", "status_6xx", "status_7xx", "status_9xx"}, reasons


def test_an_answer_past_max_answer_bytes_is_a_502_and_no_more_of_it_is_read(
    engine: CannedEngine, tmp_path: Path
) -> None:
    """The router holds a whole answer to count its usage: one from an engine that sends
    without end filled its memory. Past `max_answer_bytes` it is a 502 that says what to
    raise, the engine's connection is dropped, and the next request is answered."""
    r = Router.start(tmp_path, {"e": engine.url}, max_answer_bytes=1 << 20)
    try:
        engine.sse, engine.endless = False, 64 << 20
        with httpx.Client(base_url=r.url, timeout=30) as h:
            got = h.post("/v1/chat/completions", json=CHAT)
            assert got.status_code == 502, got.text[:200]
            assert got.json()["error"]["code"] == "answer_too_large"
            assert "max_answer_bytes" in got.json()["error"]["message"]
            assert engine.written < 64 << 20
            engine.endless, engine.body = 0, answer('{"prompt_tokens":3,"completion_tokens":2}')
            assert h.post("/v1/chat/completions", json=CHAT).status_code == 200
            # The limit is the most an answer may take: one of exactly that many bytes is
            # relayed whole, one byte more is not.
            exact = engine.body + b" " * ((1 << 20) - len(engine.body))
            engine.body = exact
            got = h.post("/v1/chat/completions", json=CHAT)
            assert got.status_code == 200, got.text[:200]
            assert got.content == exact
            engine.body = exact + b" "
            assert h.post("/v1/chat/completions", json=CHAT).status_code == 502
    finally:
        engine.endless = 0
        r.stop()


class Elsewhere(ThreadedApp):
    """A server an engine points the router's probes at (an internal service, a cloud's
    metadata address): every path answers 200, and each request is counted."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        app = web.Application()
        app.router.add_get("/{tail:.*}", self._any)
        super().__init__(app)

    async def _any(self, request: web.Request) -> web.Response:
        self.asked.append(request.path_qs)
        return web.json_response({})


def test_a_probe_redirected_elsewhere_is_not_followed(engine: CannedEngine, tmp_path: Path) -> None:
    """An engine's port decides what its /health and /metrics answer: a redirect to another
    host and path made the router fetch that URL from where it stands, every probe round
    (and told the engine, by the traffic it then got, whether the URL answered 200). A
    redirect is an answer like any other but 200: the endpoint is not ready, and nothing
    else is fetched."""
    other = Elsewhere()
    app = web.Application()
    redirecting = {"on": False}

    async def health(_: web.Request) -> web.StreamResponse:
        if redirecting["on"]:
            raise web.HTTPTemporaryRedirect(other.url + "/latest/meta-data/?from=health")
        return web.json_response({})

    async def metrics(_: web.Request) -> web.StreamResponse:
        raise web.HTTPTemporaryRedirect(other.url + "/internal/metrics?from=metrics")

    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    redirector = ThreadedApp(app)
    r = Router.start(tmp_path, {"e": redirector.url})
    try:
        redirecting["on"] = True
        ready = 'llmgw_router_endpoint_ready{endpoint="e"}'
        deadline = time.monotonic() + 10
        while r.metrics().get(ready) != 0.0 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.6)  # a few more probe rounds (every 0.2 s)
        assert other.asked == [], other.asked
        assert r.metrics().get(ready) == 0.0
    finally:
        r.stop()
        redirector.stop()
        other.stop()


def test_a_responses_event_nested_too_deeply_to_decode_is_relayed(tmp_path: Path) -> None:
    """llama-server's Responses streams are read to give their events indices
    (`llmgw.router.responses_stream`); an event nested past what the decoder takes is
    relayed as it came, and the stream goes on to its end, rather than being cut as a bug
    of the router's (an error logged, with its traceback, for every such request)."""

    def event(data: bytes) -> bytes:
        kind = data.split(b'"type":"', 1)[1].split(b'"', 1)[0]
        return b"event: " + kind + b"\ndata: " + data + b"\n\n"

    deep = event(b'{"type":"response.output_text.delta","item_id":"a","delta":'
                 + b"[" * 100_000 + b"]" * 100_000 + b"}")  # fmt: skip
    body = (
        event(b'{"type":"response.created","response":{}}')
        + event(b'{"type":"response.output_text.delta","item_id":"a","delta":"hi"}')
        + deep
        + event(
            b'{"type":"response.completed","response":{"usage":'
            b'{"input_tokens":3,"output_tokens":2}}}'
        )
    )

    async def responses(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=body, headers={"Content-Type": "text/event-stream"})

    app = engine_app(responses)
    app.router.add_post("/v1/responses", responses)
    llama = ThreadedApp(app)
    r = Router.start(tmp_path, {"e": llama.url}, models=[{"name": "m", "engine": "llamacpp"}])
    try:
        with httpx.Client(base_url=r.url, timeout=10) as h:
            got = h.post("/v1/responses", json={"model": "m", "input": "x", "stream": True})
        assert got.status_code == 200
        assert "relay_error" not in got.text, got.text[-300:]
        assert deep in got.content
        assert got.text.rstrip().endswith("}"), got.text[-300:]
        assert '"response.completed"' in got.text.rsplit("\n\n", 2)[-2]
    finally:
        r.stop()
        llama.stop()
    assert r.log_path is not None
    assert "relay_failed" not in r.log_path.read_text()


def test_an_engines_huge_metrics_page_does_not_stall_the_router(
    engine: CannedEngine, tmp_path: Path
) -> None:
    """The prober reads an engine's /metrics (up to 8 MiB) on the router's event loop, every
    probe round: 8 MiB of short lines took it half a second a round to read line by line,
    and every request to every model waited behind it. Only the lines of the figures the
    router uses are looked at now, found by searching the page for their names."""
    page = b"x 1\n" * (2 * 1024 * 1024 - 16)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=page, content_type="text/plain")

    app = engine_app(engine._chat)
    app.router.add_get("/metrics", metrics)
    hostile = ThreadedApp(app)
    engine.sse, engine.body = False, answer('{"prompt_tokens":1,"completion_tokens":1}')
    models = [{"name": "m"}, {"name": "other"}]
    serves = {"e": ["m"], "h": ["other"]}
    sites = {"e": hostile.url, "h": engine.url}
    r = Router.start(tmp_path, sites, models=models, endpoint_models=serves, probe_interval_s=0.5)
    slow: list[float] = []
    try:
        with httpx.Client(base_url=r.url, timeout=10) as h:
            until = time.monotonic() + 4  # 8 probe rounds
            while time.monotonic() < until:
                t = time.perf_counter()
                got = h.post("/v1/chat/completions", json={**CHAT, "model": "other"})
                took = time.perf_counter() - t
                assert got.status_code == 200, got.text
                if took > 0.25:
                    slow.append(took)
                time.sleep(0.005)
    finally:
        r.stop()
        hostile.stop()
    assert len(slow) <= 1, slow

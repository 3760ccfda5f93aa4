"""Router features beyond the must-shows: fallbacks, keep-alive comments, session affinity,
request ids upstream, several workers on one port. Real sims, real router processes."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
from aiohttp import web

from tests.integration.router_kit import Router, Sim
from tests.integration.test_router_sim import client, stream_text

pytestmark = pytest.mark.slow


class RecordingEngine:
    """A minimal OpenAI engine on its own thread and loop that records requests' headers
    and bodies."""

    def __init__(self) -> None:
        self.headers: list[dict[str, str]] = []
        self.bodies: list[dict[str, object]] = []
        self.url = ""
        started = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        started.wait(10)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)

        async def chat(request: web.Request) -> web.Response:
            self.headers.append(dict(request.headers))
            self.bodies.append(await request.json())
            message = {"role": "assistant", "content": "ok"}
            body = {
                "id": "x",
                "object": "chat.completion",
                "model": "m",
                "created": 0,
                "choices": [{"index": 0, "finish_reason": "stop", "message": message}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
            return web.json_response(body)

        async def health(_: web.Request) -> web.Response:
            return web.json_response({})

        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/health", health)
        runner = web.AppRunner(app, access_log=None)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        self.runner = runner
        started.set()
        self.loop.run_forever()

    def stop(self) -> None:
        async def down() -> None:
            await self.runner.cleanup()

        asyncio.run_coroutine_threadsafe(down(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_request_id_reaches_the_engine_and_comes_back(
    tmp_path: Path, procs: list[Sim | Router]
) -> None:
    engine = RecordingEngine()
    try:
        router = Router.start(tmp_path, {"e": engine.url})
        procs.append(router)
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        with httpx.Client(base_url=router.url) as h:
            r1 = h.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "abc-1"})
            r2 = h.post("/v1/chat/completions", json=body)
        assert r1.headers["X-Request-Id"] == "abc-1"
        generated = r2.headers["X-Request-Id"]
        assert generated
        seen = [{k.lower(): v for k, v in hs.items()} for hs in engine.headers]
        assert [hs["x-request-id"] for hs in seen] == ["abc-1", generated]
        assert all("authorization" not in hs for hs in seen)  # the client's key stays here
    finally:
        engine.stop()


def test_a_clients_scheduling_priority_never_reaches_the_engine(
    tmp_path: Path, procs: list[Sim | Router]
) -> None:
    """vLLM with `--scheduling-policy priority` (an engine option operators may set) serves
    a request by its body's `priority`, lowest first, preempting running ones: a tenant
    sending `"priority": -1000000` went ahead of every other key's requests on the engine,
    whatever their keys' priority classes. The router's queue decides who goes first; the
    member is not passed on, and the rest of the body is."""
    engine = RecordingEngine()
    try:
        router = Router.start(tmp_path, {"e": engine.url})
        procs.append(router)
        messages = [{"role": "user", "content": "priority"}]
        sent = [
            {"model": "m", "messages": messages, "priority": -1000000, "max_tokens": 3},
            {"priority": 5, "model": "m", "messages": messages, "stream": False},
            {"model": "m", "messages": messages, "metadata": {"priority": "kept"}},
        ]
        with httpx.Client(base_url=router.url) as h:
            for body in sent:
                assert h.post("/v1/chat/completions", json=body).status_code == 200
        assert engine.bodies == [
            {k: v for k, v in body.items() if k != "priority"} for body in sent
        ]
    finally:
        engine.stop()


def test_a_clients_trace_context_reaches_the_engine_and_a_forged_one_does_not(
    tmp_path: Path, procs: list[Sim | Router]
) -> None:
    """W3C traceparent / tracestate forwarded as received when valid (an engine that traces
    continues the client's trace); an invalid one, and its tracestate, not at all."""
    engine = RecordingEngine()
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    try:
        router = Router.start(tmp_path, {"e": engine.url})
        procs.append(router)
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        sent = [
            {"traceparent": parent, "tracestate": "vendor=abc,other=1"},
            {"traceparent": "00-" + "0" * 32 + "-00f067aa0ba902b7-01", "tracestate": "x=1"},
            {"traceparent": parent.upper()},
            {},
        ]
        with httpx.Client(base_url=router.url) as h:
            for headers in sent:
                assert h.post("/v1/chat/completions", json=body, headers=headers).status_code == 200
        seen = [{k.lower(): v for k, v in hs.items()} for hs in engine.headers]
        assert [(hs.get("traceparent"), hs.get("tracestate")) for hs in seen] == [
            (parent, "vendor=abc,other=1"),
            (None, None),
            (None, None),
            (None, None),
        ]
    finally:
        engine.stop()


async def test_a_failing_model_falls_back(tmp_path: Path, procs: list[Sim | Router]) -> None:
    big = Sim.start("big", "--eos-min-tokens", "3", "--eos-max-tokens", "3")
    small = Sim.start("small", "--eos-min-tokens", "3", "--eos-max-tokens", "3")
    procs += [big, small]
    big.faults(fail_status=503)
    router = Router.start(
        tmp_path,
        {"big-0": big, "small-0": small},
        models=[{"name": "big", "aliases": ["best"], "fallbacks": ["small"]}, {"name": "small"}],
        endpoint_models={"big-0": ["big"], "small-0": ["small"]},
    )
    procs.append(router)
    c = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    r = await c.chat.completions.create(model="best", messages=[{"role": "user", "content": "x"}])
    assert r.model == "small"
    assert r.choices[0].message.content
    m = router.metrics()
    assert m['llmgw_router_fallbacks_total{fallback="small",model="big"}'] == 1.0
    assert m['llmgw_router_retries_total{model="big",reason="status_503"}'] == 1.0
    await c.close()


async def test_keepalive_comments_before_the_first_token(
    tmp_path: Path, procs: list[Sim | Router]
) -> None:
    sim = Sim.start("m", "--eos-min-tokens", "3", "--eos-max-tokens", "3")
    procs.append(sim)
    sim.faults(stall_at="first_token", stall_s=1.0)
    router = Router.start(tmp_path, {"s": sim}, keepalive_s=0.2)
    procs.append(router)
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    async with httpx.AsyncClient(base_url=router.url, timeout=10) as h:
        r = await h.post("/v1/chat/completions", json=body)
    raw = r.content
    first_data = raw.index(b"data: ")
    assert raw[:first_data].count(b": keep-alive\n\n") >= 3
    assert raw.endswith(b"data: [DONE]\n\n")
    events = [json.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    # The SDK ignores the comments.
    sim.faults(stall_at="first_token", stall_s=0.5)
    c = client(router)
    text, ids = await stream_text(c)
    assert text
    assert len(ids) == 1
    await c.close()


async def test_session_header_keeps_a_conversation_on_one_engine(
    tmp_path: Path, procs: list[Sim | Router]
) -> None:
    sims = [Sim.start("m", "--eos-min-tokens", "2", "--eos-max-tokens", "2") for _ in range(3)]
    procs += sims
    router = Router.start(
        tmp_path, {f"s{i}": s for i, s in enumerate(sims)}, weights={"prefix": 0, "session": 5}
    )
    procs.append(router)
    c = openai.AsyncOpenAI(
        base_url=router.url + "/v1",
        api_key="x",
        max_retries=0,
        default_headers={"X-Session-Id": "conversation-42"},
    )
    for i in range(15):
        await c.chat.completions.create(model="m", messages=[{"role": "user", "content": f"t{i}"}])
    sent = router.endpoint_requests()
    assert sorted(sent.values()) == [15.0], sent
    await c.close()


async def test_two_workers_share_the_port_and_the_metrics(
    tmp_path: Path, procs: list[Sim | Router]
) -> None:
    sims = [Sim.start("m", "--eos-min-tokens", "2", "--eos-max-tokens", "2") for _ in range(2)]
    procs += sims
    router = Router.start(tmp_path, {f"s{i}": s for i, s in enumerate(sims)}, workers=2)
    procs.append(router)
    prefixes: set[str] = set()

    # Separate connections (no pooling) so the kernel spreads them over both workers;
    # 24 at a time, so that a busy machine's accept queue never drops a connect.
    room = asyncio.Semaphore(24)

    async def one(i: int) -> None:
        async with room, httpx.AsyncClient(base_url=router.url, timeout=60) as h:
            r = await h.post(
                "/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": f"w{i}"}]},
            )
            assert r.status_code == 200
            # Generated request ids start with a per-process prefix.
            prefixes.add(r.headers["X-Request-Id"].split("-")[0])

    await asyncio.gather(*(one(i) for i in range(120)))
    assert len(prefixes) == 2
    # One admin scrape reports both workers' requests (each publishes once a second).
    key = 'llmgw_router_requests_total{model="m",status="200"}'
    deadline = time.monotonic() + 30
    while router.metrics().get(key) != 120.0:
        assert time.monotonic() < deadline, router.metrics().get(key)
        await asyncio.sleep(0.2)


async def test_sighup_reloads_the_keys_file_in_every_worker(
    tmp_path: Path, procs: list[Sim | Router]
) -> None:
    from llmgw.router import auth

    sim = Sim.start("m", "--eos-min-tokens", "2", "--eos-max-tokens", "2")
    procs.append(sim)
    old, new = auth.new_key(), auth.new_key()
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n" + auth.entry_yaml("old", old))
    router = Router.start(tmp_path, {"s": sim}, workers=2, auth={"keys_file": str(keys)})
    procs.append(router)
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}

    async def statuses(key: str) -> set[int]:
        async def one() -> int:
            async with httpx.AsyncClient(base_url=router.url, timeout=10) as h:
                r = await h.post(
                    "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
                )
                return r.status_code

        return set(await asyncio.gather(*(one() for _ in range(16))))

    assert await statuses(new) == {401}
    keys.write_text("keys:\n" + auth.entry_yaml("new", new))
    router.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 5
    while await statuses(new) != {200}:
        assert time.monotonic() < deadline, "the new key was not accepted after SIGHUP"
        await asyncio.sleep(0.1)
    assert await statuses(old) == {401}
    # A broken file keeps the keys in force.
    keys.write_text("keys: [{name: broken}]\n")
    router.proc.send_signal(signal.SIGHUP)
    await asyncio.sleep(0.5)
    assert await statuses(new) == {200}


async def test_a_keys_rate_limit_holds_for_all_workers_together(
    tmp_path: Path, procs: list[Sim | Router]
) -> None:
    from llmgw.router import auth

    sim = Sim.start("m", "--eos-min-tokens", "2", "--eos-max-tokens", "2")
    procs.append(sim)
    key = auth.new_key()
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n" + auth.entry_yaml("k", key) + "    requests_per_s: 4\n")
    router = Router.start(tmp_path, {"s": sim}, workers=2, auth={"keys_file": str(keys)})
    procs.append(router)
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    auth_header = {"Authorization": f"Bearer {key}"}

    # One kept-alive connection reaches one worker: it still gets the key's whole burst
    # of 4 (a per-worker share would give it 2).
    async with httpx.AsyncClient(base_url=router.url, timeout=10) as h:
        t0 = time.monotonic()
        codes = [
            (await h.post("/v1/chat/completions", json=body, headers=auth_header)).status_code
            for _ in range(10)
        ]
        took = time.monotonic() - t0
    assert set(codes) <= {200, 429}
    assert 4 <= codes.count(200) <= 4 + 4 * took + 1, (codes, took)

    await asyncio.sleep(1.5)  # the bucket refills to its burst
    # Separate connections spread over both workers share that one budget.
    prefixes: set[str] = set()

    async def one() -> int:
        async with httpx.AsyncClient(base_url=router.url, timeout=10) as h:
            r = await h.post("/v1/chat/completions", json=body, headers=auth_header)
            prefixes.add(r.headers["X-Request-Id"].split("-")[0])
            return r.status_code

    t0 = time.monotonic()
    codes = list(await asyncio.gather(*(one() for _ in range(24))))
    took = time.monotonic() - t0
    assert len(prefixes) == 2, "both workers answered"
    assert set(codes) <= {200, 429}
    assert 4 <= codes.count(200) <= 4 + 4 * took + 1, (codes, took)


async def test_an_engine_restarted_on_its_port_is_used_again(
    tmp_path: Path, procs: list[Sim | Router]
) -> None:
    """Kept-alive upstream connections to the old process are dropped, not reused."""
    import socket as socket_mod

    with socket_mod.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ("--eos-min-tokens", "2", "--eos-max-tokens", "2")
    first = Sim.start("m", "--port", str(port), *args)
    router = Router.start(tmp_path, {"s": first})
    procs.append(router)
    c = client(router)
    for _ in range(5):
        assert (await stream_text(c))[0]
    first.stop()
    second = Sim.start("m", "--port", str(port), *args)
    procs.append(second)
    deadline = time.monotonic() + 10
    outcomes: list[int] = []
    while outcomes[-5:] != [200] * 5 and time.monotonic() < deadline:
        try:
            await stream_text(c)
            outcomes.append(200)
        except openai.APIStatusError as exc:
            outcomes.append(exc.status_code)
            await asyncio.sleep(0.1)
    # At most a 503 while the prober has not yet seen the new process, then only 200s.
    assert outcomes[-5:] == [200] * 5, outcomes
    assert set(outcomes) <= {200, 503}, outcomes
    assert 503 not in outcomes[outcomes.index(200) :], outcomes
    await c.close()


async def test_breaker_opens_on_5xx_and_a_half_open_probe_closes_it(
    tmp_path: Path, procs: list[Sim | Router]
) -> None:
    good, bad = (Sim.start("m", "--eos-min-tokens", "2", "--eos-max-tokens", "2") for _ in "ab")
    procs += [good, bad]
    bad.faults(fail_status=500)
    router = Router.start(
        tmp_path, {"good": good, "bad": bad}, breaker={"failures_to_open": 2, "open_s": 1.0}
    )
    procs.append(router)
    c = client(router)
    state = 'llmgw_router_breaker_state{endpoint="bad"}'
    for _ in range(6):  # every request succeeds: a 500 before the first byte moves on
        assert (await stream_text(c))[0]
    assert router.metrics()[state] == 2.0  # open
    sent = router.endpoint_requests()["bad"]
    for _ in range(4):
        assert (await stream_text(c))[0]
    assert router.endpoint_requests()["bad"] == sent  # open: nothing sent there
    bad.clear_faults()
    await asyncio.sleep(1.1)  # the cool-down passes; the next request probes
    for _ in range(4):
        assert (await stream_text(c))[0]
    assert router.metrics()[state] == 0.0  # the probe succeeded: closed
    assert router.endpoint_requests()["bad"] > sent
    await c.close()

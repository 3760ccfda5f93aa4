"""The router's must-shows, against real `llmgw sim` processes with the real `openai` SDK.

Every test starts its own sims and its own `llmgw router` subprocess on free
ports. Timings are kept short (small deadlines, few tokens) so the file runs in
well under a minute or two on two shared cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from tests.integration.router_kit import Router, Sim

pytestmark = pytest.mark.slow


@pytest.fixture
def sims() -> Iterator[list[Sim]]:
    started: list[Sim] = []
    yield started
    for s in started:
        s.stop()


def start_sims(into: list[Sim], n: int, *args: str) -> list[Sim]:
    new = [Sim.start("m", *args) for _ in range(n)]
    into.extend(new)
    return new


@pytest.fixture
def routers() -> Iterator[list[Router]]:
    started: list[Router] = []
    yield started
    for r in started:
        r.stop()


def client(
    router: Router, *, key: str = "none", connections: int = 100, timeout_s: float = 30
) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=router.url + "/v1",
        api_key=key,
        max_retries=0,
        timeout=timeout_s,
        http_client=httpx.AsyncClient(
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
            timeout=timeout_s,
        ),
    )


async def stream_text(
    c: openai.AsyncOpenAI, prompt: str = "hello", **kw: object
) -> tuple[str, set[str]]:
    """The streamed text and the set of chunk ids (one id: one engine's answer)."""
    out = []
    ids = set()
    stream = await c.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": prompt}],
        stream=True,
        **kw,  # type: ignore[call-overload]
    )
    async for chunk in stream:
        ids.add(chunk.id)
        if chunk.choices and chunk.choices[0].delta.content:
            out.append(chunk.choices[0].delta.content)
    return "".join(out), ids


async def wait_idle(sims: list[Sim], within: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + within
    while True:
        totals = {"running": 0.0, "waiting": 0.0, "kv": 0.0}
        for s in sims:
            m = s.metrics()
            totals["running"] += m.get("vllm:num_requests_running", 0)
            totals["waiting"] += m.get("vllm:num_requests_waiting", 0)
            totals["kv"] += m.get("vllm:kv_cache_usage_perc", 0)
        if not any(totals.values()) or time.monotonic() > deadline:
            return totals
        await asyncio.sleep(0.1)


async def test_1000_concurrent_streams_over_3_sims_and_disconnects_free_kv(
    tmp_path: Path, sims: list[Sim], routers: list[Router]
) -> None:
    three = start_sims(sims, 3, "--eos-min-tokens", "8", "--eos-max-tokens", "16")
    # A thousand connects at once on a busy machine can take longer than the default 2 s
    # connect deadline; what is tested here is the relay, not that deadline.
    patient = [{"name": "m", "deadlines": {"connect_s": 30.0}}]
    router = Router.start(tmp_path, {f"s{i}": s for i, s in enumerate(three)}, models=patient)
    routers.append(router)
    # The openai SDK reports a read that outwaits its timeout as a connection error: a
    # thousand streams on a machine busy with other tests can wait beyond 30 s for bytes.
    c = client(router, connections=1000, timeout_s=180)

    results = await asyncio.gather(*(stream_text(c, f"prompt {i}") for i in range(1000)))
    assert all(text and len(ids) == 1 for text, ids in results)
    sent = router.endpoint_requests()
    assert sum(sent.values()) == 1000
    assert all(v > 150 for v in sent.values()), sent  # spread over all three
    assert await wait_idle(three) == {"running": 0.0, "waiting": 0.0, "kv": 0.0}

    # Disconnects: long answers on slow engines, dropped by the client after two chunks.
    slow = start_sims(sims, 3, "--decode-base-ms", "20", "--eos-min-tokens", "2000",
                      "--eos-max-tokens", "3000")  # fmt: skip
    router2 = Router.start(tmp_path, {f"d{i}": s for i, s in enumerate(slow)})
    routers.append(router2)
    c2 = client(router2, connections=300)

    async def drop_early(i: int) -> None:
        stream = await c2.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"long {i}"}], stream=True
        )
        n = 0
        async for _ in stream:
            n += 1
            if n == 2:
                break
        await stream.close()

    await asyncio.gather(*(drop_early(i) for i in range(300)))
    busy_before = sum(s.metrics().get("vllm:generation_tokens_total", 0) for s in slow)
    assert busy_before > 0
    # Without cancellation these would run for 40+ s; freed, the engines idle at once.
    assert await wait_idle(slow, within=5.0) == {"running": 0.0, "waiting": 0.0, "kv": 0.0}
    await c.close()
    await c2.close()


async def test_killed_engine_before_first_byte_moves_and_mid_stream_gets_error_event(
    tmp_path: Path, sims: list[Sim], routers: list[Router]
) -> None:
    a, b, victim = start_sims(sims, 3, "--eos-min-tokens", "4", "--eos-max-tokens", "8")
    router = Router.start(
        tmp_path,
        {"a": a, "b": b, "victim": victim},
        breaker={"failures_to_open": 2, "open_s": 30},
        probe_interval_s=60,  # the dispatch loop, not the prober, must notice the death
    )
    routers.append(router)
    c = client(router)
    victim.kill()
    results = await asyncio.gather(*(stream_text(c, f"p{i}") for i in range(60)))
    assert all(text for text, _ in results)
    m = router.metrics()
    assert m.get('llmgw_router_retries_total{model="m",reason="connect_error"}', 0) >= 1
    # The first wave went out concurrently before any failure came back; once the
    # breaker is open, the dead engine gets nothing more.
    assert m['llmgw_router_breaker_state{endpoint="victim"}'] == 2.0
    sent_to_victim = router.endpoint_requests()["victim"]
    for i in range(20):
        assert (await stream_text(c, f"after {i}"))[0]
    assert router.endpoint_requests()["victim"] == sent_to_victim

    # A stream cut mid-way: the client gets the first tokens, then an error — never a
    # second engine's answer glued on.
    for s in (a, b):
        s.faults(die_mid_stream=True, after_tokens=3, count=1)
    got: list[str] = []
    ids: set[str] = set()

    async def read_cut() -> None:
        stream = await c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "cut"}], stream=True
        )
        async for chunk in stream:
            ids.add(chunk.id)
            if chunk.choices and chunk.choices[0].delta.content:
                got.append(chunk.choices[0].delta.content)

    with pytest.raises(openai.APIError) as err:
        await read_cut()
    assert "broke off" in str(err.value) or "ended the stream" in str(err.value)
    assert len(ids) == 1
    assert 1 <= len(got) <= 3
    await c.close()


async def test_engine_killed_mid_stream_gives_those_clients_an_error_event(
    tmp_path: Path, sims: list[Sim], routers: list[Router]
) -> None:
    slow = start_sims(sims, 2, "--decode-base-ms", "20", "--eos-min-tokens", "100",
                      "--eos-max-tokens", "100")  # fmt: skip
    router = Router.start(tmp_path, {"a": slow[0], "b": slow[1]})
    routers.append(router)
    c = client(router)
    tasks = [asyncio.create_task(stream_text(c, f"k{i}")) for i in range(20)]
    await asyncio.sleep(0.8)  # every stream is mid-way (100 tokens take 2 s)
    slow[1].kill()
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
    errors = [r for r in results if isinstance(r, BaseException)]
    done = [r for r in results if not isinstance(r, BaseException)]
    assert errors
    assert done
    assert all(isinstance(e, openai.APIError) for e in errors), errors
    assert all(len(ids) == 1 for _, ids in done)
    assert len(errors) + len(done) == 20
    await c.close()


class HalfDeadEngine:
    """Answers the router's first health and metrics probes, then stops accepting
    connections; once its accept queue is full, connection attempts hang (SYNs dropped)."""

    def __init__(self) -> None:
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(0)
        self.url = f"http://127.0.0.1:{self.srv.getsockname()[1]}"
        self.fillers: list[socket.socket] = []
        self.thread = threading.Thread(target=self._answer_probes, daemon=True)
        self.thread.start()

    def _answer_probes(self) -> None:
        for _ in range(2):  # /health, then /metrics
            conn, _ = self.srv.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    def stall(self) -> None:
        self.thread.join(5)
        for _ in range(4):
            f = socket.socket()
            f.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                f.connect(self.srv.getsockname())
            self.fillers.append(f)

    def close(self) -> None:
        for f in self.fillers:
            f.close()
        self.srv.close()


@pytest.mark.parametrize("phase", ["connect", "headers", "first_token", "mid_stream", "total"])
async def test_each_deadline_fires_against_a_stalled_engine(
    tmp_path: Path, sims: list[Sim], routers: list[Router], phase: str
) -> None:
    deadlines = {"connect_s": 0.3, "headers_s": 0.5, "first_token_s": 0.5, "idle_s": 0.5,
                 "total_s": 30}  # fmt: skip
    half_dead: HalfDeadEngine | None = None
    args = ["--eos-min-tokens", "20", "--eos-max-tokens", "20"]
    if phase == "total":
        deadlines["total_s"] = 1.0
        args += ["--decode-base-ms", "200"]
    if phase == "connect":
        half_dead = HalfDeadEngine()
        target: Sim | str = half_dead.url
    else:
        (sim,) = start_sims(sims, 1, *args)
        if phase != "total":
            sim.faults(stall_at=phase, stall_s=20, after_tokens=2)
        target = sim
    router = Router.start(
        tmp_path,
        {"only": target},
        models=[{"name": "m", "deadlines": deadlines}],
        probe_interval_s=60,
    )
    routers.append(router)
    if half_dead is not None:
        half_dead.stall()
    c = client(router)
    t0 = time.monotonic()
    try:
        if phase in ("connect", "headers", "first_token"):
            with pytest.raises(openai.APIStatusError) as err:
                await stream_text(c, "stall")
            assert err.value.status_code == 504
            assert time.monotonic() - t0 < 5
            expected = {"connect": "connect_timeout", "headers": "headers_timeout",
                        "first_token": "first_token_timeout"}[phase]  # fmt: skip
            assert err.value.body["code"] == expected  # type: ignore[index]
        else:
            with pytest.raises(openai.APIError) as err2:
                await stream_text(c, "stall")
            code = "idle_timeout" if phase == "mid_stream" else "total_timeout"
            assert code in str(err2.value.body) or code in str(err2.value)
            assert time.monotonic() - t0 < 5
    finally:
        if half_dead is not None:
            half_dead.close()
        await c.close()


async def test_prefix_affinity_concentrates_and_weight_zero_spreads(
    tmp_path: Path, sims: list[Sim], routers: list[Router]
) -> None:
    three = start_sims(sims, 3, "--eos-min-tokens", "4", "--eos-max-tokens", "4")
    shared = "You are a careful assistant. " * 200  # ~5,800 characters of shared prefix

    async def run(router: Router) -> dict[str, float]:
        c = client(router)
        for i in range(24):
            await stream_text(c, shared + f" question {i}")
        await c.close()
        return router.endpoint_requests()

    before = [s.metrics().get("vllm:prompt_tokens_cached_total", 0) for s in three]
    affine = Router.start(tmp_path, {f"s{i}": s for i, s in enumerate(three)})
    routers.append(affine)
    sent = await run(affine)
    assert max(sent.values()) == 24, sent
    winner = max(sent, key=lambda k: sent[k])
    idx = int(winner[1:])
    cached = [
        s.metrics().get("vllm:prompt_tokens_cached_total", 0) - b
        for s, b in zip(three, before, strict=True)
    ]
    assert cached[idx] > 23 * 1000, cached  # each repeat hit the engine's prefix cache

    spread = Router.start(
        tmp_path, {f"s{i}": s for i, s in enumerate(three)}, weights={"prefix": 0}
    )
    routers.append(spread)
    sent0 = await run(spread)
    assert max(sent0.values()) < 24, sent0
    assert len([v for v in sent0.values() if v > 0]) >= 2


async def test_an_engine_with_a_deep_queue_gets_fewer_requests(
    tmp_path: Path, sims: list[Sim], routers: list[Router]
) -> None:
    deep, ok1, ok2 = start_sims(
        sims, 3, "--max-num-seqs", "1", "--decode-base-ms", "50", "--eos-min-tokens", "100",
        "--eos-max-tokens", "100",
    )  # fmt: skip
    # Fill one engine's queue directly, behind the router's back.
    filler = openai.AsyncOpenAI(base_url=deep.url + "/v1", api_key="x", max_retries=0)
    fill = [
        asyncio.create_task(
            filler.chat.completions.create(model="m", messages=[{"role": "user", "content": "f"}])
        )
        for _ in range(12)
    ]
    await asyncio.sleep(0.5)
    router = Router.start(tmp_path, {"deep": deep, "ok1": ok1, "ok2": ok2}, weights={"queue": 3})
    routers.append(router)
    await asyncio.sleep(0.5)  # a probe round sees the queue
    c = client(router)
    await asyncio.gather(
        *(
            c.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=2
            )
            for i in range(30)
        )
    )
    sent = router.endpoint_requests()
    assert sent.get("deep", 0) < min(sent["ok1"], sent["ok2"]), sent
    assert sent.get("deep", 0) <= 3, sent
    for t in fill:
        t.cancel()
    await asyncio.gather(*fill, return_exceptions=True)
    await filler.close()
    await c.close()


async def test_keys_401_401_404_429(tmp_path: Path, sims: list[Sim], routers: list[Router]) -> None:
    from llmgw.router import auth

    (sim,) = start_sims(
        sims, 1, "--served-model-name", "other", "--eos-min-tokens", "2", "--eos-max-tokens", "2"
    )
    good, limited, thrifty = auth.new_key(), auth.new_key(), auth.new_key()
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        "keys:\n"
        + auth.entry_yaml("good", good, ("m",))
        + auth.entry_yaml("limited", limited, ("*",))
        + "    requests_per_s: 2\n"
        + auth.entry_yaml("thrifty", thrifty, ("m",))
        + "    tokens_per_min: 5\n"
    )
    router = Router.start(
        tmp_path,
        {"s": sim},
        models=[{"name": "m"}, {"name": "other"}],
        endpoint_models={"s": ["m", "other"]},
        auth={"keys_file": str(keys)},
        log_level="debug",  # with the access log: a line per request
    )
    routers.append(router)
    async with httpx.AsyncClient() as h:
        r = await h.post(router.url + "/v1/chat/completions", json={"model": "m", "messages": []})
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "missing_api_key"

    async def ask(key: str, model: str = "m") -> None:
        c = client(router, key=key)
        try:
            await c.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "x"}]
            )
        finally:
            await c.close()

    with pytest.raises(openai.AuthenticationError):
        await ask("wrong-key")
    await ask(good)
    with pytest.raises(openai.NotFoundError):  # as a model that does not exist
        await ask(good, "other")

    async def burst() -> None:
        for _ in range(5):
            await ask(limited, "other")

    with pytest.raises(openai.RateLimitError):
        await burst()
    # Tokens are counted from the engine's usage (streams included): the first answer
    # spends more than 5 tokens, the next request is refused until the bucket refills.
    tc = client(router, key=thrifty)
    assert (await stream_text(tc, "spend"))[0]
    with pytest.raises(openai.RateLimitError) as over:
        await tc.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert over.value.body["code"] == "tokens_exceeded"  # type: ignore[index]
    await tc.close()
    log = (tmp_path / "router-0.log").read_text()
    assert "worker_started" in log  # the router's own log, read whole
    access = [json.loads(line) for line in log.splitlines() if '"event": "request"' in line]
    assert {a["status"] for a in access} >= {200, 401, 404, 429}
    for key in (good, limited, thrifty):
        assert key not in log


async def test_time_to_first_token_over_a_reused_connection(
    tmp_path: Path, sims: list[Sim], routers: list[Router]
) -> None:
    """Nagle + delayed ACK would add ~40 ms per request on a kept-alive connection."""
    (sim,) = start_sims(sims, 1, "--eos-min-tokens", "4", "--eos-max-tokens", "4")
    router = Router.start(tmp_path, {"s": sim})
    routers.append(router)
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    ttfts = []
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=1)) as h:
        for _ in range(30):
            t0 = time.perf_counter()
            async with h.stream("POST", router.url + "/v1/chat/completions", json=body) as r:
                raw = r.aiter_raw()
                await raw.__anext__()
                ttfts.append(time.perf_counter() - t0)
                async for _chunk in raw:
                    pass
    ttfts.sort()
    assert ttfts[len(ttfts) // 2] < 0.02, ttfts


async def test_a_client_that_gives_up_on_a_whole_answer_frees_the_engine(
    tmp_path: Path, sims: list[Sim], routers: list[Router]
) -> None:
    """Not streamed, the router writes nothing to the client until the engine is done: only
    the client's disconnect itself (aiohttp's handler cancellation) tells the router to
    close the engine's connection, which frees it rather than generating for a minute."""
    (slow,) = start_sims(sims, 1, "--decode-base-ms", "20", "--eos-min-tokens", "2000",
                         "--eos-max-tokens", "3000")  # fmt: skip
    router = Router.start(tmp_path, {"d0": slow})
    routers.append(router)

    def generating() -> bool:
        return slow.metrics().get("vllm:generation_tokens_total", 0) > 0

    c = client(router, timeout_s=120)
    asked = asyncio.create_task(c.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "long"}], max_tokens=3000
    ))  # fmt: skip
    deadline = time.monotonic() + 30
    while not generating():
        assert time.monotonic() < deadline, "the engine never began the answer"
        await asyncio.sleep(0.05)
    asked.cancel()  # the SDK closes its connection
    with contextlib.suppress(asyncio.CancelledError):
        await asked
    await c.close()
    # 2000 tokens at 20 ms each would keep it busy for 40 s and more.
    assert await wait_idle([slow], within=5.0) == {"running": 0.0, "waiting": 0.0, "kv": 0.0}

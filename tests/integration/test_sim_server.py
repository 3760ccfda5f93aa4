"""`llmgw sim` as a real subprocess, spoken to by the real `openai` SDK and raw HTTP.

Covers the issue's must-shows: the SDK gets completions, chat, streams with
usage, the model list and embeddings; prefix caching (cached tokens, sooner first
token, LRU eviction, chained hashes); queueing with the waiting gauge; cancelled
streams leave zero blocks in use; the metrics parse; faults on demand; SIGTERM.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import math
import os
import random
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmgw.core import simtokens as tokens
from llmgw.sim.testing import SimProcess

MODEL = "sim"


def metric(sim: SimProcess, name: str, **labels: str) -> float:
    """One sample's value from /metrics (parsed by prometheus_client's own parser)."""
    return sample(sim.metrics_text(), name, **labels)


def sample(text: str, name: str, **labels: str) -> float:
    """One sample's value from a /metrics page already read (several from one page agree)."""
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise AssertionError(f"{name} {labels} not in /metrics")


def client(sim: SimProcess, **kw: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0, **kw)  # type: ignore[arg-type]


def aclient(sim: SimProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    with SimProcess.start(
        "--served-model-name", "sim-alias", "--max-model-len", "512", "--num-blocks", "256",
        model=MODEL,
    ) as s:  # fmt: skip
        yield s


# --- the OpenAI SDK -------------------------------------------------------------------


def test_sdk_text_completion(sim: SimProcess) -> None:
    out = client(sim).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=7)
    assert out.object == "text_completion"
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None
    assert out.usage.completion_tokens == 7
    assert out.usage.prompt_tokens == 4
    assert out.choices[0].text.strip()


def test_sdk_chat_completion_and_alias(sim: SimProcess) -> None:
    out = client(sim).chat.completions.create(
        model="sim-alias",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_completion_tokens=5,
        seed=42,
    )
    assert out.model == "sim-alias"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content
    assert out.usage is not None
    assert out.usage.completion_tokens == 5
    assert out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens is not None


def test_sdk_stream_with_usage_matches_the_unstreamed_text(sim: SimProcess) -> None:
    c = client(sim)
    messages = [{"role": "user", "content": "Tell me something deterministic."}]
    whole = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, seed=7)  # type: ignore[arg-type]
    stream = c.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=12,
        seed=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    content_chunks = [ch for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(content_chunks) == 12  # one chunk per token


def test_sdk_streamed_completion_with_stop(sim: SimProcess) -> None:
    c = client(sim)
    probe = c.completions.create(model=MODEL, prompt="x", max_tokens=20, seed=3)
    words = probe.choices[0].text.split(" ")
    stop = " " + words[4]  # words[0] is "" (the text starts with a space)
    stream = c.completions.create(
        model=MODEL, prompt="x", max_tokens=20, seed=3, stop=[stop], stream=True
    )
    chunks = list(stream)
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert stop not in text
    assert text == probe.choices[0].text[: probe.choices[0].text.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_sdk_model_list(sim: SimProcess) -> None:
    ids = [m.id for m in client(sim).models.list()]
    assert ids == [MODEL, "sim-alias"]
    one = client(sim).models.retrieve("sim-alias")
    assert (one.id, one.owned_by) == ("sim-alias", "llmgw-sim")
    with pytest.raises(openai.NotFoundError):
        client(sim).models.retrieve("gpt-nothing")


def test_sdk_embeddings_are_deterministic_unit_vectors(sim: SimProcess) -> None:
    c = client(sim)
    out = c.embeddings.create(model=MODEL, input=["hello world", "goodbye"])
    assert [d.index for d in out.data] == [0, 1]
    v0, v1 = out.data[0].embedding, out.data[1].embedding
    assert len(v0) == 256
    assert math.isclose(sum(x * x for x in v0), 1.0, rel_tol=1e-9)
    assert v0 != v1
    again = c.embeddings.create(model=MODEL, input="hello world", dimensions=64)
    assert len(again.data[0].embedding) == 64
    assert out.usage.prompt_tokens == tokens.count("hello world") + tokens.count("goodbye")
    # base64 carries the same vector as little-endian float32.
    raw = c.embeddings.create(model=MODEL, input="hello world", encoding_format="base64")
    packed = raw.data[0].embedding
    if isinstance(packed, str):
        floats = struct.unpack("<256f", base64.b64decode(packed))
    else:  # an SDK that decodes base64 itself
        floats = tuple(packed)
    assert all(
        math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-7) for a, b in zip(floats, v0, strict=True)
    )


def test_sdk_sees_openai_errors(sim: SimProcess) -> None:
    c = client(sim)
    with pytest.raises(openai.NotFoundError) as nf:
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert "sim" in nf.value.message
    with pytest.raises(openai.BadRequestError) as long:
        c.completions.create(model=MODEL, prompt="word " * 600, max_tokens=1)
    assert long.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as big:
        c.completions.create(model=MODEL, prompt="hi", max_tokens=10_000)
    assert big.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as n2:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=2)
    assert "not supported" in n2.value.message
    with pytest.raises(openai.BadRequestError) as tools:
        c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        )
    assert tools.value.code == "unsupported_parameter"


async def test_raw_http_errors_are_openai_shaped(sim: SimProcess) -> None:
    async with aiohttp.ClientSession() as http:
        cases = [
            ("POST", "/v1/chat/completions", b"{not json", 400),
            ("POST", "/v1/chat/completions", b"", 400),
            ("POST", "/v1/chat/completions", b'{"messages": []}', 404),  # no model
            ("POST", "/v1/completions", b'{"model": "sim", "prompt": []}', 400),
            ("POST", "/v1/embeddings", b'{"model": "sim", "input": ""}', 400),
            ("GET", "/v1/chat/completions", b"", 405),
            ("GET", "/v2/nothing", b"", 404),
        ]
        for method, path, body, status in cases:
            async with http.request(method, sim.url + path, data=body) as r:
                assert r.status == status, (path, body, await r.text())
                err = (await r.json())["error"]
                assert isinstance(err["message"], str)
                assert err["message"]
                assert set(err) == {"message", "type", "param", "code"}


# --- metrics ------------------------------------------------------------------------------


def test_metrics_parse_with_vllm_names_and_agree_with_usage(sim: SimProcess) -> None:
    before_p = metric(sim, "vllm:prompt_tokens_total", model_name=MODEL)
    before_g = metric(sim, "vllm:generation_tokens_total", model_name=MODEL)
    c = client(sim)
    prompt = completion = 0
    for i in range(5):
        out = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"question {i}"}], max_tokens=3 + i
        )
        assert out.usage is not None
        prompt += out.usage.prompt_tokens
        completion += out.usage.completion_tokens
    assert metric(sim, "vllm:prompt_tokens_total", model_name=MODEL) - before_p == prompt
    assert metric(sim, "vllm:generation_tokens_total", model_name=MODEL) - before_g == completion

    families = {f.name: f for f in text_string_to_metric_families(sim.metrics_text())}
    for name, kind in {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_time_per_output_token_seconds": "histogram",
    }.items():
        assert families[name].type == kind, name
        assert all(s.labels.get("model_name") == MODEL for s in families[name].samples), name
    for gone in ("vllm:gpu_cache_usage_perc", "vllm:time_per_output_token_seconds"):
        assert gone not in families
    assert metric(sim, "vllm:request_success_total", finished_reason="length") >= 5
    assert metric(sim, "vllm:e2e_request_latency_seconds_count") >= 5


# --- prefix cache ------------------------------------------------------------------------


async def _ttft(c: openai.AsyncOpenAI, prompt: str) -> tuple[float, int]:
    """Seconds to the first token and the cached prompt tokens of one streamed completion."""
    t0 = time.perf_counter()
    first = None
    cached = -1
    stream = await c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    async for ch in stream:
        if first is None and ch.choices and ch.choices[0].text:
            first = time.perf_counter() - t0
        if ch.usage is not None and ch.usage.prompt_tokens_details is not None:
            cached = ch.usage.prompt_tokens_details.cached_tokens or 0
    assert first is not None
    return first, cached


async def test_repeated_long_prompt_is_cached_and_reaches_its_first_token_sooner() -> None:
    # 1 ms per uncached prompt token: a 400-token prompt costs 0.4 s of prefill.
    with SimProcess.start("--prefill-per-token-ms", "1", "--max-model-len", "1024") as s:
        c = aclient(s)
        text = " ".join(f"w{i}" for i in range(400))
        cold, cached0 = await _ttft(c, text)
        warm, cached1 = await _ttft(c, text)
        assert cached0 == 0
        assert cached1 >= 384  # all full blocks of 16 but the last token's
        assert cold >= 0.35
        assert warm < cold / 3
        # A different first block: nothing after it can hit, though every later block matches.
        other, cached2 = await _ttft(c, "X" + text[2:])
        assert cached2 == 0
        assert other >= 0.35
        assert metric(s, "vllm:prefix_cache_hits_total") == cached1
        await c.close()


async def test_lru_evicts_cached_prefixes_under_pressure() -> None:
    # 64 blocks of 16 = 1024 token slots.
    with SimProcess.start("--num-blocks", "64", "--max-model-len", "1024") as s:
        c = aclient(s)
        old = " ".join(f"old{i}" for i in range(300))
        _, first = await _ttft(c, old)
        _, hit = await _ttft(c, old)
        assert (first, hit) == (0, 288)
        for k in range(3):  # unrelated prompts that together need every block
            await _ttft(c, " ".join(f"n{k}x{i}" for i in range(700)))
        _, after = await _ttft(c, old)
        assert after == 0
        assert s.get_json("/sim/state")["evictions"] > 0
        # vLLM's /reset_prefix_cache forgets what nobody holds.
        _, hit_again = await _ttft(c, old)
        assert hit_again == 288
        async with aiohttp.ClientSession() as http, http.post(s.url + "/reset_prefix_cache") as r:
            assert r.status == 200
        _, reset = await _ttft(c, old)
        assert reset == 0
        assert s.get_json("/sim/state")["blocks_used"] == 0
        await c.close()


async def test_headers_come_at_once_and_the_first_token_after_prefill() -> None:
    with SimProcess.start("--prefill-per-token-ms", "1") as s:
        async with aiohttp.ClientSession() as http:
            payload = {"model": MODEL, "prompt": "w " * 400, "max_tokens": 2, "stream": True}
            t0 = time.perf_counter()
            async with http.post(s.url + "/v1/completions", json=payload) as r:
                headers_at = time.perf_counter() - t0
                first = await r.content.readline()
                first_at = time.perf_counter() - t0
        assert first.startswith(b"data: {")
        assert headers_at < 0.2
        assert first_at >= 0.38  # 400 uncached tokens at 1 ms


# --- queueing and cancellation ---------------------------------------------------------


async def test_requests_wait_for_blocks_and_complete_when_they_free() -> None:
    # 16 blocks of 16 tokens; each request needs 10+ blocks, so only one runs at a time.
    with SimProcess.start(
        "--num-blocks", "16", "--max-model-len", "256", "--decode-base-ms", "20",
        "--eos-min-tokens", "1000", "--eos-max-tokens", "1000",
    ) as s:  # fmt: skip
        c = aclient(s)
        prompt = " ".join(f"q{i}" for i in range(150))

        async def one(tag: str, max_tokens: int) -> tuple[str, float]:
            out = await c.completions.create(
                model=MODEL, prompt=tag + prompt, max_tokens=max_tokens
            )
            return out.choices[0].finish_reason, time.perf_counter()

        # The first runs 2 s (100 steps of 20 ms): the second is seen waiting within it
        # however busy the machine; each look is one /metrics page, whose figures agree.
        first = asyncio.create_task(one("a", 100))
        await asyncio.sleep(0.1)
        second = asyncio.create_task(one("b", 40))
        waited = False
        for _ in range(100):
            await asyncio.sleep(0.02)
            page = s.metrics_text()
            if sample(page, "vllm:num_requests_waiting") == 1:
                assert sample(page, "vllm:num_requests_running") == 1
                assert sample(page, "vllm:kv_cache_usage_perc") > 0.6
                waited = True
                break
        assert waited, "the second request never showed as waiting"
        (r1, t1), (r2, t2) = await asyncio.gather(first, second)
        assert (r1, r2) == ("length", "length")
        assert t2 - t1 >= 0.6  # it ran after the first freed its blocks: 40 steps of 20 ms
        assert metric(s, "vllm:num_requests_waiting") == 0
        assert metric(s, "vllm:kv_cache_usage_perc") == 0
        await c.close()


async def test_100_streams_cancelled_at_random_points_leave_zero_blocks_in_use() -> None:
    with SimProcess.start(
        "--decode-base-ms", "5", "--max-num-seqs", "64", "--num-blocks", "2048",
        "--eos-min-tokens", "5000", "--eos-max-tokens", "5000", "--max-model-len", "8192",
    ) as s:  # fmt: skip
        rng = random.Random(1234)
        body = {"model": MODEL, "stream": True, "max_tokens": 2000}
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as http:

            async def stream(i: int) -> int:
                payload = {
                    **body,
                    "messages": [{"role": "user", "content": f"{i} " * rng.randint(1, 300)}],
                }
                stop_after = rng.randint(0, 40)  # 0: gone before the first token
                got = 0
                resp = await http.post(s.url + "/v1/chat/completions", json=payload)
                try:
                    async for _line in resp.content:
                        if got >= stop_after:
                            break
                        got += 1
                finally:
                    resp.close()  # drops the connection mid-stream
                return got

            seen = await asyncio.gather(*(stream(i) for i in range(100)))
            assert max(seen) > 10
            assert min(seen) == 0
            for _ in range(100):
                if (
                    metric(s, "vllm:num_requests_running") == 0
                    and metric(s, "vllm:num_requests_waiting") == 0
                ):
                    break
                await asyncio.sleep(0.02)
            assert metric(s, "vllm:num_requests_running") == 0
            assert metric(s, "vllm:num_requests_waiting") == 0
            assert metric(s, "vllm:kv_cache_usage_perc") == 0.0
            assert metric(s, "vllm:request_success_total", finished_reason="abort") == 100
            assert s.get_json("/sim/state")["blocks_used"] == 0
        # Clients leaving are routine for an engine: no tracebacks in its log.
        assert "Traceback" not in s.stderr_text()


async def test_an_unstreamed_request_whose_client_gives_up_is_dropped_at_once() -> None:
    with SimProcess.start("--decode-base-ms", "10", "--eos-min-tokens", "5000",
                          "--eos-max-tokens", "5000", "--max-model-len", "8192") as s:  # fmt: skip
        timeout = aiohttp.ClientTimeout(total=0.3)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            payload = {"model": MODEL, "prompt": "x " * 100, "max_tokens": 3000}
            jobs = [http.post(s.url + "/v1/completions", json=payload) for _ in range(5)]
            results = await asyncio.gather(*jobs, return_exceptions=True)
        assert all(isinstance(r, asyncio.TimeoutError) for r in results), results
        for _ in range(50):
            if metric(s, "vllm:num_requests_running") == 0:
                break
            await asyncio.sleep(0.02)
        assert metric(s, "vllm:num_requests_running") == 0
        assert metric(s, "vllm:kv_cache_usage_perc") == 0.0
        assert metric(s, "vllm:request_success_total", finished_reason="abort") == 5


# --- faults ---------------------------------------------------------------------------------


async def _chunks(
    http: aiohttp.ClientSession, url: str, max_tokens: int = 6
) -> tuple[list[float], list[bytes], BaseException | None]:
    """Arrival times (from the request) and bodies of SSE events, and how the stream ended."""
    t0 = time.perf_counter()
    times: list[float] = []
    events: list[bytes] = []
    payload = {"model": MODEL, "prompt": "hi", "max_tokens": max_tokens, "stream": True}
    try:
        async with http.post(url + "/v1/completions", json=payload) as r:
            assert r.status == 200
            times.append(time.perf_counter() - t0)  # headers
            async for line in r.content:
                if line.startswith(b"data: "):
                    times.append(time.perf_counter() - t0)
                    events.append(line[6:].strip())
    except (
        aiohttp.ClientPayloadError,
        aiohttp.ServerDisconnectedError,
        aiohttp.ClientOSError,
    ) as exc:
        return times, events, exc
    return times, events, None


async def test_faults_stall_fail_and_die_on_demand() -> None:
    with SimProcess.start() as s:
        async with aiohttp.ClientSession() as http:
            s.faults(stall_at="headers", stall_s=0.4, count=1)
            times, events, err = await _chunks(http, s.url)
            assert times[0] >= 0.4
            assert err is None
            assert events[-1] == b"[DONE]"

            s.faults(stall_at="first_token", stall_s=0.4, count=1)
            times, events, err = await _chunks(http, s.url)
            assert times[0] < 0.3  # headers came at once
            assert times[1] >= 0.4
            assert events[-1] == b"[DONE]"

            s.faults(stall_at="mid_stream", stall_s=0.4, after_tokens=2, count=1)
            times, events, err = await _chunks(http, s.url)
            gaps = [b - a for a, b in itertools.pairwise(times[1:])]  # between tokens
            assert max(gaps) >= 0.35  # measured at the client: a little jitter
            assert gaps.index(max(gaps)) == 1
            assert events[-1] == b"[DONE]"

            s.faults(die_mid_stream=True, after_tokens=3, count=1)
            times, events, err = await _chunks(http, s.url)
            assert err is not None
            assert len(events) == 3
            assert b"[DONE]" not in events
            assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events)

            s.faults(die_mid_stream=True, after_tokens=0, count=1)  # before the first token
            times, events, err = await _chunks(http, s.url)
            assert err is not None
            assert events == []

            for where in ("first_token", "mid_stream"):  # an unstreamed answer stalls whole
                s.faults(stall_at=where, stall_s=0.4, count=1)
                t0 = time.perf_counter()
                body = {"model": MODEL, "prompt": "x", "max_tokens": 3}
                async with http.post(s.url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    assert (await r.json())["usage"]["completion_tokens"] == 3
                assert time.perf_counter() - t0 >= 0.4, where

            plan = s.faults(fail_status=503, count=2)
            assert plan["count"] == 2
            assert plan["active"]
            for _ in range(2):
                async with http.post(
                    s.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}
                ) as r:
                    assert r.status == 503
                    assert (await r.json())["error"]["type"] == "server_error"
            assert s.get_json("/sim/faults")["active"] is False  # count used up
            times, events, err = await _chunks(http, s.url)
            assert events[-1] == b"[DONE]"

            s.faults(fail_status=429)
            for _ in range(3):
                async with http.post(
                    s.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}
                ) as r:
                    assert r.status == 429
            s.faults()  # DELETE clears
            times, events, err = await _chunks(http, s.url)
            assert err is None

            async with http.post(s.url + "/sim/faults", json={"stall_at": "never"}) as r:
                assert r.status == 400
            async with http.post(s.url + "/sim/faults", json={"fail_status": 200}) as r:
                assert r.status == 400
                assert "400-599" in (await r.json())["error"]["message"]
        assert metric(s, "vllm:kv_cache_usage_perc") == 0.0
        assert "Traceback" not in s.stderr_text()


def test_faults_from_cli_flags() -> None:
    with SimProcess.start("--fail-status", "500", "--fault-count", "1") as s:
        c = client(s)
        with pytest.raises(openai.InternalServerError):
            c.completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert c.completions.create(model=MODEL, prompt="x", max_tokens=1).choices


# --- process behaviour ---------------------------------------------------------------------


async def test_sigterm_ends_cleanly_even_with_a_stream_in_flight() -> None:
    s = SimProcess.start("--decode-base-ms", "50", "--shutdown-timeout-s", "0.5")
    async with aiohttp.ClientSession() as http:
        payload = {"model": MODEL, "prompt": "x", "max_tokens": 1000, "stream": True}
        async with http.post(s.url + "/v1/completions", json=payload) as r:
            await r.content.readline()
            t0 = time.perf_counter()
            rc = await asyncio.to_thread(s.stop)
            assert rc == 0
            assert time.perf_counter() - t0 < 5
    assert "stopped" in s.stderr_text() or rc == 0


def _refused(*flags: str) -> str:
    """What `llmgw sim` with these flags says on stderr; it must exit 2."""
    out = subprocess.run([sys.executable, "-m", "llmgw", "sim", *flags], capture_output=True,
                         text=True, timeout=30)  # fmt: skip
    assert out.returncode == 2, out
    return out.stderr


def test_cli_refuses_a_cache_too_small_for_max_model_len_and_says_what_to_do() -> None:
    said = _refused("--num-blocks", "4", "--max-model-len", "4096")
    assert "raise --num-blocks or lower --max-model-len" in said


def test_a_loading_sim_listens_only_after_its_load_time_and_a_bad_one_is_refused() -> None:
    began = time.monotonic()
    s = SimProcess.start("--load-s", "1.5", timeout=60)
    try:
        # The start-up line comes once the socket accepts connections (a lower bound only:
        # a busy machine adds to it).
        assert time.monotonic() - began >= 1.5
        assert s.get_json("/v1/models")["data"]
    finally:
        s.stop()
    assert "load_s must be 0-3600 seconds" in _refused("--load-s", "-1")


def test_every_contract_flag_exists() -> None:
    """Contract 4: the agent and the router tests launch the sim with these flags."""
    out = subprocess.run(
        [sys.executable, "-m", "llmgw", "sim", "--help"],
        capture_output=True, text=True, timeout=30, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert out.returncode == 0
    for flag in (
        "--host", "--port", "--served-model-name", "--max-model-len", "--block-size",
        "--num-blocks", "--max-num-seqs", "--seed", "--decode-base-ms", "--decode-per-seq-ms",
        "--prefill-per-token-ms", "--stall-at", "--stall-s", "--fail-status",
        "--die-mid-stream", "--after-tokens", "--fault-count",
    ):  # fmt: skip
        assert flag in out.stdout, flag


def test_yaml_config_file_with_nested_latency_and_faults(tmp_path: Path) -> None:
    cfg = tmp_path / "sim.yaml"
    cfg.write_text(
        "served_model_names: [from-yaml, other]\n"
        "max_model_len: 128\n"
        "latency: {decode_base_ms: 1}\n"
        "faults: {fail_status: 418, count: 1}\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmgw", "sim", "--port", "0", "--config", str(cfg)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().decode().split()[-1]
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in c.models.list()] == ["from-yaml", "other"]
        with pytest.raises(openai.APIStatusError) as info:
            c.completions.create(model="other", prompt="x", max_tokens=1)
        assert info.value.status_code == 418
        assert c.completions.create(model="other", prompt="x", max_tokens=1).choices
    finally:
        proc.terminate()
        assert proc.wait(10) == 0


def test_bad_flags_are_refused_with_what_to_use() -> None:
    assert "headers, first_token, mid_stream" in _refused("--stall-at", "never")


def test_environment_overrides_and_flags_win_over_them() -> None:
    env = {**os.environ, "LLMGW_SIM__MAX_MODEL_LEN": "300", "LLMGW_SIM__SEED": "9"}
    cmd = [sys.executable, "-m", "llmgw", "sim", "--port", "0", "--max-model-len", "200"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert line.startswith("llmgw sim listening on http://127.0.0.1:")
        url = line.split()[-1]
        import urllib.request

        with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
            assert json.loads(r.read())["data"][0]["max_model_len"] == 200
    finally:
        proc.terminate()
        assert proc.wait(10) == 0


def test_a_sim_that_cannot_start_is_reported_with_its_stderr(tmp_path: Path) -> None:
    log = tmp_path / "sim.log"
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        SimProcess.start("--max-num-seqs", "-3", log=log)
    # It exited at once: reported then, not after the whole start-up timeout.
    assert time.monotonic() - t0 < 15
    assert "exited (2) before announcing itself" in str(err.value)
    complaint = "max_num_seqs must be >= 1"
    assert complaint in str(err.value)  # the sim's own words, from its stderr
    assert complaint in log.read_text()

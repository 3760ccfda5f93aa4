"""Streaming without the aiohttp shortcuts (llmgw.router.aiohttp_direct off): the
router as it runs on an aiohttp version its guard does not know. Real sims, a real
router process, real HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest

from tests.integration.router_kit import Router, Sim

pytestmark = pytest.mark.slow

CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Router, Sim, Sim, Path]]:
    tmp: Path = tmp_path_factory.mktemp("router-awaited")
    sims = [Sim.start("m", "--eos-min-tokens", "6", "--eos-max-tokens", "6") for _ in range(2)]
    log = tmp / "router.log"
    router = Router.start(
        tmp,
        {"a": sims[0], "b": sims[1]},
        keepalive_s=0.2,
        log=log,
        env={"LLMGW_AIOHTTP_DIRECT": "0"},
    )
    yield router, sims[0], sims[1], log
    router.stop()
    for s in sims:
        s.stop()


def _content(raw: bytes) -> str:
    events = [json.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    chunks = [e for e in events if e.get("choices")]  # (an error event has none)
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in chunks)


def test_the_router_says_why_it_writes_the_slow_way(
    fleet: tuple[Router, Sim, Sim, Path],
) -> None:
    log = fleet[3].read_text()
    assert log.count("aiohttp_direct_writes_off") == 1
    assert "LLMGW_AIOHTTP_DIRECT=0" in log


def test_streams_and_whole_answers_are_served(fleet: tuple[Router, Sim, Sim, Path]) -> None:
    router = fleet[0]
    with httpx.Client(base_url=router.url, timeout=10) as h:
        for _ in range(4):
            r = h.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200
            assert r.headers["content-type"] == "text/event-stream"
            assert r.content.endswith(b"data: [DONE]\n\n")
            assert _content(r.content)
            assert b'"usage":{' not in r.content  # the router's own usage chunk is dropped
        whole = h.post("/v1/chat/completions", json={**CHAT, "stream": False})
        assert whole.status_code == 200
        assert whole.json()["choices"][0]["message"]["content"]
    m = router.metrics()
    assert m['llmgw_router_requests_total{model="m",status="200"}'] >= 5.0


def test_keepalive_comments_then_the_stream(fleet: tuple[Router, Sim, Sim, Path]) -> None:
    router, a, b, _ = fleet
    for s in (a, b):
        s.faults(stall_at="first_token", stall_s=1.0)
    try:
        with httpx.Client(base_url=router.url, timeout=10) as h:
            raw = h.post("/v1/chat/completions", json=CHAT).content
    finally:
        for s in (a, b):
            s.clear_faults()
    first_data = raw.index(b"data: ")
    assert raw[:first_data].count(b": keep-alive\n\n") >= 3
    assert b": keep-alive" not in raw[first_data:]
    assert raw.endswith(b"data: [DONE]\n\n")
    assert _content(raw)


def test_a_failure_before_the_first_byte_moves_to_the_other_engine(
    fleet: tuple[Router, Sim, Sim, Path],
) -> None:
    router, a, _b, _ = fleet
    before = router.metrics().get('llmgw_router_retries_total{model="m",reason="status_503"}', 0)
    a.faults(fail_status=503)
    try:
        with httpx.Client(base_url=router.url, timeout=10) as h:
            for _ in range(2):  # one of them goes to `a` first
                r = h.post("/v1/chat/completions", json=CHAT)
                assert r.status_code == 200
                assert r.content.endswith(b"data: [DONE]\n\n")
    finally:
        a.clear_faults()
    after = router.metrics()['llmgw_router_retries_total{model="m",reason="status_503"}']
    assert after > before


def test_a_stream_cut_after_the_first_byte_ends_with_an_error_event(
    fleet: tuple[Router, Sim, Sim, Path],
) -> None:
    router, a, b, _ = fleet
    for s in (a, b):
        s.faults(die_mid_stream=True, after_tokens=2)
    try:
        with httpx.Client(base_url=router.url, timeout=10) as h:
            r = h.post("/v1/chat/completions", json=CHAT)
    finally:
        for s in (a, b):
            s.clear_faults()
    assert r.status_code == 200  # the stream had started: the status could not change
    assert _content(r.content)
    last = r.content.rstrip().split(b"\n\n")[-1]
    assert last.startswith(b"data: ")
    err = json.loads(last[6:])["error"]
    assert err["code"] == "engine_disconnected"
    assert err["type"] == "server_error"

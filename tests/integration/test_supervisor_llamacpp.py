"""The llama.cpp adapter's command line against a real `llama-server` binary, when one is built.

`scripts/build-llama-server.sh` builds it into ~/.cache/llmgw (about 4 minutes);
LLMGW_LLAMA_SERVER or PATH may point to another. Without a model file the
server parses every option and then fails to load: exactly what shows that the
adapter's flags are accepted, and how the supervisor reports a failed load.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from llmgw.agent import engines
from llmgw.agent.discovery import simulated
from llmgw.agent.engines import LaunchContext
from llmgw.agent.supervisor import Settings, Supervisor
from llmgw.core.inventory import Inventory
from llmgw.core.profile import LaunchSpec
from tests.integration.test_supervisor import Recorder, free_port


def find_llama_server() -> str | None:
    candidates = [os.environ.get("LLMGW_LLAMA_SERVER", ""), shutil.which("llama-server") or ""]
    candidates += sorted(
        glob.glob(os.path.expanduser("~/.cache/llmgw/llama-server-*/build/bin/llama-server"))
    )
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


LLAMA_SERVER = find_llama_server()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        LLAMA_SERVER is None, reason="no llama-server: run scripts/build-llama-server.sh"
    ),
]


def launch_for(tmp_path: Path, gpus: tuple[int, ...]) -> tuple[LaunchSpec, engines.Launch]:
    assert LLAMA_SERVER is not None
    spec = LaunchSpec(
        engine="llamacpp",
        model=str(tmp_path / "missing.gguf"),
        served_name="smollm2",
        aliases=("small",),
        port=free_port(),
        gpus=gpus,
        pipeline_parallel=max(1, len(gpus)),
        max_model_len=4096,
        start_timeout_s=30,
    )
    inventory = Inventory(gpus=simulated.parse_spec("2xl4-23g"))
    context = LaunchContext(host="127.0.0.1", commands={"llamacpp": (LLAMA_SERVER,)})
    return spec, engines.plan(spec, inventory, context)


@pytest.mark.parametrize("gpus", [(), (0, 1)], ids=["cpu", "layer-split"])
def test_real_llama_server_accepts_every_option(tmp_path: Path, gpus: tuple[int, ...]) -> None:
    _, launch = launch_for(tmp_path, gpus)
    done = subprocess.run(
        launch.argv,
        env=os.environ | launch.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    output = done.stdout + done.stderr
    assert "invalid argument" not in output
    assert "failed to load model" in output  # it got past parsing, to loading


async def test_failed_load_of_a_real_engine_ships_its_log_tail(tmp_path: Path) -> None:
    spec, launch = launch_for(tmp_path, ())
    recorder = Recorder()
    supervisor = Supervisor(Settings(state_dir=str(tmp_path / "state"), poll_s=0.1), recorder)
    try:
        await supervisor.start("rep-llama", 1, 0, spec, launch)
        failed = await recorder.wait_for("rep-llama", "failed", within=60)
        assert failed.error.startswith("engine exited with code")
        assert any("failed to load model" in line for line in failed.log_tail)
    finally:
        await supervisor.stop_all(grace_s=2)
        await supervisor.close()

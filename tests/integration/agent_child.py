"""A stand-in agent process for the adoption test: starts one sim shard, then waits to be killed.

Run as `python -m tests.integration.agent_child STATE_DIR PORT NAME`; prints
`SERVING <pid> <api key>` once the engine serves (the key on stdout for the test to
compare; its JSON log goes to stderr). The test kills it with SIGKILL.
"""

from __future__ import annotations

import asyncio
import sys

from llmgw import logs
from llmgw.agent import engines
from llmgw.agent.discovery import simulated
from llmgw.agent.shards import ShardView
from llmgw.agent.supervisor import Settings, Supervisor
from llmgw.core.inventory import Inventory
from llmgw.core.profile import LaunchSpec


async def main(state_dir: str, port: int, name: str) -> None:
    serving = asyncio.Event()

    async def on_change(view: ShardView) -> None:
        if view.phase == "serving":
            print(f"SERVING {view.pid} {view.api_key}", flush=True)
            serving.set()

    sup = Supervisor(Settings(state_dir=state_dir, poll_s=0.1), on_change)
    spec = LaunchSpec(engine="sim", model=name, served_name=name, port=port, gpus=(0,))
    inventory = Inventory(gpus=simulated.parse_spec("1xh100-80g"))
    launch = engines.plan(spec, inventory, engines.LaunchContext(host="127.0.0.1"))
    await sup.start("rep-adopt", 1, 0, spec, launch)
    await asyncio.wait_for(serving.wait(), 60)
    await asyncio.sleep(3600)


if __name__ == "__main__":
    logs.setup("info", json=True)  # to stderr: stdout carries the SERVING line
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))

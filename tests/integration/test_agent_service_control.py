"""The agent service under the real control plane: a declared model ends up served.

Both in this event loop, against one real nats-server: the ControlService
(leader by lease) places a replica of a `sim` model on the agent's node, the
AgentService launches a real `llmgw sim`, and the control plane announces the
endpoint. Killing the engine makes the control plane restart the replica at
the next generation, which the agent starts in place.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from llmgw import processes
from llmgw.agent.service import AgentService
from llmgw.control.service import ControlService
from llmgw.core import state
from tests import harness
from tests.harness import TestNatsServer
from tests.integration import agent_kit as kit
from tests.integration import control_kit

pytestmark = pytest.mark.slow

NODE = "node-c"


@pytest.fixture
async def agent(nats_server: TestNatsServer, tmp_path: Path) -> AsyncIterator[AgentService]:
    state_dir = tmp_path / "agent"
    # The placement's default ports (8100...) may be taken on a shared test machine: the
    # engine then fails to bind and the control plane restarts it, which the test tolerates.
    cfg = kit.agent_cfg(nats_server, NODE, state_dir, engine_ports={"first": 1024, "last": 65535})
    tls = await asyncio.to_thread(nats_server.pki.client_tls, "node", NODE)
    svc = AgentService(cfg, tls=tls, reconnect_backoff=(0.05, 0.5))
    stop = asyncio.Event()
    task = asyncio.create_task(svc.run(stop))
    try:
        yield svc
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 30)
        kit.kill_engines(state_dir)


async def models_at(endpoint: state.Endpoint) -> list[str]:
    """The models the engine lists to whoever presents the key of its EndpointUp."""
    bearer = {"Authorization": f"Bearer {endpoint.api_key}"}
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http,
            http.get(f"{endpoint.url}/v1/models", headers=bearer) as resp,
        ):
            return [m["id"] for m in (await resp.json())["data"]]
    except (aiohttp.ClientError, TimeoutError):
        return []


async def test_a_declared_model_is_placed_started_and_served(
    nats_server: TestNatsServer, agent: AgentService
) -> None:
    cfg = control_kit.control_config(
        nats_server, "control-1", models=(control_kit.model("m1", replicas=1),)
    )
    async with control_kit.running(ControlService(cfg)) as control:
        await harness.wait_for(
            lambda: "m1" in {e.model for e in control.state.endpoints.values()},
            60,
            "an endpoint for m1",
        )
        (endpoint,) = control.state.endpoints.values()
        assert endpoint.api_key
        assert await models_at(endpoint) == ["m1"]
        replica = control.state.replicas[endpoint.replica_id]
        assert replica.shards[0].node == NODE
        generation = replica.generation

        # The engine dies: the control plane sees `failed` and restarts it, one generation up.
        assert agent.supervisor is not None
        view = agent.supervisor.view(endpoint.replica_id)
        assert view is not None
        assert view.pid is not None
        processes.signal_group(view.pid, 9)

        def restarted() -> bool:
            r = control.state.replicas.get(endpoint.replica_id)
            return (
                r is not None
                and r.generation > generation
                and endpoint.replica_id in control.state.endpoints
            )

        await harness.wait_for(restarted, 60, "the replica restarted and serving again")
        new = agent.supervisor.view(endpoint.replica_id)
        assert new is not None
        assert new.phase == "serving"
        assert new.generation == control.state.replicas[endpoint.replica_id].generation
        # The new generation's engine has a key of its own, and EndpointUp carries it.
        again = control.state.endpoints[endpoint.replica_id]
        assert again.api_key not in ("", endpoint.api_key)
        assert await models_at(again) == ["m1"]
        # The control plane folded every agent event without rejecting any.
        assert control.rejected == 0

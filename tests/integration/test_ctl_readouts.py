"""What `llmgw ctl` reads back to an operator, against a real nats-server: a key's settings
after a change, the log's points, diffs and status. No control plane: the stream is
provisioned as the control identity and events are published as their writers.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest

from llmgw import bus
from llmgw.core import events
from tests.harness import TestNatsServer, connect_as
from tests.integration.control_kit import sim_gpus
from tests.integration.ctl_kit import Ctl


@pytest.fixture
async def log(nats_server: TestNatsServer) -> AsyncIterator[bus.BusClient]:
    """A provisioned log with node-a registered; yields node-a's connection."""
    control = await connect_as(nats_server, "control", "control-a")
    await bus.provision(control.jetstream())
    node = await connect_as(nats_server, "node", "node-a")
    await bus.Publisher(node.jetstream()).publish(
        events.NodeRegistered(
            id="reg-1", ts=time.time(), node="node-a", address="127.0.0.1", gpus=sim_gpus(2)
        )
    )
    try:
        yield node
    finally:
        for nc in (control, node):
            await bus.close(nc)


async def test_key_update_json_shows_the_settings_it_made(
    nats_server: TestNatsServer, log: bus.BusClient
) -> None:
    ctl = Ctl(nats_server)
    made = await ctl("key", "create", "--name", "team-a", "--rps", "10", "--team", "red")
    assert made.code == 0, made
    updated = (await ctl("key", "update", "team-a", "--rps", "5", "--json")).json()
    # What it printed is the key as it is now, not as it was before the change.
    assert updated["requests_per_s"] == 5
    assert updated["team"] == "red"  # what was not given stays
    assert updated["changed_by"] == "alice"
    shown = (await ctl("key", "show", "team-a", "--json")).json()
    assert shown == updated

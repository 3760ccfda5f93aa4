"""Engines answer only the routers: each replica's engine key, end to end, and fallbacks
checked against the client key's models.

The whole fleet as real processes (tests/e2e/fleet_kit.py): agents launch real `llmgw sim`
engines, each with its own key; the control plane copies it from the serving ShardStatus
into EndpointUp; the router, fed by the log, presents it. A client on the node network
that goes straight to an engine gets 401 (its fault-injection endpoints too); the same
request through the router succeeds with the openai SDK. Another node's identity cannot
read the key from NATS, and no service's log holds it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest
import yaml

from llmgw.core import events, subjects
from llmgw.router import auth
from tests.e2e.fleet_kit import Fleet, sim_model
from tests.harness import TestNatsServer, connect_as

pytestmark = pytest.mark.slow

REFUSED = 1.0  # seconds to wait for an answer the server is expected never to give
CHAT = {"model": "m1", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


class KeyedFleet(Fleet):
    """The fleet with a keys file on the router instead of anonymous access."""

    keys_file: str = ""

    def router_config(self) -> Path:
        path = super().router_config()
        settings = yaml.safe_load(path.read_text())
        settings["auth"] = {"keys_file": self.keys_file}
        path.write_text(yaml.safe_dump(settings))
        return path


def write_keys(tmp: Path, keys: dict[str, tuple[str, tuple[str, ...]]]) -> str:
    path = tmp / "router-keys.yaml"
    path.write_text(
        "keys:\n" + "".join(auth.entry_yaml(n, k, models) for n, (k, models) in keys.items())
    )
    return str(path)


@pytest.fixture
async def keyed(nats_server: TestNatsServer, tmp_path: Path) -> Any:
    both, only_m1 = auth.new_key(), auth.new_key()
    fleet = KeyedFleet(
        nats_server,
        tmp_path,
        models=(sim_model("m1", replicas=1, fallbacks=("m2",)), sim_model("m2", replicas=1)),
    )
    fleet.keys_file = write_keys(
        tmp_path, {"both": (both, ("m1", "m2")), "only-m1": (only_m1, ("m1",))}
    )
    try:
        yield fleet, both, only_m1
    finally:
        await fleet.stop()


async def endpoints_up(fleet: Fleet) -> dict[str, events.EndpointUp]:
    """The newest EndpointUp of each model, as the log holds it."""
    ups: dict[str, events.EndpointUp] = {}
    for record in await fleet.read_log():
        if isinstance(record.event, events.EndpointUp):
            ups[record.event.model] = record.event
    return ups


async def status(
    http: aiohttp.ClientSession, method: str, url: str, key: str = "", **kw: Any
) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with http.request(method, url, headers=headers, **kw) as resp:
        await resp.read()
        return resp.status


def openai_chat(base_url: str, key: str, model: str = "m1") -> tuple[str, str]:
    """(the model that answered, its text), through the real openai SDK (blocking)."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=key, timeout=30, max_retries=0)
    out = client.chat.completions.create(
        model=model, max_tokens=8, messages=[{"role": "user", "content": "Hello!"}]
    )
    return out.model, out.choices[0].message.content or ""


async def test_engines_answer_only_with_their_key_which_only_routers_learn(keyed: Any) -> None:
    fleet, both, _ = keyed
    await fleet.start()
    ups = await endpoints_up(fleet)
    assert set(ups) == {"m1", "m2"}
    up = ups["m1"]
    assert len(up.api_key) >= 40
    assert up.api_key != ups["m2"].api_key  # one key per replica's engine

    # Straight to the engine, from the node network: refused without the key, faults too.
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        chat = f"{up.url}/v1/chat/completions"
        assert await status(http, "POST", chat, json=CHAT) == 401
        assert await status(http, "POST", chat, key="guessed", json=CHAT) == 401
        assert await status(http, "POST", chat, key=both, json=CHAT) == 401  # a router key
        assert await status(http, "GET", f"{up.url}/v1/models") == 401
        assert await status(http, "GET", f"{up.url}/sim/faults") == 401
        assert await status(http, "POST", f"{up.url}/sim/faults", json={"fail_status": 500}) == 401
        assert await status(http, "DELETE", f"{up.url}/sim/faults") == 401
        assert await status(http, "GET", f"{up.url}/health") == 200
        assert await status(http, "GET", f"{up.url}/metrics") == 200
        # The engine binds the node's serving address, not every interface.
        assert up.url.startswith(f"http://{fleet.addresses[up.node]}:")

    # The same request through the router, with the router's key for the client.
    model, text = await asyncio.to_thread(openai_chat, fleet.router_url, both)
    assert model == "m1"
    assert text

    # Another node's identity cannot read the key: neither the serving node's shard events
    # nor the control plane's EndpointUp are readable to it.
    other = next(n for n in fleet.nodes if n != up.node)
    node = await connect_as(fleet.server, "node", other)
    try:
        js = node.jetstream(timeout=REFUSED)
        for subject in (
            subjects.node_event(up.node, "shard"),
            subjects.control_event("endpoint_up"),
        ):
            with pytest.raises(nats.errors.TimeoutError):
                await js.get_last_msg(subjects.STREAM, subject, direct=True)
        # What it may read, it reads: the refusal above is the permission, not absence.
        own = await js.get_last_msg(
            subjects.STREAM, subjects.node_event(other, "registered"), direct=True
        )
        assert isinstance(events.decode(own.data), events.NodeRegistered)
    finally:
        await node.close()

    # No service's log carries an engine key (nor the client's key).
    await fleet.stop()
    logs = {p.name: p.read_text(errors="replace") for p in fleet.tmp.glob("*.log")}
    assert {"control.log", "router.log"} <= set(logs)
    assert any(name.startswith("agent-") for name in logs)
    for name, text in logs.items():
        for key in (up.api_key, ups["m2"].api_key, both):
            assert key not in text, f"a key in {name}"


async def test_a_fallback_serves_only_keys_allowed_its_model(keyed: Any) -> None:
    fleet, both, only_m1 = keyed
    await fleet.start()
    ups = await endpoints_up(fleet)
    # m1's engine fails every request: the router moves to m1's fallback, m2.
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        plan = {"fail_status": 503}
        faults = f"{ups['m1'].url}/sim/faults"
        assert await status(http, "POST", faults, key=ups["m1"].api_key, json=plan) == 200

    model, text = await asyncio.to_thread(openai_chat, fleet.router_url, both)
    assert (model, bool(text)) == ("m2", True)

    # A key allowed m1 only is not served by m2: the answer is m1's own unavailability.
    from openai import APIStatusError

    sent_to_m2 = (await fleet.router_sent()).get(ups["m2"].replica_id, 0.0)
    with pytest.raises(APIStatusError) as info:
        await asyncio.to_thread(openai_chat, fleet.router_url, only_m1)
    assert info.value.status_code in (502, 503)
    assert info.value.status_code != 404  # it asked for m1, which it may use
    assert (await fleet.router_sent()).get(ups["m2"].replica_id, 0.0) == sent_to_m2
    # Asking for m2 itself with that key is answered as for a model that does not exist.
    with pytest.raises(APIStatusError) as denied:
        await asyncio.to_thread(openai_chat, fleet.router_url, only_m1, "m2")
    assert denied.value.status_code == 404

"""The engines' KV events, end to end: a sim publishing them (vLLM's wire format), the
agent's relay, a real nats-server with mutual TLS and the rendered authorization, and
routers' KV feeds building the fleet KV index.

What a router predicts an endpoint holds is compared with what the engine itself then
reports (`usage.prompt_tokens_details.cached_tokens`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats.errors
import pytest

from llmgw import bus
from llmgw.agent.kvrelay import EngineRelay
from llmgw.core import kvblocks, routing, subjects
from llmgw.core.kvindex import KvIndex
from llmgw.core.profile import ModelProfile
from llmgw.router import prompts
from llmgw.router.config import LogSource
from llmgw.router.kvfeed import KvFeed
from llmgw.router.kvroute import KvRouting
from llmgw.router.requests import parse
from llmgw.sim.testing import SimProcess
from tests.harness import TestNatsServer, connect_as, signed_headers, wait_for

PROFILE = ModelProfile(name="m", engine="sim")
SYSTEM = "You are a careful assistant. " * 60  # about 300 tokens of shared prefix
BLOCK = 16  # the sim's tokens a block
CHAT = "/v1/chat/completions"


@pytest.fixture
def sockets() -> Iterator[Path]:
    # ipc:// paths are limited to ~107 bytes: pytest's tmp_path is too deep for them.
    path = Path(tempfile.mkdtemp(prefix="kv-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def start_sim(sockets: Path, name: str, *extra: str) -> SimProcess:
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{sockets}/{name}.events",
        "replay_endpoint": f"ipc://{sockets}/{name}.replay",
    }
    return SimProcess.start(
        "--kv-events-config", json.dumps(config), "--num-blocks", "400", *extra, model="m"
    )


def chat_body(question: str) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 4,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
    }


def chat(sim: SimProcess, question: str) -> dict[str, Any]:
    return post(sim, chat_body(question))


def common_prefix(kind: Any, first: dict[str, Any] | None, then: dict[str, Any]) -> int:
    """How many tokens the router's prompts of `first` (of API `kind`; None: the chat of
    SYSTEM and a question) and `then` begin with alike."""
    tokens = prompts.for_profile(PROFILE)
    assert tokens is not None
    bodies = [("chat", chat_body("?")) if first is None else (kind, first), (kind, then)]
    ids = [
        tokens.ids(parse(api, json.dumps(b).encode(), want_text=True)) or [] for api, b in bodies
    ]
    return next(
        (i for i, (a, b) in enumerate(zip(*ids, strict=False)) if a != b), min(map(len, ids))
    )


def reset_prefix_cache(sim: SimProcess) -> None:
    req = urllib.request.Request(sim.url + "/reset_prefix_cache", method="POST")
    urllib.request.urlopen(req, timeout=10).close()


def parsed(question: str) -> Any:
    body = {
        "model": "m",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
    }
    return parse("chat", json.dumps(body).encode(), want_text=True)


def endpoint(name: str, node: str) -> routing.EndpointState:
    return routing.EndpointState(
        id=name, url="http://unused", models=frozenset({"m"}), ready=True, node=node
    )


def kv_feed(server: TestNatsServer, name: str, window_s: float = 12.0) -> KvFeed:
    source = LogSource(servers=(server.url,), name=name, ca_file=str(server.pki.certs.ca_cert))
    return KvFeed(source, KvIndex(), tls=server.pki.client_tls("router", name), window_s=window_s)


async def provisioned(server: TestNatsServer) -> None:
    control = await connect_as(server, "control", "c1")
    try:
        await bus.provision(control.jetstream())
    finally:
        await control.close()


class Relay:
    """The agent's relay of one sim, publishing as `node`."""

    def __init__(
        self,
        nc: bus.BusClient,
        node: str,
        ep: str,
        sockets: Path,
        sim: str,
        full_every_s: float = 1.0,
    ) -> None:
        self.publisher = bus.KvPublisher(nc, node)
        self.relay = EngineRelay(
            endpoint=ep,
            model="m",
            events_addr=f"ipc://{sockets}/{sim}.events",
            replay_addr=f"ipc://{sockets}/{sim}.replay",
            send=self.publisher.publish,
            full_every_s=full_every_s,
        )
        self.relay.start()


def predicted(feed: KvFeed, question: str, eps: list[routing.EndpointState]) -> dict[str, int]:
    plan = KvRouting(index=feed.index).plan(parsed(question), PROFILE, eps)
    assert plan is not None
    return {ep: s.cached_tokens for ep, s in plan.by_endpoint.items() if s.source == "events"}


@contextlib.asynccontextmanager
async def one_engine(
    server: TestNatsServer, sockets: Path, name: str
) -> AsyncIterator[tuple[SimProcess, Relay, KvFeed, list[routing.EndpointState]]]:
    """A sim on node-a relayed as endpoint `e<name>`, and a router's KV feed."""
    await provisioned(server)
    sim = start_sim(sockets, name)
    node = await connect_as(server, "node", "node-a")
    feed = kv_feed(server, "r1")
    feed.start()
    relay = Relay(node, "node-a", f"e{name}", sockets, name)
    try:
        yield sim, relay, feed, [endpoint(f"e{name}", "node-a")]
    finally:
        await relay.relay.stop()
        await feed.close()
        await node.close()
        sim.stop()


async def test_routers_predict_what_the_engine_then_reports_cached(
    nats_server: TestNatsServer, sockets: Path
) -> None:
    async with one_engine(nats_server, sockets, "1") as (sim, _relay, feed, eps):
        first = await asyncio.to_thread(chat, sim, "What is one and one?")
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        await wait_for(
            lambda: predicted(feed, "And two and two?", eps).get("e1", 0) > 0,
            30,
            "the router's index to hold the system prompt's blocks",
        )
        guess = predicted(feed, "And two and two?", eps)["e1"]
        second = await asyncio.to_thread(chat, sim, "And two and two?")
        # Exactly what the engine found: the prediction is the engine's own accounting.
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == guess
        assert guess >= 16 * 15  # most of the ~300-token shared prefix
        # A router started now is warm from the stream at once: no new request needed.
        late = kv_feed(nats_server, "r2")
        late.start()
        try:
            await asyncio.wait_for(late.ready.wait(), 30)
            q = "And two and two?"
            await wait_for(
                lambda: predicted(late, q, eps) == predicted(feed, q, eps),
                10,
                "the late router to agree with the first",
            )
            # Two routers fed by the same stream agree block for block.
            await wait_for(lambda: late.index.holders.keys() == feed.index.holders.keys(), 10,
                           "the two indexes to hold the same keys")  # fmt: skip
        finally:
            await late.close()


PARTS = ("Count with me.", "What is two and two?", "Then two and three?", "Say each sum.")
CONVERSATIONS: dict[str, tuple[Any, str, Any, Any]] = {
    # A case -> its API, its path, a body of SYSTEM and a question, and the cached tokens
    # of its usage. A "-parts" case's message of several parts ends with the question.
    "messages": ("messages", "/v1/messages", lambda q: {
        "model": "m", "max_tokens": 4, "system": [{"type": "text", "text": SYSTEM}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": q}]}],
    }, lambda usage: usage["cache_read_input_tokens"]),
    "messages-parts": ("messages", "/v1/messages", lambda q: {
        "model": "m", "max_tokens": 4, "system": [
            {"type": "text", "text": SYSTEM[:100]}, {"type": "text", "text": SYSTEM[100:]}],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": p} for p in (*PARTS, q)]}],
    }, lambda usage: usage["cache_read_input_tokens"]),
    "responses": ("responses", "/v1/responses", lambda q: {
        "model": "m", "max_output_tokens": 4, "instructions": SYSTEM, "input": q,
    }, lambda usage: usage["input_tokens_details"]["cached_tokens"]),
    "responses-parts": ("responses", "/v1/responses", lambda q: {
        "model": "m", "max_output_tokens": 4, "instructions": SYSTEM, "input": [
            {"role": "user", "content": [
                {"type": "input_text", "text": p} for p in (*PARTS, q)]}],
    }, lambda usage: usage["input_tokens_details"]["cached_tokens"]),
    "chat-parts": ("chat", "/v1/chat/completions", lambda q: {
        "model": "m", "max_tokens": 4, "messages": [
            {"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
            {"role": "user", "content": [{"type": "text", "text": p} for p in PARTS]},
            {"role": "assistant", "content": [{"type": "text", "text": "Four."}]},
            {"role": "user", "content": [
                {"type": "text", "text": p} for p in (*PARTS[:2], q)]}],
    }, lambda usage: usage["prompt_tokens_details"]["cached_tokens"]),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CONVERSATIONS))
async def test_a_conversation_of_another_api_is_predicted_as_the_engine_then_reports(
    nats_server: TestNatsServer, sockets: Path, case: str
) -> None:
    """A Messages or Responses request is keyed as the chat of its turns, which is how the
    engine renders it: after a chat of the same system prompt, the router's prediction for
    it is what the engine then reports cached. So is a chat (or either API's) message of
    several text parts, after a request of the same parts."""
    kind, path, body_of, cached_of = CONVERSATIONS[case]
    async with one_engine(nats_server, sockets, "1") as (sim, _relay, feed, eps):
        first: Any = chat_body("What is one and one?")
        asked = body_of("And two and two?")
        if case.endswith("-parts"):  # cached by a request of the same parts but the last
            first, asked = body_of("Briefly."), body_of("In words, please.")
        await asyncio.to_thread(post, sim, first, path if case.endswith("-parts") else CHAT)
        shared = common_prefix(kind, first if case.endswith("-parts") else None, asked)
        if case.endswith("-parts"):  # what they share goes on into the parts
            assert shared >= common_prefix(kind, None, asked) + BLOCK

        def guess() -> int:
            got = parse(kind, json.dumps(asked).encode(), want_text=True)
            plan = KvRouting(index=feed.index).plan(got, PROFILE, eps)
            assert plan is not None
            source = plan.by_endpoint["e1"]
            return source.cached_tokens if source.source == "events" else 0

        # Every full block of the prefix they share: the index has all the engine's events.
        await wait_for(lambda: guess() > shared - BLOCK, 30, "the router's index to hold them")
        predicted_tokens = guess()
        answer = await asyncio.to_thread(post, sim, asked, path)
        assert cached_of(answer["usage"]) == predicted_tokens
        assert predicted_tokens >= 16 * 15


async def test_a_stopped_engine_leaves_the_index_at_once(
    nats_server: TestNatsServer, sockets: Path
) -> None:
    async with one_engine(nats_server, sockets, "2") as (sim, relay, feed, eps):
        await asyncio.to_thread(chat, sim, "Hello?")
        await wait_for(lambda: predicted(feed, "Hi?", eps).get("e2", 0) > 0, 30, "blocks indexed")
        await relay.relay.stop()  # the engine stopped: its relay says it holds nothing
        await wait_for(lambda: predicted(feed, "Hi?", eps).get("e2", 0) == 0, 10,
                       "the stopped engine's blocks to leave the index")  # fmt: skip


async def test_a_reset_prefix_cache_removes_the_blocks(
    nats_server: TestNatsServer, sockets: Path
) -> None:
    async with one_engine(nats_server, sockets, "3") as (sim, _relay, feed, eps):
        await asyncio.to_thread(chat, sim, "Hello?")
        await wait_for(lambda: predicted(feed, "Hi?", eps).get("e3", 0) > 0, 30, "blocks indexed")
        await asyncio.to_thread(reset_prefix_cache, sim)
        await wait_for(lambda: predicted(feed, "Hi?", eps).get("e3", 0) == 0, 10,
                       "the forgotten blocks to leave the index")  # fmt: skip
        again = await asyncio.to_thread(chat, sim, "Hi?")
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_a_nodes_forged_kv_update_for_another_nodes_engine_is_never_believed(
    nats_server: TestNatsServer,
) -> None:
    await provisioned(nats_server)
    feed = kv_feed(nats_server, "r1")
    feed.start()
    victim = await connect_as(nats_server, "node", "node-a")
    attacker = await connect_as(nats_server, "node", "node-b")
    keys = kvblocks.block_keys(list(range(64)), 16)
    claim = kvblocks.KvUpdate(endpoint="e1", model="m", block_size=16, instance="x", seq=1,
                              full=True, stored=keys)  # fmt: skip
    try:
        # 1. On the victim's subject: the server refuses it (nothing is stored).
        payload = kvblocks.encode_update(claim)
        subject = subjects.kv_updates("node-a", "e1")
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await attacker.jetstream().publish(
                subject, payload, headers=signed_headers(attacker, subject, payload, "f1"),
                timeout=1.0,
            )  # fmt: skip
        await wait_for(lambda: any("permissions violation" in v.lower() and "llmgw.kv.node-a" in v
                                   for v in attacker.permission_violations), 10,
                       "the server to report the refused publish")  # fmt: skip
        # 2. Signed by the victim's key but published by the attacker (a replay of a
        # captured update): still the victim's subject, still refused by the server; and
        # the attacker's own subject with the victim's signature is refused by the reader.
        stolen = signed_headers(victim, subjects.kv_updates("node-b", "e1"), payload, "f2")
        await attacker.publish(subjects.kv_updates("node-b", "e1"), payload, headers=stolen)
        # 3. On its own subject, naming the victim's endpoint: stored, signed correctly,
        # and kept apart: never believed for e1 on node-a.
        await bus.KvPublisher(attacker, "node-b").publish(claim)
        await bus.KvPublisher(victim, "node-a").publish(
            kvblocks.KvUpdate(
                endpoint="e1",
                model="m",
                block_size=16,
                instance="v",
                seq=1,
                full=True,
                stored=keys[:1],
            )
        )
        await wait_for(lambda: ("node-a", "e1") in feed.index.endpoints, 20, "the real update")
        await wait_for(lambda: ("node-b", "e1") in feed.index.endpoints, 20, "the claim")
        held, _ = feed.index.match(lambda _s: keys, [("e1", "node-a")], time.time())
        assert held == {"e1": 1}
        assert feed.index.endpoints[("node-b", "e1")].keys == set(keys)  # kept, not used
        assert feed._reader is not None
        assert feed._reader.refused >= 1  # the stolen signature
    finally:
        await feed.close()
        await victim.close()
        await attacker.close()


async def test_a_router_started_long_after_the_traffic_routes_each_prefix_to_its_engine(
    nats_server: TestNatsServer, sockets: Path
) -> None:
    # Blocks stored long before the router's reading window starts (here 3 s, with full
    # updates every second; in production 12 s and 5 s): the agents' full updates carry them.
    await provisioned(nats_server)
    sims = [start_sim(sockets, "a"), start_sim(sockets, "b")]
    node = await connect_as(nats_server, "node", "node-a")
    relays = [Relay(node, "node-a", f"e{n}", sockets, n) for n in ("a", "b")]
    try:
        await asyncio.to_thread(chat, sims[0], "For engine a?")
        body_b = {"model": "m", "max_tokens": 4, "messages": [
            {"role": "system", "content": "Other instructions entirely. " * 60},
            {"role": "user", "content": "For engine b?"}]}  # fmt: skip
        await asyncio.to_thread(post, sims[1], body_b)
        await asyncio.sleep(8.0)  # past the late router's window: no block event is in it
        late = kv_feed(nats_server, "late", window_s=3.0)
        late.start()
        try:
            await asyncio.wait_for(late.ready.wait(), 30)
            eps = [endpoint("ea", "node-a"), endpoint("eb", "node-a")]
            routing_ = KvRouting(index=late.index)
            await wait_for(lambda: len(late.index.endpoints) == 2, 10, "both engines indexed")
            for question, expected in (("For engine a, again?", "ea"), (None, "eb")):
                if question is None:
                    body_b["messages"][1]["content"] = "For b, again?"
                    p = parse("chat", json.dumps(body_b).encode(), want_text=True)
                else:
                    p = parsed(question)
                plan = routing_.plan(p, PROFILE, eps)
                assert plan is not None
                q = routing.Query(model="m", now=0.0, prompt_tokens=plan.prompt_tokens,
                                  cached_tokens=plan.cached, families=plan.families,
                                  tie_key=plan.tie_key)  # fmt: skip
                first = routing.rank(eps, q, routing.Weights(), 0.0).order[0]
                assert first.id == expected, plan
                assert plan.by_endpoint[expected].source == "events"
        finally:
            await late.close()
    finally:
        for r in relays:
            await r.relay.stop()
        await node.close()
        for s in sims:
            s.stop()


def post(
    sim: SimProcess, body: dict[str, Any], path: str = "/v1/chat/completions"
) -> dict[str, Any]:
    req = urllib.request.Request(
        sim.url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        answer: dict[str, Any] = json.loads(r.read())
    return answer

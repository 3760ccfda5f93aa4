"""Messages and Responses API requests routed to the replica that holds their prefix.

An agent speaking the Messages API repeats a long system prompt and its conversation on
every request: the router keys it as a chat's (llmgw.router.turns), so repeated requests
sharing it go to one replica while other prompts spread, `POST /route` says so, and under
`tenancy.cache_isolation` a tenant's prefix is its own.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from llmgw.core import tenancy
from llmgw.router import requests
from tests.unit import route_kit
from tests.unit.route_kit import ENDPOINTS, Fleet, auth_headers, frozen_clocks

PATHS = {"messages": "/v1/messages", "responses": "/v1/responses", "chat": "/v1/chat/completions"}
SYSTEMS = [f"You are agent {i}: plan, then call the tools you need, then answer. " * 30
           for i in range(8)]  # fmt: skip
"""Long system prompts, each of many blocks (about 2,000 characters)."""
QUESTIONS = ["What is running?", "List the nodes.", "Why is e2 slow?"]


def body(kind: requests.Kind, system: str, question: str) -> bytes:
    doc: dict[str, Any] = {"model": "m"}
    if kind == "messages":
        doc |= {"max_tokens": 8, "system": [{"type": "text", "text": system}],
                "messages": [{"role": "user", "content": question}]}  # fmt: skip
    elif kind == "responses":
        part = {"type": "input_text", "text": question}
        doc |= {"instructions": system, "input": [{"role": "user", "content": [part]}]}
    else:
        doc["messages"] = [{"role": "system", "content": system},
                           {"role": "user", "content": question}]  # fmt: skip
    return msgspec.json.encode(doc)


def ready_fleet(mode: tenancy.CacheIsolation) -> Fleet:
    fleet = Fleet(route_kit.config(mode))
    for ep_id in ENDPOINTS:
        fleet.endpoint(ep_id).ready = True
    return fleet


async def _sent_per_system(kind: requests.Kind) -> tuple[list[set[str | None]], Any, Any]:
    """Where each system's requests went, and /route's answer for one more of system 0."""
    fleet = ready_fleet("shared")
    went: list[set[str | None]] = []
    for system in SYSTEMS:
        sent = [await fleet.send(PATHS[kind], body(kind, system, q), auth_headers(None, None))
                for q in QUESTIONS]  # fmt: skip
        assert {status for status, _ in sent} == {200}
        went.append({endpoint for _, endpoint in sent})
    asked = body(kind, SYSTEMS[0], "And the queue?")
    status, said = await fleet.route(PATHS[kind], asked, auth_headers(None, None))
    assert status == 200, said
    _, then = await fleet.send(PATHS[kind], asked, auth_headers(None, None))
    return went, said, then


@pytest.mark.parametrize("kind", ["messages", "responses"])
def test_requests_sharing_a_system_prompt_go_to_one_replica_and_route_says_so(
    kind: requests.Kind,
) -> None:
    with frozen_clocks():
        went, said, then = asyncio.run(_sent_per_system(kind))
    assert all(len(endpoints) == 1 for endpoints in went), went
    assert len(set().union(*went)) > 1, f"every prompt went to one replica: {went}"
    (first,) = went[0]
    assert said["tokenized"] is True, said
    assert said["chosen"]["endpoint"] == first == then
    held = {row["id"]: row["cached_tokens"] for row in said["endpoints"]}
    assert held[first] > 0, said
    assert held[first] == max(held.values()), said


async def _tenants_see(mode: tenancy.CacheIsolation) -> tuple[Any, Any, Any, str | None]:
    """After tenant A (key `ka`) sent a Messages request: /route for A's chat request of the
    same conversation, for B's (key `kb`, another team) Messages request of it, and for A's
    own again; and where A's request went."""
    fleet = ready_fleet(mode)
    asked = body("messages", SYSTEMS[0], QUESTIONS[0])
    _, went = await fleet.send(PATHS["messages"], asked, auth_headers("ka", None))
    as_chat = body("chat", SYSTEMS[0], QUESTIONS[0])
    _, a_chat = await fleet.route(PATHS["chat"], as_chat, auth_headers("ka", None))
    _, b_said = await fleet.route(PATHS["messages"], asked, auth_headers("kb", None))
    _, a_said = await fleet.route(PATHS["messages"], asked, auth_headers("ka", None))
    return a_chat, b_said, a_said, went


def _held(said: Any) -> dict[str, int]:
    return {row["id"]: row["cached_tokens"] for row in said["endpoints"] if row["cached_tokens"]}


@pytest.mark.parametrize("mode", ["team", "key"])
def test_under_isolation_a_conversation_is_keyed_by_its_tenants_salt(
    mode: tenancy.CacheIsolation,
) -> None:
    with frozen_clocks():
        a_chat, b_said, a_said, went = asyncio.run(_tenants_see(mode))
    assert went is not None
    assert a_said["tokenized"] is True, a_said
    assert set(_held(a_said)) == {went}, a_said
    assert set(_held(a_chat)) == {went}, a_chat  # a chat of the same turns: the same prompt
    assert _held(b_said) == {}, b_said  # another tenant's prefix is none of B's

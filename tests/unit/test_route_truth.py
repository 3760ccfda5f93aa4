"""`POST /route` names the replica the front door then sends the same body to.

An operator asks the admin listener where a body would go and why; the answer is only
worth anything if it is where the body does go. Here both run in-process on one router,
at one frozen moment, over generated fleets (endpoints' readiness, load and models, the
engines' KV events, earlier requests' recent routes and sessions) and bodies of every API
the router routes, under each `tenancy.cache_isolation` mode.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.core import tenancy
from llmgw.router import apis, requests
from tests.unit import route_kit
from tests.unit.route_kit import ENDPOINTS, Fleet, auth_headers, frozen_clocks

SYSTEMS = (
    "You are a careful assistant who answers questions about GPU fleets. " * 6,
    "Answer in French, briefly, and never invent a number you were not given. " * 6,
    "Tu es un poète. Réponds en vers, toujours. " * 9,
)
KINDS: tuple[requests.Kind, ...] = (
    "chat",
    "completions",
    "responses",
    "messages",
    "embeddings",
    "score",
)
PATH_OF = {kind: next(p for p, k in apis.PATHS.items() if k == kind) for kind in KINDS}
MODES: tuple[tenancy.CacheIsolation, ...] = ("shared", "team", "key")


def body(kind: requests.Kind, model: str, system: int, user: str, salt: str | None) -> bytes:
    """A client's body of API `kind` whose prompt is `SYSTEMS[system]` then `user`."""
    text = SYSTEMS[system]
    doc: dict[str, Any] = {"model": model}
    if kind == "chat":
        doc["messages"] = [{"role": "system", "content": text}, {"role": "user", "content": user}]
    elif kind == "messages":
        doc |= {"max_tokens": 8, "system": text, "messages": [{"role": "user", "content": user}]}
    elif kind == "completions":
        doc["prompt"] = text + user
    else:
        doc["input"] = text + user
    if salt is not None:
        doc["cache_salt"] = salt
    return msgspec.json.encode(doc)


keys = st.sampled_from([None, "ka", "kb", "kc"])
sessions = st.sampled_from([None, "s1", "s2"])
asked = st.builds(
    dict,
    kind=st.sampled_from(KINDS),
    model=st.sampled_from(["m", "ma", "f", "w", "nope"]),
    system=st.integers(0, len(SYSTEMS) - 1),
    user=st.sampled_from(["Q1?", "How many GPUs?", "x" * 300]),
    salt=st.sampled_from([None, "client-salt"]),
    key=keys,
    session=sessions,
)
endpoint_states = st.fixed_dictionaries(
    {
        "ready": st.booleans().map(lambda b: b or None) | st.just(True),
        "draining": st.booleans(),
        "inflight": st.integers(0, 3),
        "queue_depth": st.sampled_from([0.0, 1.0, 2.0]),
        "running": st.sampled_from([0.0, 1.0]),
        "kv_usage": st.sampled_from([0.0, 0.5]),
        "last_sent": st.sampled_from([0.0, 1.0]),
    }
)
served = st.lists(st.sampled_from(["m", "f", "w"]), min_size=1, max_size=3, unique=True)
events = st.lists(
    st.tuples(
        st.sampled_from(ENDPOINTS),
        st.integers(0, len(SYSTEMS) - 1),
        keys,
        st.sampled_from([None, "client-salt"]),
        st.integers(1, 12),
    ),
    max_size=4,
)


async def _scenario(
    mode: tenancy.CacheIsolation,
    models: dict[str, list[str]],
    states: dict[str, dict[str, Any]],
    cached: list[tuple[str, int, str | None, str | None, int]],
    history: list[dict[str, Any]],
    final: dict[str, Any],
) -> tuple[str | None, str | None, Any]:
    fleet = Fleet(route_kit.config(mode, {ep: tuple(m) for ep, m in models.items()}))
    for ep_id, state in states.items():
        ep = fleet.endpoint(ep_id)
        for name, value in state.items():
            setattr(ep, name, bool(value) if name == "ready" else value)
    for ep_id, system, key, client_salt, blocks in cached:
        prompt = body("chat", "m", system, "", client_salt)
        parsed = requests.parse("chat", prompt, want_text=True)
        team = route_kit.TENANTS[key][0] if key else ""
        salt = client_salt if mode == "shared" else tenancy.cache_salt(mode, key, team)
        fleet.cached(ep_id, parsed, salt, blocks)
    for earlier in history:  # earlier requests: recent routes, the text index, sessions
        await fleet.send(*_request(earlier))
    said_status, said = await fleet.route(*_request(final))
    named = said["order"][0] if said_status == 200 and said.get("order") else None
    _, went = await fleet.send(*_request(final))
    return named, went, said


def _request(r: dict[str, Any]) -> tuple[str, bytes, dict[str, str]]:
    kind = r["kind"]
    return (PATH_OF[kind], body(kind, r["model"], r["system"], r["user"], r["salt"]),
            auth_headers(r["key"], r["session"]))  # fmt: skip


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(MODES),
    models=st.fixed_dictionaries({ep: served for ep in ENDPOINTS}),
    states=st.fixed_dictionaries({ep: endpoint_states for ep in ENDPOINTS}),
    cached=events,
    history=st.lists(asked, max_size=3),
    final=asked,
)
def test_route_names_the_replica_the_front_door_then_sends_the_body_to(
    mode: tenancy.CacheIsolation,
    models: dict[str, list[str]],
    states: dict[str, dict[str, Any]],
    cached: list[tuple[str, int, str | None, str | None, int]],
    history: list[dict[str, Any]],
    final: dict[str, Any],
) -> None:
    with frozen_clocks():
        named, went, said = asyncio.run(_scenario(mode, models, states, cached, history, final))
    assert named == went, said


async def _b_sees(
    mode: tenancy.CacheIsolation,
    states: dict[str, dict[str, Any]],
    a_sent: int | None,
    a_cached_at: str,
    b_asks: dict[str, Any],
) -> Any:
    """Tenant B's /route answer after tenant A (another team, another key) sent the prompt
    `SYSTEMS[a_sent]` and its engine reported caching it at `a_cached_at`; or, `a_sent`
    None, after A sent a request too short to have a prefix (its tie draws are the same)
    and that engine reported nothing of it."""
    fleet = Fleet(route_kit.config(mode))
    for ep_id, state in states.items():
        for name, value in state.items():
            setattr(fleet.endpoint(ep_id), name, value)
    if a_sent is None:
        fleet.reports(a_cached_at, [])
        a_body = msgspec.json.encode(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        )
    else:
        a_body = body("chat", "m", a_sent, "Q1?", None)
        a_salt = tenancy.cache_salt(mode, "ka", route_kit.TENANTS["ka"][0])
        fleet.cached(a_cached_at, requests.parse("chat", a_body, want_text=True), a_salt, 12)
    await fleet.send(PATH_OF["chat"], a_body, auth_headers("ka", "s1"))
    status, said = await fleet.route(*_request({**b_asks, "key": "kb"}))
    assert status == 200, said
    return said


@settings(max_examples=60)
@given(
    mode=st.sampled_from(("team", "key")),
    states=st.fixed_dictionaries({ep: endpoint_states for ep in ENDPOINTS}),
    a_sent=st.integers(0, len(SYSTEMS) - 1),
    a_cached_at=st.sampled_from(ENDPOINTS),
    b_asks=asked.filter(
        lambda r: r["model"] in ("m", "ma") and r["kind"] in ("chat", "completions")
    ),
)
def test_under_isolation_route_tells_a_tenant_nothing_of_anothers_prefixes(
    mode: tenancy.CacheIsolation,
    states: dict[str, dict[str, Any]],
    a_sent: int,
    a_cached_at: str,
    b_asks: dict[str, Any],
) -> None:
    """Whether tenant A sent a prefix (one of B's own, maybe) and its engine cached it, or
    A sent nothing with a prefix, B's /route answer is the same: its cached tokens are of
    its own salted prefixes, and neither prefix families nor the KV index's totals (every
    tenant's) are shown, nor counted in its ranking."""
    states = {ep: {**s, "ready": True} for ep, s in states.items()}
    with frozen_clocks():
        seen = asyncio.run(_b_sees(mode, states, a_sent, a_cached_at, b_asks))
        unseen = asyncio.run(_b_sees(mode, states, None, a_cached_at, b_asks))
    assert seen == unseen


async def _fallback_said() -> tuple[int, Any, str | None]:
    fleet = Fleet(route_kit.config("shared", {"e0": ("f",), "e1": ("f",), "e2": ("f",)}))
    for ep_id in ENDPOINTS:
        fleet.endpoint(ep_id).ready = ep_id != "e3"  # e3, `m`'s only endpoint, is down
    asked = body("chat", "ma", 0, "Q1?", None)
    status, said = await fleet.route(PATH_OF["chat"], asked, auth_headers("ka", None))
    _, went = await fleet.send(PATH_OF["chat"], asked, auth_headers("ka", None))
    return status, said, went


def test_route_names_the_fallback_model_a_request_for_a_model_without_endpoints_gets() -> None:
    with frozen_clocks():
        status, said, went = asyncio.run(_fallback_said())
    assert status == 200, said
    assert said["model"] == "m"
    assert said["chosen"] == {"endpoint": went, "model": "f"}
    assert {a["model"] for a in said["attempts"]} == {"f"}


async def _said_of(path: str) -> tuple[int, Any]:
    fleet = Fleet(route_kit.config("shared"))
    return await fleet.route(path, body("chat", "m", 0, "Q1?", None), auth_headers(None, None))


def test_route_refuses_a_path_the_front_door_does_not_serve_naming_those_it_does() -> None:
    status, said = asyncio.run(_said_of("/v1/chat"))
    assert status == 400
    assert "?path=/v1/chat is not a path the front door serves" in said["error"]
    assert "/v1/messages" in said["error"]


async def _cached_said() -> tuple[Any, str | None]:
    fleet = Fleet(route_kit.config("shared"))
    for ep_id in ENDPOINTS:
        fleet.endpoint(ep_id).ready = True
    asked = body("chat", "m", 0, "Q1?", None)
    fleet.cached("e2", requests.parse("chat", asked, want_text=True), None, 12)
    status, said = await fleet.route(PATH_OF["chat"], asked, auth_headers(None, None))
    assert status == 200, said
    _, went = await fleet.send(PATH_OF["chat"], asked, auth_headers(None, None))
    return said, went


def test_the_engines_reported_caches_count_in_these_scenarios() -> None:
    """The scenarios above compare answers that rank on the engines' KV events: those
    events must be fresh at the kit's moment (were they stale, every endpoint would hold
    nothing and the comparisons would pass without a cache in play)."""
    with frozen_clocks():
        said, went = asyncio.run(_cached_said())
    cached = {ep["id"]: ep["cached_tokens"] for ep in said["endpoints"]}
    assert 0 < cached["e2"] <= said["prompt_tokens"], cached
    assert {ep: n for ep, n in cached.items() if ep != "e2"} == {"e0": 0, "e1": 0, "e3": 0}
    assert said["chosen"]["endpoint"] == went == "e2"

"""The router's admin listener through its real handler (llmgw.router.admin): who may
call `/route`, what no web page may read, its paths and methods, and what `/route` says
of a request (llmgw.router.explain): the filters' drops, the cache each endpoint holds
and what it costs, the session's endpoint, skipped fallbacks, a refusal, and under cache
isolation nothing of other tenants' prefixes."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web

from llmgw.core.profile import Queueing
from llmgw.router import requests
from llmgw.router.config import Listener
from tests.unit import route_kit
from tests.unit.route_kit import ENDPOINTS, SECRETS, Fleet, auth_headers, frozen_clocks
from tests.unit.test_route_truth import PATH_OF, body
from tests.unit.test_router_cors import _raw_serving

CHAT = PATH_OF["chat"]


def _keyed() -> Fleet:
    """A router that serves only its keys' holders (no anonymous requests)."""
    cfg = route_kit.config("shared")
    keyed = msgspec.structs.replace(cfg.auth, allow_anonymous=False)
    return Fleet(msgspec.structs.replace(cfg, auth=keyed))


def _said(resp: web.Response) -> Any:
    assert isinstance(resp.body, bytes)
    return msgspec.json.decode(resp.body)


async def _keys_asked() -> list[tuple[str, int, Any]]:
    fleet = _keyed()
    asked = body("chat", "m", 0, "Q1?", None)
    out = []
    for who, authorization in (
        ("none", None), ("unknown", "Bearer sk-llmgw-not-a-key-0123456789abcdef"),
        ("basic", f"Basic {SECRETS['ka']}"), ("ka", f"Bearer {SECRETS['ka']}"),
    ):  # fmt: skip
        headers = {"Content-Type": "application/json"}
        if authorization is not None:
            headers["Authorization"] = authorization
        resp = await fleet.admin_answer("POST", f"/route?path={CHAT}", headers, asked)
        out.append((who, resp.status, _said(resp)))
    return out


def test_route_answers_only_a_key_the_front_door_would_serve() -> None:
    """Which prompts an engine holds is a tenant's secret: without a valid key, /route says
    nothing of any endpoint."""
    with frozen_clocks():
        answers = asyncio.run(_keys_asked())
    for who, status, said in answers[:-1]:
        assert status == 401, (who, said)
        assert set(said) == {"error"}, who
    who, status, said = answers[-1]
    assert (status, said["model"]) == (200, "m"), said


async def _paths() -> dict[tuple[str, str], web.Response]:
    fleet = Fleet(route_kit.config("shared"))
    plain = {"Host": "127.0.0.1:9090"}
    asked = [("GET", "/metrics"), ("HEAD", "/metrics"), ("GET", "/health"), ("HEAD", "/health"),
             ("GET", "/route"), ("DELETE", "/metrics"), ("GET", "/v1/models"),
             ("GET", "/")]  # fmt: skip
    return {(m, p): await fleet.admin_answer(m, p, plain) for m, p in asked}


def test_the_admin_listener_serves_its_three_paths_and_says_what_it_does_not() -> None:
    answers = asyncio.run(_paths())
    for asked in (("GET", "/metrics"), ("HEAD", "/metrics")):
        resp = answers[asked]
        assert resp.status == 200, asked
        assert resp.headers["Content-Type"] == "text/plain; version=0.0.4"  # Prometheus's
    assert b"# TYPE llmgw_router_requests_total counter" in answers[("GET", "/metrics")].body  # type: ignore[operator]
    assert _said(answers[("GET", "/health")]) == {"status": "ok"}
    assert answers[("HEAD", "/health")].status == 200
    for asked in (("GET", "/route"), ("DELETE", "/metrics")):
        assert answers[asked].status == 405, asked
        assert "does not take" in _said(answers[asked])["error"]
    for asked in (("GET", "/v1/models"), ("GET", "/")):
        assert answers[asked].status == 404, asked
        assert "/metrics, /health, /route" in _said(answers[asked])["error"]


async def _from_pages() -> list[tuple[str, int]]:
    fleet = Fleet(route_kit.config("shared"))
    asked = body("chat", "m", 0, "Q1?", None)
    out = []
    for path in ("/metrics", f"/route?path={CHAT}", "/health"):
        method = "POST" if path.startswith("/route") else "GET"
        for headers in ({"Host": "127.0.0.1:9090", "Origin": "https://evil.example"},
                        {"Host": "rebound.example:9090"}):  # fmt: skip
            resp = await fleet.admin_answer(method, path, headers, asked)
            out.append((f"{method} {path} {headers}", resp.status))
    return out


def test_no_web_page_reads_the_admin_listener() -> None:
    """A page of another site (its Origin) or a DNS name rebound to the loopback listener
    (its Host) gets a 403 on every path: metrics name keys, teams and models."""
    with frozen_clocks():
        answers = asyncio.run(_from_pages())
    assert [status for _, status in answers] == [403] * len(answers), answers


async def _late_body() -> web.Response:
    cfg = msgspec.structs.replace(route_kit.config("shared"), body_timeout_s=0.2)
    fleet = Fleet(cfg)
    headers = {"Content-Type": "application/json", "Content-Length": "100"}
    return await fleet.admin_answer("POST", f"/route?path={CHAT}", headers, b'{"mo', whole=False)


def test_a_route_body_that_stops_half_way_gets_408_and_the_connection_closes() -> None:
    resp = asyncio.run(_late_body())
    assert resp.status == 408
    assert resp.keep_alive is False  # the rest of that body may still come


async def _route(fleet: Fleet, asked: bytes, key: str | None, session: str | None) -> Any:
    resp = await fleet.admin_answer("POST", f"/route?path={CHAT}", auth_headers(key, session),
                                    asked)  # fmt: skip
    said = _said(resp)
    assert resp.status == 200, said
    return said


async def _shared_said() -> tuple[Any, Any, str | None]:
    fleet = Fleet(route_kit.config("shared"))
    for ep_id in ENDPOINTS:
        fleet.endpoint(ep_id).ready = ep_id != "e3"
    fleet.endpoint("e3").running, fleet.endpoint("e3").queue_depth = 2, 3
    asked = body("chat", "m", 0, "Q1?", None)
    fleet.cached("e2", requests.parse("chat", asked, want_text=True), None, 12)
    said = await _route(fleet, asked, "kc", None)
    _, went = await fleet.send(CHAT, asked, auth_headers(None, "s1"))
    again = await _route(fleet, asked, None, "s1")
    return said, again, went


def test_route_shows_each_endpoints_cache_cost_and_the_filters_drops() -> None:
    with frozen_clocks():
        said, again, went = asyncio.run(_shared_said())
    rows = {row["id"]: row for row in said["endpoints"]}
    assert set(rows) == set(ENDPOINTS)
    assert {ep: row["node"] for ep, row in rows.items()} == route_kit.NODES
    assert (rows["e3"]["load"], rows["e3"]["queue"], rows["e0"]["load"]) == (5, 3, 0)
    assert (rows["e2"]["source"], rows["e0"]["source"]) == ("events", "none")
    assert rows["e2"]["cached_tokens"] > 0
    assert sum(said["filtered_out"].values()) == 1  # e3, not ready
    assert "cost_tokens" not in rows["e3"]
    costs = {ep: rows[ep]["cost_tokens"] for ep in ("e0", "e1", "e2")}
    assert costs["e2"] < costs["e0"] == costs["e1"]  # what e2 holds is not computed again
    assert rows["e2"]["cached_tokens_counted"] > 0
    assert all("prefix_families" in row for row in rows.values())  # shared: every tenant's
    assert "index" in said
    assert said["fallbacks_skipped"] == ["f"]  # kc may not use `f`
    assert "session_endpoint" not in said
    assert said["order"][0] == said["chosen"]["endpoint"]
    assert sorted(said["order"]) == ["e0", "e1", "e2"]  # every ready one, in turn
    assert again["session_endpoint"] == went
    assert "fallbacks_skipped" not in again


async def _isolated_said() -> Any:
    fleet = Fleet(route_kit.config("team"))
    for ep_id in ENDPOINTS:
        fleet.endpoint(ep_id).ready = True
    return await _route(fleet, body("chat", "m", 0, "Q1?", None), "ka", None)


def test_under_isolation_route_shows_no_count_of_every_tenants_prefixes() -> None:
    with frozen_clocks():
        said = asyncio.run(_isolated_said())
    assert said["endpoints"]
    assert not any("prefix_families" in row for row in said["endpoints"])
    assert "index" not in said


async def _nowhere_said() -> Any:
    fleet = Fleet(route_kit.config("shared", {ep: ("m",) for ep in ENDPOINTS}))
    for ep_id in ENDPOINTS:
        fleet.endpoint(ep_id).ready = False
    return await _route(fleet, body("chat", "m", 0, "Q1?", None), "ka", None)


def test_route_says_why_a_request_would_be_refused_when_no_endpoint_would_take_it() -> None:
    with frozen_clocks():
        said = asyncio.run(_nowhere_said())
    assert (said["chosen"], said["order"]) == (None, [])
    assert said["refused"]


@pytest.mark.parametrize("session", [None, "s1"])
def test_route_for_a_model_ranked_by_weights_names_the_sessions_endpoint(
    session: str | None,
) -> None:
    async def said_and_went() -> tuple[Any, str | None]:
        fleet = Fleet(route_kit.config("shared"))
        for ep_id in ENDPOINTS:
            fleet.endpoint(ep_id).ready = True
        asked = body("chat", "w", 0, "Q1?", None)
        _, went = await fleet.send(CHAT, asked, auth_headers("ka", "s1"))
        return await _route(fleet, asked, "ka", session), went

    with frozen_clocks():
        said, went = asyncio.run(said_and_went())
    assert said["tokenized"] is False
    flagged = [row["id"] for row in said["endpoints"] if row["session"]]
    assert flagged == ([went] if session else [])
    held = {row["id"]: row["prefix_blocks_held"] for row in said["endpoints"]}
    assert held[went] > 0  # the prompt it was just sent, in the approximate index
    assert [n for ep, n in held.items() if ep != went] == [0] * (len(ENDPOINTS) - 1)


async def _refusals() -> dict[str, tuple[int, Any]]:
    fleet = Fleet(route_kit.config("shared"))
    out = {}
    for what, key, asked in (
        ("other model's key", "kc", body("chat", "f", 0, "Q1?", None)),
        ("unknown model", "ka", body("chat", "nope", 0, "Q1?", None)),
    ):
        resp = await fleet.admin_answer("POST", f"/route?path={CHAT}", auth_headers(key, None),
                                        asked)  # fmt: skip
        out[what] = (resp.status, _said(resp))
    return out


def test_route_refuses_as_the_front_door_would_with_its_status() -> None:
    with frozen_clocks():
        said = asyncio.run(_refusals())
    # A model the key may not use is answered as one that does not exist, on /route too.
    assert said["other model's key"][0] == 404, said
    assert said["unknown model"][0] == 404, said
    assert said["other model's key"][1]["error"] == said["unknown model"][1]["error"].replace(
        "'nope'", "'f'"
    ), said
    assert all(set(answer) == {"error"} for _, answer in said.values())


@pytest.mark.parametrize(("kind", "path"), [("chat", "/v1/chat/completions"),
                                            ("completions", "/v1/completions"),
                                            ("responses", "/v1/responses")])  # fmt: skip
def test_route_without_a_path_takes_the_api_the_bodys_shape_names(kind: str, path: str) -> None:
    async def said() -> Any:
        fleet = Fleet(route_kit.config("shared"))
        for ep_id in ENDPOINTS:
            fleet.endpoint(ep_id).ready = True
        asked = body(kind, "m", 0, "Q1?", None)  # type: ignore[arg-type]
        resp = await fleet.admin_answer("POST", "/route", auth_headers("ka", None), asked)
        return resp.status, _said(resp)

    with frozen_clocks():
        status, answer = asyncio.run(said())
    assert (status, answer["path"]) == (200, path), answer
    assert answer["chosen"] is not None


async def _queued_said(full: tuple[str, ...]) -> Any:
    cfg = route_kit.config("shared")
    capped = msgspec.structs.replace(route_kit.MODELS[0],
                                     queue=Queueing(max_inflight_per_endpoint=1))  # fmt: skip
    fleet = Fleet(msgspec.structs.replace(cfg, models=(capped, *route_kit.MODELS[1:])))
    for ep_id in ENDPOINTS:
        fleet.endpoint(ep_id).ready = True
        fleet.endpoint(ep_id).inflight = 1 if ep_id in full else 0
    return await _route(fleet, body("chat", "m", 0, "Q1?", None), "ka", None)


def test_route_says_which_endpoints_have_room_and_when_a_request_would_wait() -> None:
    """A model whose profile bounds each endpoint's requests in flight: the endpoints at
    the bound have no room, and with none left a request would wait in the queue."""
    with frozen_clocks():
        some = asyncio.run(_queued_said(("e0", "e1")))
        none = asyncio.run(_queued_said(ENDPOINTS))
    assert {row["id"]: row["has_room"] for row in some["endpoints"]} == {
        "e0": False, "e1": False, "e2": True, "e3": True,
    }  # fmt: skip
    assert "waits" not in some
    assert not any(row["has_room"] for row in none["endpoints"])
    assert "waits" in none


async def _hosts_answered(listen: str, admin_host: str) -> list[int]:
    cfg = route_kit.config("shared")
    fleet = Fleet(msgspec.structs.replace(
        cfg, listen=Listener(host=listen, port=8080), admin=Listener(host=admin_host, port=9090)
    ))  # fmt: skip
    out = []
    for host in ("127.0.0.1:9090", "rebound.example:9090", "router-1.internal:9090"):
        resp = await fleet.admin_answer("GET", "/metrics", {"Host": host})
        out.append(resp.status)
    return out


def test_the_admin_listeners_host_check_follows_its_own_address_not_the_front_doors() -> None:
    """The front door on every interface and the admin listener on loopback: a rebound
    name still gets a 403 there. The other way round, the admin listener on every
    interface is scraped by whatever name reaches it."""
    assert asyncio.run(_hosts_answered("0.0.0.0", "127.0.0.1")) == [200, 403, 403]
    assert asyncio.run(_hosts_answered("127.0.0.1", "0.0.0.0")) == [200, 200, 200]


async def _sized_answers(limit: int, sizes: tuple[int, ...]) -> list[int]:
    """/route's status, over a real socket, for chat bodies of about each of `sizes`."""
    fleet = Fleet(msgspec.structs.replace(route_kit.config("shared"), max_body_bytes=limit))
    statuses = []
    async with (
        _raw_serving(fleet.admin) as port,
        aiohttp.ClientSession(f"http://127.0.0.1:{port}") as client,
    ):
        for size in sizes:
            asked = body("chat", "m", 0, "x" * size, None)
            async with client.post(f"/route?path={CHAT}", data=asked,
                                   headers=auth_headers("ka", None)) as resp:  # fmt: skip
                statuses.append(resp.status)
    return statuses


def test_route_takes_the_bodies_the_front_door_takes_and_refuses_larger_ones() -> None:
    """An operator asks where a client's request went with the very body it sent: up to
    `max_body_bytes`, beyond aiohttp's own 1 MiB default."""
    limit = 3 * 1024 * 1024
    assert asyncio.run(_sized_answers(limit, (2 * 1024 * 1024, limit + 1))) == [200, 413]

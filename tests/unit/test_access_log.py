"""The access log's line names where a request went: the endpoint and node of its last
attempt, how many endpoints it was sent to, the fallback model that served it and the
prompt tokens predicted cached there.

A router in-process (tests/unit/route_kit.py) whose attempts record where they went, some
endpoints failing as a 503 would, over generated fleets and bodies of every API it routes;
the prediction is checked against what `POST /route` says each endpoint holds.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from llmgw.router import config as router_config
from llmgw.router import requests
from llmgw.router.attempts import Attempt
from llmgw.router.config import RouterConfig
from llmgw.router.errors import Retry
from llmgw.router.relay import ClientStream
from tests.unit import route_kit
from tests.unit.route_kit import ENDPOINTS, NODES, Fleet, auth_headers, frozen_clocks
from tests.unit.test_route_truth import KINDS, PATH_OF, SYSTEMS, body
from tests.unit.test_route_truth import served as models_served

CANONICAL = {"m": "m", "ma": "m", "f": "f", "w": "w"}


class FailingFleet(Fleet):
    """A fleet whose endpoints in `failing` answer every attempt 503."""

    def __init__(self, cfg: RouterConfig, failing: set[str]) -> None:
        super().__init__(cfg)
        self.failing = failing

    async def _attempt(self, at: Attempt, body: bytes, state: ClientStream) -> web.StreamResponse:
        resp = await super()._attempt(at, body, state)
        if at.endpoint.id in self.failing:
            raise Retry("status_503", 503, "engine answered 503")
        return resp


async def _sent(
    cfg: RouterConfig,
    failing: set[str],
    ready: dict[str, bool],
    cached: dict[str, int],
    asked: dict[str, Any],
) -> tuple[FailingFleet, Any, list[dict[str, Any]]]:
    """What /route says of the request `asked`, then the access log's lines of sending it."""
    with capture_logs() as logged:
        fleet = FailingFleet(cfg, failing)
        for ep_id, is_ready in ready.items():
            fleet.endpoint(ep_id).ready = is_ready
        prompt = body("chat", "m", asked["system"], "", None)
        for ep_id, blocks in cached.items():
            fleet.cached(ep_id, requests.parse("chat", prompt, want_text=True), None, blocks)
        kind = asked["kind"]
        sent = body(kind, asked["model"], asked["system"], asked["user"], None)
        headers = auth_headers(asked["key"], None)
        _, said = await fleet.route(PATH_OF[kind], sent, headers)
        await fleet.send(PATH_OF[kind], sent, headers)
    return fleet, said, [line for line in logged if line["event"] == "request"]


def _predicted(said: Any, endpoint: str, model: str) -> int | None:
    """The cached tokens /route said `endpoint` holds, where it ranked `model` on them."""
    if said.get("model") != model or not said.get("tokenized"):
        return None
    row = next(r for r in said["endpoints"] if r["id"] == endpoint)
    cached: int = row["cached_tokens"]
    return cached


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    failing=st.sets(st.sampled_from(ENDPOINTS)),
    ready=st.fixed_dictionaries({ep: st.booleans() for ep in ENDPOINTS}),
    cached=st.dictionaries(st.sampled_from(ENDPOINTS), st.integers(1, 12), max_size=3),
    served=st.fixed_dictionaries({ep: models_served for ep in ENDPOINTS}),
    asked=st.fixed_dictionaries(
        {
            "kind": st.sampled_from(KINDS),
            "model": st.sampled_from(sorted(CANONICAL)),
            "system": st.integers(0, len(SYSTEMS) - 1),
            "user": st.sampled_from(["Q1?", "x" * 300]),
            "key": st.sampled_from([None, "ka"]),
        }
    ),
)
def test_the_access_log_names_the_last_attempts_endpoint_node_model_and_count(
    failing: set[str],
    ready: dict[str, bool],
    cached: dict[str, int],
    served: dict[str, list[str]],
    asked: dict[str, Any],
) -> None:
    fleet_served = {ep: tuple(models) for ep, models in served.items()}
    cfg = msgspec.structs.replace(route_kit.config("shared", fleet_served), access_log=True)
    with frozen_clocks():
        fleet, said, lines = asyncio.run(_sent(cfg, failing, ready, cached, asked))
    assert len(lines) == 1, lines
    line = lines[0]
    assert line["log_level"] == "info"
    assert line["api"] == asked["kind"]
    assert line["attempts"] == len(fleet.attempts)
    if not fleet.attempts:
        assert (line["endpoint"], line["node"], line["served_model"]) == (None, None, None)
        assert line["predicted_cached"] is None
        return
    endpoint, model = fleet.attempts[-1]
    asked_model = CANONICAL[asked["model"]]
    assert line["model"] == asked_model
    assert line["key"] == asked["key"]
    assert line["endpoint"] == endpoint
    assert line["node"] == NODES[endpoint]
    assert line["served_model"] == (model if model != asked_model else None)
    assert line["predicted_cached"] == _predicted(said, endpoint, model)
    assert line["status"] == (200 if endpoint not in failing else 503)


def test_an_access_log_hidden_by_the_log_level_is_refused_saying_what_to_change() -> None:
    cfg = RouterConfig(access_log=True, log_level="warning")
    problems = router_config.validate(cfg)
    assert any(
        "access_log writes at info, which log_level 'warning' hides" in p
        and "set log_level to info, or access_log to false" in p
        for p in problems
    ), problems
    assert not [p for p in router_config.validate(RouterConfig(access_log=True)) if "access" in p]


async def _refused_lines(cfg: RouterConfig) -> list[dict[str, Any]]:
    """The access log's lines of key `kc` (which may use only `m`) asking for `f`, and
    sending a body that is not JSON."""
    with capture_logs() as logged:
        fleet = Fleet(cfg)
        asked = body("chat", "f", 0, "Q1?", None)
        assert (await fleet.send(PATH_OF["chat"], asked, auth_headers("kc", None)))[0] == 404
        assert (await fleet.send(PATH_OF["chat"], b"{", auth_headers("kc", None)))[0] == 400
    return [line for line in logged if line["event"] == "request"]


def test_the_access_log_names_the_key_of_a_request_refused_after_authentication() -> None:
    """Who asked for a model it may not use, or sent a broken body, is what an operator
    reads the access log for."""
    cfg = msgspec.structs.replace(route_kit.config("shared"), access_log=True)
    with frozen_clocks():
        lines = asyncio.run(_refused_lines(cfg))
    assert [(line["status"], line["key"]) for line in lines] == [(404, "kc"), (400, "kc")]

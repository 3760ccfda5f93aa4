"""Through a real router and real `llmgw sim` engines: the replica a request lands on is
the one the admin listener's `POST /route` named for the same body just before.

The router reports where each attempt went (`llmgw_router_endpoint_requests_total`, per
endpoint); between /route and the request nothing else reaches the router. Its probes are
spaced an hour apart (the engines' load it saw at start stays what it routes on) and its
recent routes last as long, so what /route saw is what the request meets.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from llmgw.router import auth
from tests.integration.router_kit import Router, Sim

pytestmark = pytest.mark.slow

KEYS = {"alice": auth.new_key(), "bob": auth.new_key()}
SYSTEMS = (
    "You are a careful assistant who answers questions about GPU fleets. " * 8,
    "Answer in French, briefly, and never invent a number you were not given. " * 8,
)


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    sims = {f"e{i}": Sim.start("m") for i in range(3)}
    tmp = tmp_path_factory.mktemp("route-truth")
    keys = tmp / "keys.yaml"
    keys.write_text("keys:\n" + "".join(auth.entry_yaml(n, k) for n, k in KEYS.items()))
    r = Router.start(tmp, dict(sims), models=[{"name": "m", "engine": "sim"}],
                     auth={"keys_file": str(keys)}, tenancy={"cache_isolation": "key"},
                     cache={"recent_s": 3600.0}, probe_interval_s=3600.0)  # fmt: skip
    yield r
    r.stop()
    for sim in sims.values():
        sim.stop()


def _post(url: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    sent = {"Content-Type": "application/json", **headers}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=sent, method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        answer: dict[str, Any] = json.loads(r.read())
    return answer


def _body(path: str, system: str, question: str) -> dict[str, Any]:
    if path == "/v1/chat/completions":
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return {"model": "m", "max_tokens": 4, "messages": messages}
    if path == "/v1/messages":
        return {"model": "m", "max_tokens": 4, "system": system,
                "messages": [{"role": "user", "content": question}]}  # fmt: skip
    if path == "/v1/responses":
        return {"model": "m", "max_output_tokens": 4, "input": system + question}
    return {"model": "m", "max_tokens": 4, "prompt": system + question}


PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")


def test_a_request_lands_where_route_said_it_would(router: Router) -> None:
    said_where: list[str] = []
    for i in range(16):
        path = PATHS[i % len(PATHS)]
        body = _body(path, SYSTEMS[i % 2 if i < 8 else (i // 2) % 2], f"Question {i}?")
        headers = {"Authorization": f"Bearer {KEYS['alice' if i % 3 else 'bob']}"}
        if i % 5 == 0:
            headers["x-session-id"] = f"conversation-{i % 2}"
        said = _post(f"{router.admin}/route?path={path}", body, headers)
        chosen = said["chosen"]
        assert chosen is not None, said
        before = router.endpoint_requests()
        _post(router.url + path, body, headers)
        after = router.endpoint_requests()
        went = [ep for ep, n in after.items() if n > before.get(ep, 0)]
        assert went == [chosen["endpoint"]], (i, path, said)
        said_where.append(chosen["endpoint"])
    # The prompts of one tenant and one prefix were kept together by the cache: not a
    # fleet where every answer was the same endpoint by default.
    assert len(set(said_where)) >= 2, said_where

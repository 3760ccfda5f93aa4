"""A router that serves without keys refuses web pages (llmgw.router.browsers): a page of
another site (its `Origin`) and a DNS name rebound to 127.0.0.1 (its `Host`) get a 403
before any engine sees the request; curl and the SDKs, which send neither, are served as
before, and so is every request with a key. Real router processes, a recording engine."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest

from llmgw.router import auth
from tests.integration.router_kit import Router
from tests.integration.test_router_features import RecordingEngine

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]})
# What a page's form or fetch() can send without the browser asking first.
SIMPLE = {"Content-Type": "text/plain"}


@pytest.fixture(scope="module")
def engine() -> Iterator[RecordingEngine]:
    e = RecordingEngine()
    yield e
    e.stop()


@pytest.fixture(scope="module")
def anonymous(
    tmp_path_factory: pytest.TempPathFactory, engine: RecordingEngine
) -> Iterator[Router]:
    """Started as every anonymous router of these tests is, on 127.0.0.1."""
    r = Router.start(tmp_path_factory.mktemp("browsers"), {"e": engine.url})
    yield r
    r.stop()


@pytest.fixture(scope="module")
def listing(tmp_path_factory: pytest.TempPathFactory, engine: RecordingEngine) -> Iterator[Router]:
    """An anonymous router that lets one origin's pages and one more name in."""
    r = Router.start(
        tmp_path_factory.mktemp("browsers-listing"),
        {"e": engine.url},
        auth={"allow_anonymous": True, "allowed_origins": ["https://app.example"],
              "allowed_hosts": ["LLM.example.internal"]},
    )  # fmt: skip
    yield r
    r.stop()


def _port(router: Router) -> str:
    return router.url.rsplit(":", 1)[1]


def _send(
    router: Router, engine: RecordingEngine, headers: dict[str, str], path: str = CHAT
) -> tuple[httpx.Response, int]:
    """The router's answer to a request (a GET for /v1/models, else a POST of BODY), and
    how many requests the engine got meanwhile."""
    before = len(engine.bodies)
    with httpx.Client(base_url=router.url, timeout=10) as h:
        if path == "/v1/models":
            r = h.get(path, headers=headers)
        else:
            r = h.post(path, content=BODY, headers=headers)
    return r, len(engine.bodies) - before


@pytest.mark.parametrize("origin", ["https://evil.example", "null", "http://127.0.0.1:1"])
def test_a_page_of_another_origin_is_refused_before_any_engine(
    anonymous: Router, engine: RecordingEngine, origin: str
) -> None:
    """A "simple" POST, which a browser sends from any page without a preflight: it spent
    the fleet's GPUs (and drove a model's tools) for whoever the operator's browser
    visited."""
    r, seen = _send(anonymous, engine, {**SIMPLE, "Origin": origin})
    assert r.status_code == 403, r.text
    error = r.json()["error"]
    assert error["code"] == "origin_not_allowed"
    assert "auth.allowed_origins" in error["message"]
    assert seen == 0


def test_the_refusal_is_in_the_apis_own_shape(anonymous: Router, engine: RecordingEngine) -> None:
    page = {**SIMPLE, "Origin": "https://evil.example"}
    r, seen = _send(anonymous, engine, page, "/v1/messages")
    assert r.status_code == 403, r.text
    assert r.json()["type"] == "error"  # Anthropic's
    assert r.json()["error"]["type"] == "permission_error"
    assert seen == 0


@pytest.mark.parametrize("path", [CHAT, "/v1/models"])
def test_a_rebound_name_is_refused(anonymous: Router, engine: RecordingEngine, path: str) -> None:
    """A page whose name resolves to 127.0.0.1 once loaded is the router's own origin to the
    browser, which then lets it read the answers (the models, a completion)."""
    r, seen = _send(anonymous, engine, {"Host": f"rebind.evil.example:{_port(anonymous)}"}, path)
    assert r.status_code == 403, r.text
    assert r.json()["error"]["code"] == "host_not_allowed"
    assert "auth.allowed_hosts" in r.json()["error"]["message"]
    assert seen == 0


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "LOCALHOST", None])
def test_clients_that_are_no_web_page_are_served(
    anonymous: Router, engine: RecordingEngine, host: str | None
) -> None:
    """No Origin, a loopback Host with the port (None: the one httpx writes, 127.0.0.1):
    as curl and the SDKs send; the body's content type is not what is refused."""
    headers = dict(SIMPLE)
    if host is not None:
        headers["Host"] = f"{host}:{_port(anonymous)}"
    r, seen = _send(anonymous, engine, headers)
    assert r.status_code == 200, r.text
    assert seen == 1


def test_listed_origins_and_hosts_are_served_and_no_other(
    listing: Router, engine: RecordingEngine
) -> None:
    port = _port(listing)
    served = [{"Origin": "https://app.example"}, {"Host": f"llm.example.internal:{port}"},
              {"Host": "llm.EXAMPLE.internal"}, {"Host": f"[::1]:{port}"}]  # fmt: skip
    for headers in served:
        r, seen = _send(listing, engine, {**SIMPLE, **headers})
        assert (r.status_code, seen) == (200, 1), (headers, r.text)
    refused = [{"Origin": "https://app.example.evil"}, {"Origin": "https://app.example/"},
               {"Host": f"other.example.internal:{port}"}]  # fmt: skip
    for headers in refused:
        r, seen = _send(listing, engine, {**SIMPLE, **headers})
        assert (r.status_code, seen) == (403, 0), (headers, r.text)


def test_a_request_with_a_key_is_its_keys(
    tmp_path: Path, procs: list[Router], engine: RecordingEngine
) -> None:
    """A browser attaches no bearer key on its own: a keyed router answers as before, the
    key decides whatever the Origin and Host."""
    key = auth.new_key()
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n" + auth.entry_yaml("k", key))
    keyed = Router.start(tmp_path, {"e": engine.url}, auth={"keys_file": str(keys)})
    procs.append(keyed)
    page = {**SIMPLE, "Origin": "https://evil.example",
            "Host": f"rebind.evil.example:{_port(keyed)}"}  # fmt: skip
    r, seen = _send(keyed, engine, {**page, "Authorization": f"Bearer {key}"})
    assert (r.status_code, seen) == (200, 1), r.text
    r, seen = _send(keyed, engine, page)
    assert (r.status_code, seen) == (401, 0), r.text
    assert r.json()["error"]["code"] == "missing_api_key"


@pytest.mark.parametrize("path", ["/metrics", "/route"])
@pytest.mark.parametrize(
    "page", [{"Origin": "https://evil.example"}, {"Host": "rebind.evil.example:9090"}]
)
def test_no_page_reads_the_admin_listener(
    anonymous: Router, path: str, page: dict[str, str]
) -> None:
    """The admin listener (loopback here, as by default) names keys, teams and models in
    its metrics, and `/route` tells what a prompt would find cached where: a page of
    another site, or one whose name was rebound to 127.0.0.1, must read neither.
    Prometheus and curl, which send no Origin and a loopback Host, still do."""
    with httpx.Client(base_url=anonymous.admin, timeout=10) as h:
        if path == "/metrics":
            refused, served = h.get(path, headers=page), h.get(path)
        else:
            refused = h.post(path, content=BODY, headers={**SIMPLE, **page})
            served = h.post(path, content=BODY)
    assert refused.status_code == 403, refused.text
    assert "auth.allowed_" in refused.json()["error"]
    assert served.status_code == 200, served.text

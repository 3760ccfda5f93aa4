"""CORS for listed origins against real routers and a sim engine (llmgw.router.cors): a
listed origin's preflight is answered without a key and reaches no engine nor limit, and
its answers (streams, errors, a key's 429) name it and expose what clients read; an
unlisted origin gets no CORS header, and without a key still gets the 403."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest

from llmgw.router import auth
from tests.integration.router_kit import Router, Sim

pytestmark = pytest.mark.slow

APP = "http://127.0.0.1:5173"
OTHER = "https://evil.example"
CHAT = "/v1/chat/completions"
STREAM = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
KEY = auth.new_key()
LIMITED = auth.new_key()
SUCCESS = "vllm:request_success_total"


@pytest.fixture(scope="module")
def sim() -> Iterator[Sim]:
    s = Sim.start("m")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def anonymous(tmp_path_factory: pytest.TempPathFactory, sim: Sim) -> Iterator[Router]:
    r = Router.start(tmp_path_factory.mktemp("cors"), {"e": sim},
                     auth={"allow_anonymous": True, "allowed_origins": [APP]})  # fmt: skip
    yield r
    r.stop()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, sim: Sim) -> Iterator[Router]:
    tmp = tmp_path_factory.mktemp("cors-keyed")
    keys = tmp / "keys.yaml"
    limited = auth.entry_yaml("limited", LIMITED) + "    requests_per_s: 0.02\n"
    keys.write_text("keys:\n" + auth.entry_yaml("k", KEY) + limited)
    r = Router.start(tmp, {"e": sim}, auth={"keys_file": str(keys), "allowed_origins": [APP]})
    yield r
    r.stop()


def _cors(r: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in r.headers.items() if k.lower().startswith("access-control-")}


def _listed(r: httpx.Response) -> None:
    """The headers every answer to the listed origin carries."""
    assert r.headers["access-control-allow-origin"] == APP, r.headers
    assert r.headers["vary"] == "Origin"
    exposed = r.headers["access-control-expose-headers"]
    assert "X-Request-Id" in exposed
    assert "Retry-After" in exposed


def _stream(router: Router, headers: dict[str, str]) -> httpx.Response:
    with httpx.Client(base_url=router.url, timeout=30) as h:
        return h.post(CHAT, json=STREAM, headers=headers)


@pytest.mark.parametrize("which", ["anonymous", "keyed"])
def test_a_listed_origins_preflight_needs_no_key_and_reaches_nothing(
    which: str, request: pytest.FixtureRequest, sim: Sim
) -> None:
    router: Router = request.getfixturevalue(which)
    before = sim.metrics()["vllm:num_requests_running"] + sim.metrics()[SUCCESS]
    asked = "authorization,content-type,x-stainless-os"
    preflight = {"Origin": APP, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": asked}  # fmt: skip
    with httpx.Client(base_url=router.url, timeout=10) as h:
        r = h.options(CHAT, headers=preflight)
        assert r.status_code == 204, r.text
        _listed(r)
        assert r.headers["access-control-allow-methods"] == "POST"
        assert (
            r.headers["access-control-allow-headers"]
            == "authorization, content-type, x-stainless-os"
        )
        huge = {**preflight, "Access-Control-Request-Headers": "x-a," * 2000}
        r = h.options(CHAT, headers=huge)
        assert r.status_code == 400, r.text
        assert len(r.text) < 500
        r = h.options(CHAT, headers={**preflight, "Origin": OTHER})
        assert r.status_code == 403, r.text
        assert not _cors(r), r.headers
    assert not any(k.startswith("llmgw_router_requests_total") for k in router.metrics())
    assert sim.metrics()["vllm:num_requests_running"] + sim.metrics()[SUCCESS] == before


@pytest.mark.parametrize(("which", "key"), [("anonymous", None), ("keyed", KEY)],
                         ids=["anonymous", "keyed"])  # fmt: skip
def test_a_listed_origin_reads_a_stream_and_its_errors(
    which: str, key: str | None, request: pytest.FixtureRequest
) -> None:
    router: Router = request.getfixturevalue(which)
    headers = {"Origin": APP}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    r = _stream(router, headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.text.rstrip().endswith("data: [DONE]")
    _listed(r)
    with httpx.Client(base_url=router.url, timeout=10) as h:
        r = h.post(CHAT, json={**STREAM, "model": "nope"}, headers=headers)
        assert r.status_code == 404, r.text
        _listed(r)
        r = h.get("/v1/models", headers=headers)
        assert r.status_code == 200, r.text
        assert r.json()["data"]
        _listed(r)


@pytest.mark.parametrize(("which", "key"), [("anonymous", None), ("keyed", KEY)],
                         ids=["anonymous", "keyed"])  # fmt: skip
def test_an_unlisted_origin_gets_no_cors_headers(
    which: str, key: str | None, request: pytest.FixtureRequest
) -> None:
    """With a key it is served (a key is its key's) yet its page cannot read the answer;
    without one it is refused as before."""
    router: Router = request.getfixturevalue(which)
    headers = {"Origin": OTHER}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    r = _stream(router, headers)
    assert r.status_code == (200 if key else 403), r.text
    assert not _cors(r), r.headers
    r = _stream(router, {})  # no Origin: curl and the SDKs, as before
    assert (r.status_code, _cors(r)) == ((401, {}) if which == "keyed" else (200, {}))


def test_a_keys_refusals_reach_the_page_with_their_headers(keyed: Router, tmp_path: Path) -> None:
    """Without a key (401) and past a key's limit (429, Retry-After, x-ratelimit-*): the
    page reads why, and when to come back."""
    r = _stream(keyed, {"Origin": APP})
    assert r.status_code == 401, r.text
    _listed(r)
    limited = {"Origin": APP, "Authorization": f"Bearer {LIMITED}"}
    statuses = [_stream(keyed, limited) for _ in range(3)]
    refused = [r for r in statuses if r.status_code == 429]
    assert refused, [r.status_code for r in statuses]
    _listed(refused[0])
    assert "retry-after" in refused[0].headers
    exposed = refused[0].headers["access-control-expose-headers"]
    assert all(name in exposed for name in refused[0].headers if name.startswith("x-ratelimit-"))

"""What one tenant's key can and cannot do through a real router and real `llmgw sim`
engines: the tokens it is charged with however its requests end, what it learns of models
it may not use, and when a 429 tells it to come back."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest

from llmgw.router import auth
from tests.integration.router_kit import Router, Sim

pytestmark = pytest.mark.slow

LIMITED = auth.new_key()
"""May use `m` only."""
OPEN = auth.new_key()
"""May use every model, without limits."""
METERED = auth.new_key()
"""May use `m`, 60 tokens a minute."""
RATED = auth.new_key()
"""May use `m`, a request a second."""


@pytest.fixture(scope="module")
def sims() -> Iterator[dict[str, Sim]]:
    # Answers longer than any request here asks for: a stream ends at its max_tokens.
    started = {
        "em": Sim.start("m", "--eos-min-tokens", "1000", "--eos-max-tokens", "1000"),
        "es": Sim.start("secret"),
    }
    yield started
    for sim in started.values():
        sim.stop()


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory, sims: dict[str, Sim]) -> Iterator[Router]:
    tmp: Path = tmp_path_factory.mktemp("router-tenants")
    keys = tmp / "keys.yaml"
    keys.write_text(
        "keys:\n"
        f"  - {{name: limited, sha256: {auth.digest(LIMITED)}, models: [m]}}\n"
        f"  - {{name: open, sha256: {auth.digest(OPEN)}}}\n"
        f"  - {{name: metered, sha256: {auth.digest(METERED)}, tokens_per_min: 60}}\n"
        f"  - {{name: rated, sha256: {auth.digest(RATED)}, models: [m], requests_per_s: 1}}\n"
    )
    r = Router.start(
        tmp,
        dict(sims),
        models=[{"name": "m"}, {"name": "secret"}],
        endpoint_models={"em": ["m"], "es": ["secret"]},
        auth={"keys_file": str(keys)},
    )
    yield r
    r.stop()


def key_tokens(router: Router, key: str, direction: str) -> float:
    line = f'llmgw_router_key_tokens_total{{direction="{direction}",key="{key}",model="m",team=""}}'
    return router.metrics().get(line, 0.0)


def wait_for_tokens(router: Router, key: str, direction: str, least: float) -> float:
    """The key's counted tokens once they reach `least` (or what they are after 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        got = key_tokens(router, key, direction)
        if got >= least or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def read_events(router: Router, key: str, body: dict[str, object], events: int) -> bytes:
    """Send a streamed request, read until `events` data events came, then hang up."""
    host, port = router.url.split("//")[1].split(":")
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode()
    got = b""
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head + data)
        while got.count(b"data:") < events:
            chunk = s.recv(65536)
            assert chunk, f"the stream ended after {got.count(b'data:')} events"
            got += chunk
    return got


@pytest.mark.parametrize("fault", ["stall_at", "die_mid_stream"])
def test_a_stream_cut_before_its_usage_is_still_charged_for_what_it_relayed(
    router: Router, sims: dict[str, Sim], fault: str
) -> None:
    """The engine's usage comes in the stream's last chunk: a client that reads all but the
    end and hangs up (or a stream the engine breaks off) still pays for the tokens it got,
    and for its prompt."""
    tokens = 40
    plan = {"stall_at": "mid_stream"} if fault == "stall_at" else {"die_mid_stream": True}
    sims["em"].faults(**plan, after_tokens=tokens, count=1)
    before_in = key_tokens(router, "limited", "in")
    before_out = key_tokens(router, "limited", "out")
    prompt = "tell me everything " * 40
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "stream": True,
            "max_tokens": 500}  # fmt: skip
    got = read_events(router, LIMITED, body, tokens)
    assert b'"usage"' not in got
    out = wait_for_tokens(router, "limited", "out", before_out + tokens)
    assert out - before_out >= tokens
    # The prompt: about a token per four characters of its text, as an estimate.
    assert key_tokens(router, "limited", "in") - before_in >= len(prompt) // 5
    sims["em"].clear_faults()


def test_a_rerank_whose_engine_reports_only_total_tokens_is_charged_for_them(
    router: Router,
) -> None:
    """vLLM's rerank (and the sim's) reports `usage: {"total_tokens": N}` alone: it took N
    prompt tokens, not none."""
    before = key_tokens(router, "limited", "in")
    body = {"model": "m", "query": "which one " * 20, "documents": ["a long document " * 50] * 4}
    with httpx.Client(base_url=router.url, timeout=30) as c:
        resp = c.post("/v1/rerank", json=body, headers={"Authorization": f"Bearer {LIMITED}"})
    assert resp.status_code == 200, resp.text
    total = resp.json()["usage"]["total_tokens"]
    assert total > 0
    assert wait_for_tokens(router, "limited", "in", before + total) - before == total


def test_ready_names_only_the_models_the_caller_may_use(router: Router) -> None:
    """`GET /v1/models/{id}` answers the same 404 whether a model does not exist or the key
    may not see it; /ready, which a load balancer polls without a key, listed every model's
    name to anyone. Its status still says whether the router serves at all."""
    with httpx.Client(base_url=router.url, timeout=10) as c:
        keyless = c.get("/ready")
        limited = c.get("/ready", headers={"Authorization": f"Bearer {LIMITED}"})
        everything = c.get("/ready", headers={"x-api-key": OPEN})
        wrong = c.get("/ready", headers={"Authorization": "Bearer not-a-key"})
    for resp in (keyless, limited, everything, wrong):
        assert resp.status_code == 200
        assert resp.json()["ready"] is True
    assert keyless.json()["ready_endpoints"] == {}
    assert wrong.json()["ready_endpoints"] == {}
    assert limited.json()["ready_endpoints"] == {"m": 1}
    assert everything.json()["ready_endpoints"] == {"m": 1, "secret": 1}


def test_a_429_for_tokens_says_when_the_keys_tokens_are_back(router: Router) -> None:
    """A keys file's key of 60 tokens a minute: a request asking for more than that is told
    what to lower; one that fits holds what it may cost, so the next one at once is refused
    with a Retry-After of when the bucket holds that again (a token a second), not 1 s."""
    headers = {"Authorization": f"Bearer {METERED}"}
    body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": 300}
    with httpx.Client(base_url=router.url, timeout=30) as c:
        too_big = c.post("/v1/chat/completions", json=body, headers=headers)
        body["max_tokens"] = 30
        first = c.post("/v1/chat/completions", json=body, headers=headers)
        assert first.status_code == 200, first.text
        used = first.json()["usage"]["total_tokens"]
        refused = c.post("/v1/chat/completions", json=body, headers=headers)
    assert too_big.status_code == 400
    assert "lower max_tokens to at most" in too_big.text
    assert refused.status_code == 429
    held = 30 + len(json.dumps(body)) // 4  # its max_tokens and its prompt's estimate
    missing = held - (60 - used)  # what the bucket lacks of a hold, back a token a second
    wait = int(refused.headers["Retry-After"])
    assert missing - 30 <= wait <= missing + 1, (wait, used, held)


def request_lines(log: Path) -> list[dict[str, object]]:
    """The access log's lines (`request`) of a router's JSON log."""
    lines = []
    for raw in log.read_text(errors="replace").splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if isinstance(line, dict) and line.get("event") == "request":
            lines.append(line)
    return lines


def test_a_stream_the_client_cut_is_logged_with_the_tokens_it_was_charged(
    tmp_path: Path, sims: dict[str, Sim]
) -> None:
    """The access log says what a request's key was charged: a stream whose client hung up
    is charged for what it relayed, and its line said 0 tokens all the same."""
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"keys:\n  - {{name: limited, sha256: {auth.digest(LIMITED)}, models: [m]}}\n")
    debug = Router.start(tmp_path, {"em": sims["em"]}, auth={"keys_file": str(keys)},
                         log_level="debug")  # fmt: skip
    assert debug.log_path is not None
    debug_log = debug.log_path
    try:
        tokens = 30
        sims["em"].faults(stall_at="mid_stream", after_tokens=tokens, count=1)
        body = {"model": "m", "messages": [{"role": "user", "content": "go " * 40}],
                "stream": True, "max_tokens": 500}  # fmt: skip
        read_events(debug, LIMITED, body, tokens)
        charged = wait_for_tokens(debug, "limited", "out", tokens)
        assert charged >= tokens
        deadline = time.monotonic() + 30
        while not (cut := [r for r in request_lines(debug_log) if r.get("status") == 499]):
            assert time.monotonic() < deadline, "no access log line for the cut stream"
            time.sleep(0.1)
        assert cut[0]["tokens_out"] == charged
        assert cut[0]["tokens_in"] == key_tokens(debug, "limited", "in") > 0
    finally:
        sims["em"].clear_faults()
        debug.stop()


@pytest.mark.parametrize(
    ("path", "extra", "field"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go"}]}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go"}]},
         "max_completion_tokens"),
        ("/v1/completions", {"prompt": "go"}, "max_tokens"),
        ("/v1/responses", {"input": "go"}, "max_output_tokens"),
        ("/v1/messages", {"messages": [{"role": "user", "content": "go"}]}, "max_tokens"),
    ],
)  # fmt: skip
def test_a_maximum_over_the_keys_limit_is_refused_naming_the_field_sent(
    router: Router, path: str, extra: dict[str, object], field: str
) -> None:
    """The 400 of a maximum no window of the key's 60 tokens a minute admits said
    "max_tokens" on every API: it names the field this API's client sent."""
    body = {"model": "m", **extra, field: 300}
    with httpx.Client(base_url=router.url, timeout=30) as c:
        resp = c.post(path, json=body, headers={"Authorization": f"Bearer {METERED}"})
    assert resp.status_code == 400, resp.text
    assert f"lower {field} to at most 60" in resp.text
    others = {"max_tokens", "max_completion_tokens", "max_output_tokens"} - {field}
    assert not any(other in resp.text for other in others), resp.text


@pytest.mark.parametrize(
    ("path", "extra", "field"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go"}],
                                  "max_tokens": 5, "n_predict": 300}, "n_predict"),
        ("/v1/completions", {"prompt": "go", "max_tokens": 5, "n_predict": 300}, "n_predict"),
        ("/v1/completions", {"prompt": "go", "max_tokens": 5, "max_completion_tokens": 300},
         "max_completion_tokens"),
        ("/v1/responses", {"input": "go", "max_output_tokens": 5, "max_completion_tokens": 300},
         "max_completion_tokens"),
        ("/v1/completions", {"prompt": "go", "max_tokens": 20, "n_cmpl": 8}, "n_cmpl"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go"}],
                                  "max_tokens": 20, "n": 1, "n_cmpl": 8}, "n_cmpl"),
        # Every engine answers each prompt a completions request lists.
        ("/v1/completions", {"prompt": ["a", "b", "c", "d"], "max_tokens": 20},
         "n times the 4 prompts"),
        ("/v1/completions", {"prompt": [[1, 2], [3], [4], [5]], "max_tokens": 20},
         "n times the 4 prompts"),
    ],
)  # fmt: skip
def test_a_maximum_llama_server_obeys_is_held_too(
    router: Router, path: str, extra: dict[str, object], field: str
) -> None:
    """llama-server generates `n_predict` tokens whatever `max_tokens` says, reads
    `max_completion_tokens` on every path, and `n_cmpl` answers whatever `n` says: a key of
    60 tokens a minute that named 5 in `max_tokens` was held to 5 and admitted while its
    engine generated 300, and as many at once as 5 fits in its window."""
    with httpx.Client(base_url=router.url, timeout=30) as c:
        resp = c.post(path, json={"model": "m", **extra},
                      headers={"Authorization": f"Bearer {METERED}"})  # fmt: skip
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "request_over_token_limit"
    assert f"{field} " in resp.text or f"({field})" in resp.text, resp.text


def test_route_counts_against_the_keys_requests_per_s(router: Router) -> None:
    """`POST /route` on the admin listener takes a tenant's key and tells what the prompt
    would find cached where: it tokenizes and ranks as a request does. A key of a request
    a second had it answered as often as it asked, a cache probe its limit never held."""
    body = {"model": "m", "messages": [{"role": "user", "content": "probe"}]}
    headers = {"Authorization": f"Bearer {RATED}"}
    with httpx.Client(timeout=30) as c:
        answers = [
            c.post(f"{router.admin}/route?path=/v1/chat/completions", json=body, headers=headers)
            for _ in range(6)
        ]
        assert [a.status_code for a in answers].count(200) <= 2, [a.text for a in answers]
        over = next(a for a in answers if a.status_code == 429)
        assert "over its limit of 1 requests/s" in over.json()["error"], over.text
        assert int(over.headers["Retry-After"]) >= 1
        # The front door counts the same bucket: /route spent it.
        spent = c.post(f"{router.url}/v1/chat/completions", json=body, headers=headers)
        assert spent.status_code == 429, spent.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
def test_a_model_the_key_may_not_use_is_answered_as_one_that_does_not_exist(
    router: Router, path: str
) -> None:
    """`GET /v1/models/{id}` and `/ready` hide the models a key may not use, but a request
    for one was a 403 "may not use the model 'secret'" where an unknown name was a 404: a key
    could learn every model's name by guessing. Both are now the same 404."""
    body: dict[str, object] = {"max_tokens": 2, "input": "x",
                               "messages": [{"role": "user", "content": "x"}]}  # fmt: skip
    headers = {"Authorization": f"Bearer {LIMITED}"}
    with httpx.Client(base_url=router.url, timeout=30) as c:
        hidden = c.post(path, json={**body, "model": "secret"}, headers=headers)
        unknown = c.post(path, json={**body, "model": "terces"}, headers=headers)
        listed = c.get("/v1/models/secret", headers=headers)
    assert hidden.status_code == unknown.status_code == listed.status_code == 404, hidden.text
    assert hidden.text.replace("secret", "terces") == unknown.text

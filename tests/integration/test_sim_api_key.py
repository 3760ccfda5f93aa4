"""`llmgw sim --api-key` (or LLMGW_SIM_API_KEY) as a real subprocess: what needs the key.

Every /v1 route, the fault-injection and state endpoints and /reset_prefix_cache answer
401 without `Authorization: Bearer <key>` (wrong scheme, wrong key, a prefix of it);
/health and /metrics stay open, as in vLLM; with the key the openai SDK gets its answer.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator

import httpx2 as httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.sim.testing import SimProcess, wait_for_line

pytestmark = pytest.mark.slow

KEY = "sim-key-Zq4_8xR2pL0"
CHAT = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
GUARDED = [
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/embeddings", {"model": "m", "input": "hi"}),
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/m", None),
    ("GET", "/sim/faults", None),
    ("POST", "/sim/faults", {"fail_status": 500}),
    ("DELETE", "/sim/faults", None),
    ("GET", "/sim/state", None),
    ("POST", "/reset_prefix_cache", None),
    ("GET", "/v1/unknown", None),
]


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    with SimProcess.start("--api-key", KEY, model="m", timeout=60) as s:
        yield s


def ask(sim: SimProcess, method: str, path: str, body: object, auth: str | None) -> int:
    headers = {"Authorization": auth} if auth is not None else {}
    r = httpx.request(method, sim.url + path, json=body, headers=headers, timeout=10)
    return r.status_code


@pytest.mark.parametrize(
    ("method", "path", "body"), GUARDED, ids=[f"{m} {p}" for m, p, _ in GUARDED]
)
def test_every_guarded_route_refuses_without_the_key(
    sim: SimProcess, method: str, path: str, body: object
) -> None:
    for auth in (None, "", KEY, f"Basic {KEY}", f"Bearer {KEY[:-1]}", f"Bearer {KEY}x", "Bearer"):
        assert ask(sim, method, path, body, auth) == 401, (path, auth)
    r = httpx.request(method, sim.url + path, json=body, timeout=10)
    assert r.json()["error"]["code"] == "invalid_api_key"


def test_the_fault_plan_is_unchanged_by_refused_requests(sim: SimProcess) -> None:
    assert ask(sim, "POST", "/sim/faults", {"fail_status": 503}, None) == 401
    bearer = {"Authorization": f"Bearer {KEY}"}
    plan = httpx.get(sim.url + "/sim/faults", headers=bearer, timeout=10).json()
    assert plan["active"] is False
    assert ask(sim, "POST", "/v1/chat/completions", CHAT, f"Bearer {KEY}") == 200


def test_health_and_metrics_stay_open(sim: SimProcess) -> None:
    assert ask(sim, "GET", "/health", None, None) == 200
    assert "vllm:num_requests_running" in sim.metrics_text()


def test_the_openai_sdk_with_the_key_is_answered(sim: SimProcess) -> None:
    from openai import AuthenticationError, OpenAI

    good = OpenAI(base_url=sim.url + "/v1", api_key=KEY, max_retries=0, timeout=10)
    out = good.chat.completions.create(model="m", max_tokens=2, messages=CHAT["messages"])  # type: ignore[arg-type]
    assert out.choices[0].message.content
    bad = OpenAI(base_url=sim.url + "/v1", api_key="not-it", max_retries=0, timeout=10)
    with pytest.raises(AuthenticationError):
        bad.chat.completions.create(model="m", max_tokens=2, messages=CHAT["messages"])  # type: ignore[arg-type]


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.text(max_size=60).filter(lambda t: t != f"Bearer {KEY}"))
def test_any_other_authorization_header_is_refused(sim: SimProcess, header: str) -> None:
    try:
        status = ask(sim, "GET", "/v1/models", None, header)
    except (httpx.LocalProtocolError, UnicodeEncodeError):
        return  # not sendable as a header at all
    assert status in (400, 401)


def test_the_key_from_the_environment_and_not_in_the_log() -> None:
    """LLMGW_SIM_API_KEY, as the agent passes it (argv would show in `ps`)."""
    cmd = [sys.executable, "-m", "llmgw", "sim", "--host", "127.0.0.1", "--port", "0"]
    cmd += ["--served-model-name", "m", "--log-level", "debug"]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "LLMGW_SIM_API_KEY": KEY},
    )
    try:
        line = re.compile(r"listening on (http://\S+)")
        url = wait_for_line(proc, line, "llmgw sim", 60).group(1)
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
        bearer = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(url + "/v1/models", headers=bearer, timeout=10).status_code == 200
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    assert b"listening" in err
    assert KEY.encode() not in err

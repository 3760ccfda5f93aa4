"""Bad requests get OpenAI-shaped 4xx errors from a real `llmgw sim`, never a 500.

Hypothesis generates request bodies — raw bytes, arbitrary JSON, and plausible
OpenAI requests with wrong types and out-of-range values — and sends them over
real HTTP to a sim subprocess. Every answer must be a 200 with a well-formed
body or a 4xx whose body is `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from llmgw.sim.testing import SimProcess

PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=15,
)


def _sometimes(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly plausible values, sometimes anything at all."""
    return st.one_of(good, good, json_values)


message = st.fixed_dictionaries(
    {
        "role": _sometimes(st.sampled_from(["system", "user", "assistant", "tool", "robot"])),
        "content": _sometimes(
            st.text(max_size=80)
            | st.lists(
                st.fixed_dictionaries(
                    {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=20)}
                ),
                max_size=3,
            )
        ),
    }
)

FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": _sometimes(st.sampled_from(["sim", "other"])),
    "messages": _sometimes(st.lists(message, max_size=4)),
    "prompt": _sometimes(st.text(max_size=80) | st.lists(st.integers(-3, 50_000), max_size=10)),
    "input": _sometimes(st.text(max_size=40) | st.lists(st.text(max_size=10), max_size=3)),
    "max_tokens": _sometimes(st.integers(-3, 2**40)),
    "max_completion_tokens": _sometimes(st.integers(-3, 600)),
    "stream": _sometimes(st.booleans()),
    "stream_options": _sometimes(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "stop": _sometimes(st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=20)),
    "seed": _sometimes(st.integers(-(2**65), 2**65)),
    "n": _sometimes(st.integers(-1, 3)),
    "temperature": _sometimes(st.floats(-1, 3)),
    "top_p": _sometimes(st.floats(-1, 2)),
    "logprobs": json_values,
    "tools": json_values,
    "response_format": json_values,
    "encoding_format": _sometimes(st.sampled_from(["float", "base64", "hex"])),
    "dimensions": _sometimes(st.integers(-2, 2**33)),
    "ignore_eos": _sometimes(st.booleans()),
}

VALID: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "model": "sim",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
    },
    "/v1/completions": {"model": "sim", "prompt": "hi", "max_tokens": 5},
    "/v1/embeddings": {"model": "sim", "input": "hi"},
}


@st.composite
def request(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A valid request with up to three fields changed and maybe one removed, so that
    both the accepting and the refusing paths get exercised."""
    path = draw(st.sampled_from(PATHS))
    body = dict(VALID[path])
    for key in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=3, unique=True)):
        body[key] = draw(FIELDS[key])
    if body and draw(st.integers(0, 6)) == 0:
        body.pop(draw(st.sampled_from(sorted(body))))
    return path, body


class Client:
    """A keep-alive HTTP/1.1 connection that reconnects when the server closes it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        for attempt in range(2):
            try:
                self.conn.request("POST", path, body, {"Content-Type": "application/json"})
                resp = self.conn.getresponse()
                return resp.status, resp.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.conn.close()
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                if attempt:
                    raise
        raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    with SimProcess.start("--max-model-len", "600", "--eos-max-tokens", "64") as s:
        yield s


@pytest.fixture(scope="module")
def http_client(sim: SimProcess) -> Client:
    return Client(sim.port)


def check(status: int, body: bytes, path: str) -> None:
    event(f"{path} {status}")  # --hypothesis-show-statistics shows the mix of answers
    assert status < 500, (status, body[:500])
    if status == 200:
        if body.startswith(b"data: "):
            assert body.endswith(b"data: [DONE]\n\n"), body[-200:]
            for sse in body.split(b"\n\n")[:-2]:
                json.loads(sse[len(b"data: ") :])
        else:
            doc = json.loads(body)
            assert doc["object"] in ("chat.completion", "text_completion", "list"), doc
        return
    assert 400 <= status < 500, status
    doc = json.loads(body)
    assert set(doc) == {"error"}
    err = doc["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str)
    assert err["message"]


def _settings(n: int) -> settings:
    return settings(
        max_examples=n,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


@_settings(300)
@given(req=request())
def test_plausible_requests_never_get_a_500(
    sim: SimProcess, http_client: Client, req: tuple[str, dict[str, Any]]
) -> None:
    path, body = req
    status, out = http_client.post(path, json.dumps(body).encode())
    check(status, out, path)


@_settings(100)
@given(path=st.sampled_from(PATHS), body=json_values)
def test_any_json_never_gets_a_500(
    sim: SimProcess, http_client: Client, path: str, body: Any
) -> None:
    status, out = http_client.post(path, json.dumps(body).encode())
    check(status, out, path)
    assert status != 200 or isinstance(body, dict)


@_settings(100)
@given(path=st.sampled_from(PATHS), body=st.binary(max_size=200))
def test_any_bytes_never_get_a_500(
    sim: SimProcess, http_client: Client, path: str, body: bytes
) -> None:
    status, out = http_client.post(path, body)
    check(status, out, path)


def test_the_sim_still_serves_and_holds_no_blocks_after_the_fuzzing(
    sim: SimProcess, http_client: Client
) -> None:
    body = {"model": "sim", "prompt": "still alive?", "max_tokens": 3}
    status, out = http_client.post("/v1/completions", json.dumps(body).encode())
    assert status == 200
    assert json.loads(out)["usage"]["completion_tokens"] == 3
    state = sim.get_json("/sim/state")
    assert state["blocks_used"] == 0
    assert state["running"] == state["waiting"] == 0

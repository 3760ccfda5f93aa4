"""Bad input over real HTTP never gets a 500 from the router, nor stops it (Hypothesis)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.router_kit import Router, Sim
from tests.kit import raw_http

pytestmark = pytest.mark.slow

MAX_BODY = 64 * 1024
BODY_TIMEOUT_S = 1.0
EARLY_S = 0.2
"""How much before its deadline a cut may be seen, and no more: uvloop dates a timer from
the loop's time cached at the start of its iteration (measured 0.99989 s of 1 s)."""


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    tmp: Path = tmp_path_factory.mktemp("router-http")
    sim = Sim.start("m", "--eos-min-tokens", "2", "--eos-max-tokens", "2")
    r = Router.start(tmp, {"s": sim}, max_body_bytes=MAX_BODY, body_timeout_s=BODY_TIMEOUT_S)
    yield r
    r.stop()
    sim.stop()


@pytest.fixture(scope="module")
def http(router: Router) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=router.url, timeout=10) as c:
        yield c


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=10,
)
not_str = json_values.filter(lambda v: not isinstance(v, str))
not_list = json_values.filter(lambda v: not isinstance(v, list))
bad_bodies = st.one_of(
    st.binary(max_size=300),
    json_values.filter(lambda v: not isinstance(v, dict)).map(json.dumps),
    st.builds(lambda m: json.dumps({"model": m, "messages": []}), not_str),
    st.builds(lambda ms: json.dumps({"model": "m", "messages": ms}), not_list),
    st.builds(
        lambda s: json.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": s}
        ),
        # null is no stream, as OpenAI's API reads it; anything else not a boolean is refused.
        json_values.filter(lambda v: v is not None and not isinstance(v, bool)),
    ),
    st.builds(
        lambda c: json.dumps({"model": "m", "messages": [{"role": "user", "content": c}]}),
        st.dictionaries(st.text(max_size=5), json_values, min_size=1, max_size=2) | st.integers(),
    ),
    st.builds(lambda m: json.dumps({"model": m, "messages": []}), st.text(max_size=20)),
)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=bad_bodies, path=st.sampled_from(["/v1/chat/completions", "/v1/completions",
                                               "/v1/embeddings"]))  # fmt: skip
def test_bad_bodies_get_4xx_in_openai_shape(
    http: httpx.Client, body: str | bytes, path: str
) -> None:
    r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    err = r.json()["error"]
    assert isinstance(err["message"], str)
    assert err["message"]


def test_oversized_body_gets_413(http: httpx.Client) -> None:
    big = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * MAX_BODY}]})
    r = http.post("/v1/chat/completions", content=big)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v2/nothing", 404),
        ("DELETE", "/v1/chat/completions", 405),
        ("POST", "/v1/models", 405),
        ("PUT", "/", 404),
    ],
)
def test_unknown_paths_and_methods(http: httpx.Client, method: str, path: str, status: int) -> None:
    r = http.request(method, path)
    assert r.status_code == status
    assert "error" in r.json()


def test_models_health_ready_and_request_id(http: httpx.Client) -> None:
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["m"]
    assert http.get("/health").status_code == 200
    assert http.get("/ready").json()["ready"] is True
    r = http.post(
        "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        headers={"X-Request-Id": "req-123"},
    )
    assert r.status_code == 200
    assert r.headers["X-Request-Id"] == "req-123"
    assert r.json()["choices"][0]["message"]["content"]


def test_embeddings_and_legacy_completions_stream(http: httpx.Client) -> None:
    r = http.post("/v1/embeddings", json={"model": "m", "input": "hello"})
    assert r.status_code == 200
    assert len(r.json()["data"][0]["embedding"]) > 0
    with http.stream(
        "POST", "/v1/completions", json={"model": "m", "prompt": "hi", "stream": True}
    ) as s:
        raw = b"".join(s.iter_raw())
    assert s.status_code == 200
    assert raw.endswith(b"data: [DONE]\n\n")
    # The usage chunk the router asked for (to count tokens) is not shown to this client.
    assert b'"usage":{' not in raw


def _raw_post(router: Router, body: bytes, *, send: list[tuple[float, bytes]]) -> bytes:
    """POST /v1/chat/completions announcing `body`'s length, sending the pieces in `send`
    (each after its delay); everything the router answers until it closes or 10 s pass."""
    host, port = router.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode())
        for delay, piece in send:
            time.sleep(delay)
            sock.sendall(piece)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        return answer


def test_a_body_that_stops_half_way_gets_408_and_the_connection_closes(router: Router) -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    t0 = time.monotonic()
    answer = _raw_post(router, body, send=[(0.0, body[:10])])
    took = time.monotonic() - t0
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"Connection: close" in answer
    assert b'"code":"request_timeout"' in answer
    assert BODY_TIMEOUT_S - EARLY_S <= took < BODY_TIMEOUT_S + 5


def test_a_body_sent_in_pieces_within_the_timeout_is_served(router: Router) -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    answer = _raw_post(router, body, send=[(0.0, body[:10]), (0.2, body[10:])])
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert b'"choices"' in answer


def test_a_body_nested_to_the_decoders_limit_gets_an_answer_not_a_500(
    http: httpx.Client,
) -> None:
    """A stream request whose body the router must rewrite (`stream_options` given, so the
    usage chunk is asked for by decoding the body), with a field nested about as deep as
    the decoder takes: whether the depth is taken or not, the client gets an answer or a
    400 that says so, never a 500 (the rewrite decodes deeper in the stack than the
    first parse)."""
    statuses = set()
    for depth in range(900, 1000):
        nested = "[" * depth + "]" * depth
        body = (
            '{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":2,'
            f'"stream":true,"stream_options":null,"x":{nested}}}'
        )
        r = http.post("/v1/chat/completions", content=body)
        statuses.add(r.status_code)
        assert r.status_code in (200, 400), (depth, r.status_code, r.text[:300])
        if r.status_code == 400:
            assert "nested too deeply" in r.json()["error"]["message"]
    assert statuses == {200, 400}  # the sweep went past the limit


@pytest.mark.parametrize(
    ("listener", "method", "path"),
    [
        ("url", "POST", "/v1/chat/completions"),
        ("url", "GET", "/v1/models"),
        ("admin", "POST", "/route"),
        ("admin", "GET", "/health"),
    ],
)
def test_a_compressed_body_is_never_inflated(
    router: Router, listener: str, method: str, path: str
) -> None:
    """aiohttp inflated a body sent with `Content-Encoding: gzip` as it was read, and read
    whatever a handler left unread before the connection's next request: a megabyte of
    gzip (a gigabyte of zeros) held the router's loop for seconds, on any path, with no
    key needed. Bodies are taken as sent, and a compressed one is refused on every path,
    of both listeners, whether it takes a body or not (engines take none either)."""
    url = getattr(router, listener)
    headers = ("Content-Type: application/json", "Content-Encoding: gzip")
    raw = raw_http.with_body(url, method, path, raw_http.gzip_bomb(), *headers)
    before = raw_http.cpu_s(router.pid)
    answer = raw_http.answer_to(url, raw)
    assert raw_http.cpu_s(router.pid) - before < 1.0
    assert answer.startswith(b"HTTP/1.1 415"), answer[:300]
    assert b'"code":"compressed_body"' in answer


def test_router_survived(http: httpx.Client) -> None:
    """Runs last in this module: after all the garbage above the router still serves."""
    r = http.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200

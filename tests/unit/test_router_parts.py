"""Router pieces without a server: keys, request decoding, engine metric parsing."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import aiohttp
import msgspec
import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw import config
from llmgw.core.engine_metrics import parse_engine_metrics
from llmgw.core.profile import ModelProfile
from llmgw.core.tenancy import KeySettings
from llmgw.router import aiohttp_direct, apis, auth, requests
from llmgw.router.metrics import Metrics
from llmgw.router.table import Catalog, EndpointTable, Prober


def test_keys_file_lookup_models_and_buckets(tmp_path: Path) -> None:
    key = auth.new_key()
    p = tmp_path / "keys.yaml"
    p.write_text(
        "keys:\n"
        + auth.entry_yaml("team", key, ("m",))
        + "    requests_per_s: 2\n    tokens_per_min: 60\n"
    )
    keys = auth.load_keys(p, now=0.0)
    assert keys.lookup(None) is None
    assert keys.lookup("Bearer wrong") is None
    assert keys.lookup(key) is None  # no Bearer scheme
    assert keys.lookup(f"Basic {key}") is None
    assert keys.lookup("Bearer ") is None
    # The scheme is case-insensitive, as HTTP has it.
    for scheme in ("bearer", "BEARER", "BeArEr"):
        assert keys.lookup(f"{scheme} {key}") is not None, scheme
    pr = keys.lookup(f"Bearer {key}")
    assert pr is not None
    assert pr.may_use("m")
    assert not pr.may_use("other")
    assert pr.requests is not None
    assert pr.tokens is not None
    assert pr.requests.take(0.0)
    assert pr.requests.take(0.0)
    assert not pr.requests.take(0.0)
    assert pr.requests.take(0.5)
    pr.tokens.spend(0.0, 100)
    assert not pr.tokens.has_credit(0.0)
    assert pr.tokens.has_credit(41.0)  # one token per second refills the 40 overdrawn


def _workers_sharing(tmp_path: Path, n: int) -> list[auth.SharedLimits]:
    """`n` views of one limits file and lock, as `--workers n` has them."""
    import multiprocessing

    path = tmp_path / "limits"
    auth.SharedLimits.create(path)
    lock = multiprocessing.get_context("spawn").Lock()
    return [auth.SharedLimits(path, lock) for _ in range(n)]


def test_workers_share_one_budget_per_key_and_a_reload_keeps_it(tmp_path: Path) -> None:
    key, other = auth.new_key(), auth.new_key()
    p = tmp_path / "keys.yaml"
    p.write_text(
        "keys:\n"
        + auth.entry_yaml("team", key)
        + "    requests_per_s: 2\n    tokens_per_min: 60\n"
        + auth.entry_yaml("other", other)
        + "    requests_per_s: 2\n"
    )
    a, b = _workers_sharing(tmp_path, 2)
    ka, kb = auth.load_keys(p, 0.0, a), auth.load_keys(p, 0.0, b)
    ra, rb = ka.lookup(f"Bearer {key}"), kb.lookup(f"Bearer {key}")
    assert ra is not None
    assert rb is not None
    assert ra.requests is not None
    assert rb.requests is not None
    # One budget of 2 for both workers, not 2 each.
    assert ra.requests.take(0.0)
    assert rb.requests.take(0.0)
    assert not ra.requests.take(0.0)
    assert not rb.requests.take(0.0)
    assert rb.requests.take(0.5)  # refills at 2/s, whichever worker asks
    # Another key has its own budget.
    ro = ka.lookup(f"Bearer {other}")
    assert ro is not None
    assert ro.requests is not None
    assert ro.requests.take(0.5)
    # Tokens spent through one worker are missing in the other.
    assert ra.tokens is not None
    assert rb.tokens is not None
    ra.tokens.spend(1.0, 100)
    assert not rb.tokens.has_credit(1.0)
    # A reload (SIGHUP) finds the key's buckets as they are: no fresh burst.
    again = auth.load_keys(p, 0.5, b).lookup(f"Bearer {key}")
    assert again is not None
    assert again.requests is not None
    assert not again.requests.take(0.5)
    for s in (a, b):
        s.close()


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.integers(0, 2),
            st.floats(0, 0.5, allow_nan=False),
            st.sampled_from(["take", "spend", "credit", "refill"]),
            # A negative spend is a hold's unused rest given back (llmgw.router.quotas).
            st.floats(-5, 5, allow_nan=False),
        ),
        max_size=40,
    )
)
def test_shared_buckets_over_workers_behave_as_one_bucket(
    tmp_path_factory: pytest.TempPathFactory,
    steps: list[tuple[int, float, str, float]],
) -> None:
    """Whatever the order of workers, N views of a shared bucket answer as one bucket."""
    shared = _workers_sharing(tmp_path_factory.mktemp("limits"), 3)
    digest = auth.digest(auth.new_key())
    at = [s.claim(digest, 0.0, (3.0, 0.0)) for s in shared]
    assert len(set(at)) == 1
    views = [s.bucket(at[0] + 1, 2.0, 3.0) for s in shared]
    one = auth.Bucket(2.0, 3.0, 0.0)
    now = 0.0
    for worker, gap, op, amount in steps:
        now += gap
        view = views[worker]
        if op == "take":
            assert view.take(now) == one.take(now)
        elif op == "spend":
            view.spend(now, amount)
            one.spend(now, amount)
        elif op == "refill":
            level = abs(amount)
            assert view.refill_s(now, level) == pytest.approx(one.refill_s(now, level))
        else:
            assert view.has_credit(now) == one.has_credit(now)
    for s in shared:
        s.close()


@given(
    spent=st.floats(0, 10_000, allow_nan=False),
    level=st.floats(0, 3, allow_nan=False),
    at=st.floats(0, 100, allow_nan=False),
)
def test_a_bucket_holds_a_level_exactly_when_its_refill_time_says(
    spent: float, level: float, at: float
) -> None:
    """What a 429's Retry-After is made of: the wait until a key's bucket (2 a second, 3 at
    most) holds `level` again, however much it owes."""

    def owing() -> auth.Bucket:
        b = auth.Bucket(2.0, 3.0, 0.0)
        b.spend(0.0, spent)
        return b

    wait = owing().refill_s(at, level)
    assert owing().take(at + wait + 1e-6, level)
    if wait > 1e-3:
        assert not owing().take(at + wait - 1e-3, level)


@pytest.mark.parametrize("sha256", ["abc", "g" * 64, "a" * 65, "a" * 63 + " "])
def test_keys_file_errors_say_what_to_do(tmp_path: Path, sha256: str) -> None:
    p = tmp_path / "keys.yaml"
    p.write_text(f'keys:\n  - {{name: x, sha256: "{sha256}"}}\n')
    with pytest.raises(config.ConfigError, match="hash-key"):
        auth.load_keys(p, 0.0)


def test_the_keys_file_holds_no_key(tmp_path: Path) -> None:
    key = auth.new_key()
    assert key not in auth.entry_yaml("t", key)


def test_a_bucket_spent_to_nothing_has_no_credit_and_a_give_back_stops_at_its_burst(
    tmp_path: Path,
) -> None:
    """A key whose tokens are spent to exactly 0 waits like one in debt, and the unused rest
    of a hold given back never lifts a bucket past its burst, in one process or shared."""
    [shared] = _workers_sharing(tmp_path, 1)
    at = shared.claim(auth.digest(auth.new_key()), 0.0, (0.0, 60.0))
    for bucket in (auth.Bucket(1.0, 60.0, 0.0), shared.bucket(at + 3, 1.0, 60.0)):
        bucket.spend(0.0, 60.0)
        assert not bucket.has_credit(0.0)
        assert bucket.has_credit(0.5)
        bucket.spend(1.0, -1000.0)
        assert bucket.take(1.0, 60.0)
        assert not bucket.take(1.0, 0.5)
    shared.close()


def test_a_rate_under_one_a_second_still_admits_one_request_then_waits_for_it(
    tmp_path: Path,
) -> None:
    key = auth.new_key()
    p = tmp_path / "keys.yaml"
    p.write_text("keys:\n" + auth.entry_yaml("slow", key) + "    requests_per_s: 0.5\n")
    pr = auth.load_keys(p, now=0.0).lookup(f"Bearer {key}")
    assert pr is not None
    assert pr.requests is not None
    assert pr.requests.take(0.0)
    assert not pr.requests.take(1.9)
    assert pr.requests.take(2.0)


@pytest.mark.parametrize("limit", ["requests_per_s: 1", "tokens_per_min: 60"])
def test_a_key_with_one_limit_has_it_shared_by_the_workers(tmp_path: Path, limit: str) -> None:
    key = auth.new_key()
    p = tmp_path / "keys.yaml"
    p.write_text("keys:\n" + auth.entry_yaml("one", key) + f"    {limit}\n")
    views = _workers_sharing(tmp_path, 2)
    pa, pb = (auth.load_keys(p, 0.0, v).lookup(f"Bearer {key}") for v in views)
    assert pa is not None
    assert pb is not None
    a, b = (pa.requests, pb.requests) if limit.startswith("requests") else (pa.tokens, pb.tokens)
    assert a is not None
    assert b is not None
    amount = 1.0 if limit.startswith("requests") else 60.0
    assert a.take(0.0, amount)
    assert not b.take(0.0, amount)  # the other worker finds it spent
    # Refilled at its rate, a second's or a minute's: half of it in half the time.
    half = 0.5 if limit.startswith("requests") else 30.0
    assert not b.take(half, amount / 2 + 0.01)
    assert b.take(half, amount / 2)
    for v in views:
        v.close()


def test_a_bearer_token_is_found_whatever_spaces_surround_it_and_an_empty_one_never() -> None:
    key = auth.new_key()
    keys = auth.Keys([auth.Principal(KeySettings(name="k"), auth.digest(key), 0.0)])
    for value in (f"Bearer   {key}", f"  Bearer {key}  ", f"Bearer {key}\t"):
        assert keys.lookup(value) is not None, repr(value)
    assert keys.lookup(f"Bearer {key}x") is None
    for scheme in ("Bearerx", "Bearer:", "Bearers", "xBearer"):  # the scheme, exactly
        assert keys.lookup(f"{scheme} {key}") is None, scheme
    assert keys.lookup(f"Bearer {key.upper()}") is None  # a secret is case-sensitive
    # A key made of nothing (an operator's slip: `hash-key` of an empty string) admits no one.
    empty = auth.Keys([auth.Principal(KeySettings(name="empty"), auth.digest(""), 0.0)])
    for value in ("Bearer ", "Bearer", "bearer   ", "Bearer \t"):
        assert empty.lookup(value) is None, repr(value)


@given(
    models=st.lists(st.sampled_from(["m", "M", "m ", "*", "other", "m*"]), max_size=4),
    asked=st.sampled_from(["m", "M", "m ", "*", "other", "m*", "", "mm"]),
)
def test_a_key_may_use_exactly_its_models_or_all_with_a_star(models: list[str], asked: str) -> None:
    p = auth.Principal(KeySettings(name="k", models=tuple(models)), auth.digest("k"), 0.0)
    assert p.may_use(asked) == ("*" in models or asked in models)


@pytest.mark.parametrize(
    ("entries", "problem"),
    [
        ("    requests_per_s: 0\n", "requests_per_s must be above 0"),
        ("    tokens_per_min: 0\n", "tokens_per_min must be above 0"),
        ("    tokens_per_min: -5\n", "tokens_per_min must be above 0"),
        ("    requests_per_s: 0.0166\n", "requests_per_s must be at least 1/60"),
    ],
)
def test_a_keys_file_limit_of_nothing_or_under_the_fleets_floor_is_refused(
    tmp_path: Path, entries: str, problem: str
) -> None:
    p = tmp_path / "keys.yaml"
    p.write_text("keys:\n" + auth.entry_yaml("team", auth.new_key()) + entries)
    with pytest.raises(config.ConfigError, match=problem):
        auth.load_keys(p, now=0.0)


def test_a_keys_files_digest_is_read_in_either_case_and_one_secret_twice_is_refused(
    tmp_path: Path,
) -> None:
    key = auth.new_key()
    lower = auth.digest(key)
    p = tmp_path / "keys.yaml"
    p.write_text(f"keys:\n  - {{name: upper, sha256: {lower.upper()}}}\n")
    found = auth.load_keys(p, now=0.0).lookup(f"Bearer {key}")
    assert found is not None
    assert found.name == "upper"
    p.write_text(
        f"keys:\n  - {{name: a, sha256: {lower}}}\n  - {{name: b, sha256: {lower.upper()}}}\n"
    )
    with pytest.raises(config.ConfigError, match=r"keys\[1\] \(b\) repeats another"):
        auth.load_keys(p, now=0.0)


def test_parse_reads_routing_fields() -> None:
    body = msgspec.json.encode(
        {
            "model": "m",
            "stream": True,
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}],
                },
            ],
            "temperature": 0.1,
        }
    )
    p = requests.parse("chat", body, want_text=True)
    assert (p.model, p.stream, p.wants_usage) == ("m", True, False)
    assert p.text == "system\nbe brief\nuser\nhi\n"
    out = msgspec.json.decode(requests.rewrite(body, model="n", include_usage=True))
    assert out["model"] == "n"
    assert out["stream_options"] == {"include_usage": True}
    assert out["temperature"] == 0.1


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{",
        b"[]",
        b'{"model": 1, "messages": []}',
        b'{"model": "m"}',
        b'{"model": "", "messages": []}',
        b'{"model": "m", "messages": [{"content": {"x": 1}}]}',
        b"\xff\xfe",
    ],
)
def test_bad_bodies_are_bad_requests(body: bytes) -> None:
    with pytest.raises(requests.BadRequest):
        requests.parse("chat", body, want_text=True)


@given(st.binary(max_size=200) | st.from_regex(r'\{"model": ?.{0,20}, ?"prompt": ?.{0,20}\}'))
def test_any_bytes_parse_or_raise_bad_request(body: bytes | str) -> None:
    raw = body.encode() if isinstance(body, str) else body
    for kind in ("chat", "completions", "embeddings"):
        with contextlib.suppress(requests.BadRequest):
            requests.parse(kind, raw, want_text=True)  # type: ignore[arg-type]


def test_engine_metrics_parsing() -> None:
    text = """# HELP vllm:num_requests_waiting x
vllm:num_requests_waiting{engine="0",model_name="a"} 3.0
vllm:num_requests_waiting{engine="0",model_name="b"} 2.0
vllm:num_requests_running{model_name="a"} 7
vllm:kv_cache_usage_perc{model_name="a"} 0.42
vllm:num_requests_waiting_by_reason{reason="x"} 99
"""
    assert parse_engine_metrics(text) == (5.0, 7.0, 0.42)
    assert parse_engine_metrics(
        "llamacpp:requests_deferred 4\nllamacpp:requests_processing 1\n"
    ) == (
        4.0,
        1.0,
        None,
    )
    assert parse_engine_metrics("garbage\n{}\nvllm:kv_cache_usage_perc nan\n") == (None, None, None)


def test_table_and_catalog_operations() -> None:
    t = EndpointTable()
    t.add("a", "http://a/", ["m"])
    t.add("b", "http://b", ["m", "n"])
    assert [e.id for e in t.for_model("m")] == ["a", "b"]
    assert t.by_id["a"].url == "http://a"
    assert t.mark_draining("a")
    assert t.by_id["a"].draining
    t.remove("a")
    assert [e.id for e in t.for_model("m")] == ["b"]
    t.add("b", "http://b2", ["n"])  # replaced
    assert t.for_model("m") == []
    c = Catalog([ModelProfile(name="m", aliases=("x",))])
    assert c.resolve("x") is not None
    c.put(ModelProfile(name="m", aliases=("y",)))
    assert c.resolve("x") is None
    assert c.resolve("y") is not None
    c.remove("m")
    assert c.resolve("m") is None


OWN_COMPLETION_FIELDS = (
    "model", "stream_options", "prompt", "stream", "max_tokens", "n", "best_of", "priority",
    "max_completion_tokens", "n_predict", "n_cmpl",
)  # fmt: skip


@given(
    extra=st.dictionaries(
        # Fields the parser reads and checks (or drops: `priority`) are the request's own,
        # not extra ones.
        st.text(max_size=8).filter(lambda k: k not in OWN_COMPLETION_FIELDS),
        st.none() | st.booleans() | st.integers() | st.text(max_size=8),
        max_size=4,
    ),
    spaces=st.sampled_from([b"", b" ", b"\n  "]),
)
def test_usage_option_is_added_without_losing_anything(
    extra: dict[str, object], spaces: bytes
) -> None:
    data = {"model": "m", "prompt": "p", "stream": True, **extra}
    body = msgspec.json.encode(data) + spaces
    parsed = requests.parse("completions", body, want_text=False)
    assert not parsed.has_options
    out = requests.rewrite(body, model=None, include_usage=True, has_options=parsed.has_options)
    assert msgspec.json.decode(out) == {**data, "stream_options": {"include_usage": True}}
    null_opts = msgspec.json.encode({**data, "stream_options": None})
    p2 = requests.parse("completions", null_opts, want_text=False)
    assert p2.has_options
    out2 = requests.rewrite(null_opts, model="n", include_usage=True, has_options=True)
    assert msgspec.json.decode(out2)["stream_options"] == {"include_usage": True}


@given(
    priority=st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    kind=st.sampled_from(["chat", "completions", "embeddings", "messages", "rerank"]),
    rename=st.sampled_from([None, "n"]),
    usage=st.booleans(),
)
def test_a_bodys_priority_is_dropped_and_nothing_else(
    priority: object, kind: requests.Kind, rename: str | None, usage: bool
) -> None:
    """The engine's scheduling order (`priority`, any value) is not a client's to set."""
    data = {"model": "m", "messages": [{"role": "user", "content": "priority"}], "prompt": "p",
            "input": "i", "metadata": {"priority": 1}}  # fmt: skip
    plain = requests.parse(kind, msgspec.json.encode(data), want_text=False)
    assert not plain.priority
    body = msgspec.json.encode({**data, "priority": priority})
    parsed = requests.parse(kind, body, want_text=False)
    assert parsed.priority
    out = requests.rewrite(body, model=rename, include_usage=usage,
                           has_options=parsed.has_options, drop_priority=True)  # fmt: skip
    expected = {**data, "model": rename or "m"}
    if usage:
        expected["stream_options"] = {"include_usage": True}
    assert msgspec.json.decode(out) == expected


def test_run_now_finishes_a_coroutine_that_does_not_wait() -> None:
    async def add(a: int, b: int) -> int:
        return a + b

    assert aiohttp_direct.run_now(add(1, 2)) == 3


def test_run_now_refuses_a_coroutine_that_would_wait_and_closes_it() -> None:
    """The relay writes from protocol callbacks with aiohttp coroutines that never wait;
    one that would is not left half-run."""
    loop = asyncio.new_event_loop()
    try:
        fut: asyncio.Future[None] = loop.create_future()
        steps: list[str] = []

        async def waits() -> None:
            steps.append("started")
            try:
                await fut
                steps.append("resumed")
            finally:
                steps.append("closed")

        with pytest.raises(RuntimeError, match="waited"):
            aiohttp_direct.run_now(waits())
        assert steps == ["started", "closed"]
    finally:
        loop.close()


def test_stream_null_is_no_stream_as_openai_reads_it() -> None:
    for kind, body in (
        ("completions", b'{"model":"m","prompt":"p","stream":null}'),
        ("chat", b'{"model":"m","messages":[],"stream":null}'),
        ("responses", b'{"model":"m","input":"p","stream":null}'),
    ):
        assert requests.parse(kind, body, want_text=False).stream is False
    refused = b'{"model":"m","prompt":"p","stream":"yes"}'
    try:
        requests.parse("completions", refused, want_text=False)
    except requests.BadRequest:
        pass
    else:
        raise AssertionError("a stream that is not a boolean must be refused")


def test_engine_errors_take_the_shape_of_the_api_asked() -> None:
    # vLLM's Messages errors are Anthropic's shape with OpenAI's types in it.
    vllm = b'{"type":"error","error":{"type":"BadRequestError","message":"no"}}'
    doc = msgspec.json.decode(apis.engine_error("messages", 400, vllm))
    err = {"type": "invalid_request_error", "message": "no", "param": None,
           "code": "BadRequestError"}  # fmt: skip
    assert doc == {"type": "error", "error": err}
    doc = msgspec.json.decode(apis.engine_error("chat", 400, vllm))
    assert doc["error"]["type"] == "invalid_request_error"
    assert "type" not in doc
    openai = b'{"error":{"message":"gone","type":"NotFoundError","param":null,"code":"x"}}'
    assert apis.engine_error("chat", 404, openai) == openai  # OpenAI's own: as it is
    doc = msgspec.json.decode(apis.engine_error("messages", 404, openai))
    assert (doc["type"], doc["error"]["type"], doc["error"]["code"]) == (
        "error", "not_found_error", "x")  # fmt: skip
    for status, atype in ((413, "request_too_large"), (429, "rate_limit_error"),
                          (502, "api_error"), (504, "timeout_error")):  # fmt: skip
        doc = msgspec.json.decode(apis.engine_error("messages", status, b"plain"))
        assert doc["error"]["type"] == atype


ENGINE_KEY = "eK3y-Zq4_8xR2pL0vT9mW1nB6cY5dF7gH3jK0sA2uQ"


@pytest.mark.parametrize("kind", ["chat", "messages"])
@pytest.mark.parametrize("status", [302, 400, 404, 413, 422])
def test_an_engines_answer_but_a_success_loses_the_key_it_was_presented(
    kind: requests.Kind, status: int
) -> None:
    """An engine that echoes the router's `Authorization` in its error (JSON or not, the
    message escaped in JSON) tells the client what went wrong, never the key."""
    escaped = "".join(f"\\u{ord(c):04x}" for c in ENGINE_KEY)  # every character escaped
    bodies = [
        f'{{"object":"error","message":"too long; you sent Bearer {ENGINE_KEY}"}}',
        f'{{"error":{{"message":"too long; you sent Bearer {escaped}","code":"x"}}}}',
        f"<html>too long; you sent Authorization: Bearer {ENGINE_KEY}</html>",
    ]
    for body in bodies:
        out = apis.engine_answer(kind, status, body.encode(), ENGINE_KEY)
        assert ENGINE_KEY[:8].encode() not in out
        assert b"too long; you sent" in out
        assert b"[engine key]" in out


async def test_an_endpoint_that_goes_unready_is_logged_without_its_password() -> None:
    table = EndpointTable()
    table.add("e", "http://user:s3cret-pw@127.0.0.1:9", ["m"], ready=True)
    with structlog.testing.capture_logs() as logged:
        async with aiohttp.ClientSession() as http:
            await Prober(table, http, Metrics(), interval=60.0).probe_all()  # refused
    (said,) = [e for e in logged if e["event"] == "endpoint_not_ready"]
    assert said["url"] == "http://user:***@127.0.0.1:9"
    assert "s3cret-pw" not in repr(logged)


def test_a_success_is_relayed_unread() -> None:
    """A model's answer is relayed as the engine wrote it (the same object, not a copy):
    reading every answer for the key would cost each request; only what is not a success
    is read (`engine_answer`)."""
    answer = f'{{"choices":[{{"message":{{"content":"{ENGINE_KEY}"}}}}]}}'.encode()
    for status in (200, 201, 204):
        assert apis.engine_answer("chat", status, answer, ENGINE_KEY) is answer
    error = b'{"error":{"message":"no","code":"x"}}'
    assert apis.engine_answer("chat", 400, error, ENGINE_KEY) == error
    assert apis.engine_answer("chat", 400, error, "") == error


@pytest.mark.parametrize(
    ("body", "says"),
    [(b"[" * 60_000, "nests too deeply"), (b"{not json", "not JSON"), (b"[1]", "JSON object")],
)
def test_the_admin_route_explainer_refuses_what_is_no_request_with_why(
    body: bytes, says: str
) -> None:
    from llmgw.router.explain import ExplainError, explain

    with pytest.raises(ExplainError, match=says):
        explain(body, None)  # type: ignore[arg-type]  # refused before it is used


def counted(usage: dict[str, int]) -> tuple[int, int]:
    """The prompt and completion tokens the router reads in an answer with `usage`."""
    u = requests.usage_of(msgspec.json.encode({"usage": usage}))
    assert u is not None
    assert u.usage is not None
    return u.usage.prompt_tokens, u.usage.completion_tokens


@given(prompt=st.integers(0, 10**6), completion=st.integers(0, 10**6), total=st.integers(0, 10**6))
def test_a_usage_of_total_tokens_alone_counts_them_as_the_prompts(
    prompt: int, completion: int, total: int
) -> None:
    """A pooling API's usage (vLLM's rerank) may say only `total_tokens`: those are the
    prompt's. Where the prompt's or the completion's are given, the total adds nothing."""
    both = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": total}
    assert counted(both) == ((prompt, completion) if prompt or completion else (total, 0))
    assert counted({"total_tokens": total}) == (total, 0)
    assert counted({"output_tokens": completion, "total_tokens": total}) == (
        (0, completion) if completion else (total, 0)
    )


@pytest.mark.parametrize(
    ("text", "lone"),
    [
        ("\\ud800", "\\ud800"),
        ("x\\uD83D", "\\uD83D"),
        ("\\udbff rest", "\\udbff"),
        ("\\ud800\\ud801", "\\ud800"),
        ("\\ud83d\\ude00\\ud801", "\\ud801"),
        ("\\ude01x", "\\ude01"),
    ],
)
def test_a_lone_surrogate_escape_is_named_not_called_truncated(text: str, lone: str) -> None:
    """JSON may escape a character above U+FFFF only as a pair of \\u escapes; msgspec
    calls a first half without its second 'truncated', which sends a client looking
    for a cut body. The 400 names the escape and says what to send instead."""
    body = ('{"model": "m", "messages": [{"role": "user", "content": "' + text + '"}]}').encode()
    with pytest.raises(requests.BadRequest) as refused:
        requests.parse("chat", body, want_text=True)
    said = str(refused.value)
    assert "truncated" not in said
    assert f"the escape {lone} at byte {body.index(lone.encode())} is a lone UTF-16" in said
    assert "escape both halves, or send the character as UTF-8" in said


def test_a_body_really_cut_short_is_still_called_truncated() -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "\\\\ud800'
    with pytest.raises(requests.BadRequest, match="truncated"):
        requests.parse("chat", body, want_text=True)


@given(below_zero=st.integers(1, 2**31), field_name=st.sampled_from(
    ["prompt_tokens", "completion_tokens", "input_tokens", "output_tokens", "total_tokens"]
))  # fmt: skip
def test_a_count_below_zero_wrapped_as_unsigned_is_no_usage(
    below_zero: int, field_name: str
) -> None:
    """An engine whose count went below zero and is written as an unsigned 32-bit number
    (4294967295 for -1) reports a broken usage, not billions of tokens to charge a key (its
    budget spent, its window in debt for years): the answer's usage is not counted."""
    wrapped = 2**32 - below_zero
    assert requests.usage_of(msgspec.json.encode({"usage": {field_name: wrapped}})) is None


def test_an_alias_never_takes_another_models_name_nor_removes_it() -> None:
    """A model declaring an alias that is another model's name (or alias) must not turn
    requests for that model into requests for itself, declared before or after it; and
    when it goes, an alias both declared is the other's again (it was a 404)."""
    a = ModelProfile(name="a", aliases=("shared",))
    b = ModelProfile(name="b", aliases=("a", "shared"))
    for models in ([a, b], [b, a]):
        c = Catalog(models)
        assert c.resolve("a") is a
        got = c.resolve("shared")
        assert got is not None
        assert got.name == ("a" if models[0] is a else "b")
        c.remove("b")
        assert c.resolve("a") is a
        assert c.resolve("shared") is a


def test_an_endpoint_added_without_word_of_its_readiness_waits_for_its_first_probe() -> None:
    t = EndpointTable()
    assert not t.add("static", "http://127.0.0.1:1", ["m"]).ready
    assert t.add("up", "http://127.0.0.1:2", ["m"], ready=True).ready


def test_a_shared_alias_stays_with_its_holder_through_a_change_and_moves_when_dropped() -> None:
    """A change of the model holding an alias another model declares too keeps it there
    (requests for it do not flip to the other model on an unrelated change); a change
    that drops the alias hands it to the other model rather than to nobody."""
    a = ModelProfile(name="a", aliases=("shared",))
    b = ModelProfile(name="b", aliases=("shared",))
    c = Catalog([b, a])
    c.put(ModelProfile(name="b", aliases=("shared",), replicas=2))
    got = c.resolve("shared")
    assert got is not None
    assert (got.name, got.replicas) == ("b", 2)
    c.put(ModelProfile(name="b", aliases=()))
    assert c.resolve("shared") is a


def test_why_direct_writes_are_off_is_logged_once_per_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    said: list[tuple[str, dict[str, object]]] = []

    class Log:
        def warning(self, event: str, **fields: object) -> None:
            said.append((event, fields))

    monkeypatch.setattr(aiohttp_direct, "log", Log())
    monkeypatch.setattr(aiohttp_direct, "WHY_NOT", "turned off by LLMGW_AIOHTTP_DIRECT=0")
    monkeypatch.setattr(aiohttp_direct, "_explained", False)
    for _ in range(3):
        aiohttp_direct.explain()
    assert [event for event, _ in said] == ["aiohttp_direct_writes_off"]
    assert said[0][1]["reason"] == "turned off by LLMGW_AIOHTTP_DIRECT=0"

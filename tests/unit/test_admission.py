"""Admission (llmgw.router.admission) and the aiohttp guard, without a server."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict

from llmgw.core.profile import ModelProfile
from llmgw.core.tenancy import KeySettings
from llmgw.router import admission, aiohttp_direct, auth, choice, holds
from llmgw.router.app import Router
from llmgw.router.config import RouterConfig
from llmgw.router.errors import Refusal, refusal_response
from llmgw.router.table import Catalog


def _keys(tmp_path: Path, key: str, models: tuple[str, ...], limits: str = "") -> auth.Keys:
    p = tmp_path / "keys.yaml"
    p.write_text("keys:\n" + auth.entry_yaml("team", key, models) + limits)
    return auth.load_keys(p, now=0.0)


def _error(r: Refusal) -> dict[str, str]:
    err: dict[str, str] = msgspec.json.decode(r.body())["error"]
    return err


def test_no_key_and_a_wrong_key_are_401s_in_openai_shape(tmp_path: Path) -> None:
    key = auth.new_key()
    keys = _keys(tmp_path, key, ("*",))
    assert admission.authenticate(None, None, 0.0) is None  # anonymous router
    missing = admission.authenticate(keys, None, 0.0)
    wrong = admission.authenticate(keys, "Bearer nope", 0.0)
    assert isinstance(missing, Refusal)
    assert isinstance(wrong, Refusal)
    assert (missing.status, _error(missing)["code"]) == (401, "missing_api_key")
    assert (wrong.status, _error(wrong)["code"]) == (401, "invalid_api_key")
    assert isinstance(admission.authenticate(keys, f"Bearer {key}", 0.0), auth.Principal)


def _credential(*pairs: tuple[str, str]) -> str | Refusal | None:
    return admission.credential(CIMultiDict(pairs))


def test_a_key_comes_as_a_bearer_token_or_as_x_api_key() -> None:
    assert _credential(("Authorization", "Bearer a")) == "Bearer a"
    assert _credential(("authorization", "Bearer a")) == "Bearer a"
    assert _credential(("x-api-key", "b")) == "Bearer b"
    assert _credential(("X-Api-Key", "b")) == "Bearer b"
    # The same key in both (a client that sends both) is that key.
    assert _credential(("Authorization", "Bearer a"), ("x-api-key", "a")) == "Bearer a"
    assert _credential(("Authorization", "bearer  a"), ("x-api-key", " a")) == "bearer  a"
    assert _credential(("x-api-key", "")) is None
    assert _credential() is None
    # An empty Authorization is no key: an x-api-key beside it is the one sent.
    assert _credential(("Authorization", ""), ("x-api-key", "b")) == "Bearer b"


@pytest.mark.parametrize(
    "authorization", ["Bearer a", "Bearer no", "Basic YTpi", "Bearer", "b"], ids=repr
)
def test_two_different_keys_in_authorization_and_x_api_key_are_refused(
    authorization: str,
) -> None:
    """A proxy in front may check the one header while the router charged the other's key
    (the router took Authorization's): such a request is refused, as a header given twice."""
    found = _credential(("Authorization", authorization), ("x-api-key", "b"))
    assert isinstance(found, Refusal)
    assert (found.status, _error(found)["code"]) == (400, "ambiguous_api_key")
    assert "Authorization and x-api-key" in found.message


@pytest.mark.parametrize(
    "pairs",
    [
        (("Authorization", "Bearer a"), ("Authorization", "Bearer b")),
        (("Authorization", "Bearer a"), ("authorization", "Bearer a")),  # even the same key
        (("Authorization", ""), ("Authorization", "Bearer b")),
        (("x-api-key", "a"), ("X-API-KEY", "b")),
        (("Authorization", "Bearer a"), ("x-api-key", "b"), ("x-api-key", "c")),
    ],
    ids=["two keys", "one key twice", "an empty one first", "x-api-key twice", "beside"],
)
def test_a_key_header_given_twice_is_refused_not_one_copy_picked(
    pairs: tuple[tuple[str, str], ...], tmp_path: Path
) -> None:
    """A proxy in front may check one copy while the router would charge the other: the
    request is refused with a 400 that says to send the key once, before any key lookup,
    on a router with keys (anonymous or not); a router without keys asks for none."""
    keys = _keys(tmp_path, auth.new_key(), ("*",))
    found = _credential(*pairs)
    assert isinstance(found, Refusal)
    assert (found.status, _error(found)["code"]) == (400, "ambiguous_api_key")
    assert "more than once" in found.message
    assert admission.authenticate(keys, found, 0.0) is found
    assert admission.authenticate(keys, found, 0.0, anonymous=True) is found
    assert admission.authenticate(None, found, 0.0) is None


def test_a_router_taking_anonymous_requests_still_knows_its_keys_and_their_expiry() -> None:
    """An anonymous request is served as no key's; a request with a known key stays that
    key's (its models, its limits, its usage), and an expired one is refused as anywhere."""
    key = auth.new_key()
    brief = KeySettings(name="brief", expires_at=1000.0)
    keys = auth.Keys([auth.Principal(brief, auth.digest(key), 0.0)])
    assert admission.authenticate(keys, None, 0.0, anonymous=True) is None
    assert admission.authenticate(keys, "Bearer nope", 0.0, anonymous=True) is None
    known = admission.authenticate(keys, f"Bearer {key}", 0.0, anonymous=True)
    assert isinstance(known, auth.Principal)
    assert known.name == "brief"
    expired = admission.authenticate(keys, f"Bearer {key}", 1000.0, anonymous=True)
    assert isinstance(expired, Refusal)
    assert _error(expired)["code"] == "expired_api_key"


def test_model_permission_and_limits_refuse_in_order(tmp_path: Path) -> None:
    key = auth.new_key()
    keys = _keys(tmp_path, key, ("m",), "    requests_per_s: 1\n    tokens_per_min: 60\n")
    principal = keys.lookup(f"Bearer {key}")
    assert principal is not None
    catalog = Catalog((ModelProfile(name="m", aliases=("best",)), ModelProfile(name="other")))
    unknown = admission.resolve(catalog, "nope")
    assert isinstance(unknown, Refusal)
    assert _error(unknown)["code"] == "model_not_found"
    other = admission.resolve(catalog, "other")
    assert isinstance(other, ModelProfile)
    refused = admission.admit(principal, "other", other)
    assert refused is not None
    # The same 404 as a model that does not exist: a key learns no name it may not use.
    assert refused == admission.no_model("other")
    m = admission.resolve(catalog, "best")  # by alias: the canonical name is allowed
    assert isinstance(m, ModelProfile)
    assert admission.admit(principal, "best", m) is None
    # A keys-file key's limits are this router's buckets (llmgw.router.holds).
    assert holds.local_limits(principal, 0.0) is None
    over = holds.local_limits(principal, 0.0)  # one request per second, taken
    assert over is not None
    assert (over.status, over.code) == (429, "rate_limit_exceeded")
    assert dict(over.headers)["x-ratelimit-limit-requests"] == "1"
    assert refusal_response(over).headers["Retry-After"] == "1"
    assert principal.tokens is not None
    principal.tokens.spend(1.0, 1000)
    spent = holds.local_hold(principal, 1, 1.0)
    assert isinstance(spent, Refusal)
    assert (spent.status, spent.code) == (429, "tokens_exceeded")
    assert spent.type == "rate_limit_error"


def test_a_key_is_refused_from_the_instant_it_expires() -> None:
    key = auth.new_key()
    brief = KeySettings(name="brief", expires_at=1000.0)
    keys = auth.Keys([auth.Principal(brief, auth.digest(key), 0.0)])
    assert isinstance(admission.authenticate(keys, f"Bearer {key}", 999.9), auth.Principal)
    expired = admission.authenticate(keys, f"Bearer {key}", 1000.0)
    assert isinstance(expired, Refusal)
    assert _error(expired)["code"] == "expired_api_key"


FALLING_BACK = (
    ModelProfile(name="big", fallbacks=("secret", "small")),
    ModelProfile(name="secret"),
    ModelProfile(name="small"),
)


def _principal(*models: str) -> auth.Principal:
    return auth.Principal(KeySettings(name="team", models=models), auth.digest("k"), 0.0)


def test_a_fallback_the_key_may_not_use_is_skipped() -> None:
    # The key asked for a model it may use; its fallbacks are checked again, each.
    d = SimpleNamespace(catalog=Catalog(FALLING_BACK), cfg=RouterConfig())
    big = d.catalog.resolve("big")
    served, skipped = choice.chain(d, big, _principal("big", "small"), "chat")  # type: ignore[arg-type]
    assert [p.name for p in served] == ["big", "small"]
    assert [p.name for p in skipped] == ["secret"]
    served, skipped = choice.chain(d, big, None, "chat")  # type: ignore[arg-type]
    assert [p.name for p in served] == ["big", "secret", "small"]


def test_a_fallback_on_llama_server_is_skipped_where_it_would_not_keep_the_limits() -> None:
    """llama-server's usage counts one of several answers, and its Messages API drops the
    `cache_prompt: false` that isolation sends: a fallback on it is skipped for those."""
    models = (ModelProfile(name="v", fallbacks=("ll",)), ModelProfile(name="ll", engine="llamacpp"))
    shared = SimpleNamespace(catalog=Catalog(models), cfg=RouterConfig(models=models))
    isolated = SimpleNamespace(
        catalog=shared.catalog,
        cfg=msgspec.structs.replace(
            shared.cfg, tenancy=msgspec.structs.replace(shared.cfg.tenancy, cache_isolation="key")
        ),
    )
    v = shared.catalog.resolve("v")

    def served(d: SimpleNamespace, kind: str, choices: int = 1) -> list[str]:
        return [p.name for p in choice.chain(d, v, None, kind, choices)[0]]  # type: ignore[arg-type]

    assert served(shared, "chat") == served(shared, "messages") == ["v", "ll"]
    assert served(shared, "chat", 2) == ["v"]
    assert served(isolated, "messages") == ["v"]
    assert served(isolated, "chat") == ["v", "ll"]


async def test_a_key_sees_only_the_models_it_may_use() -> None:
    router = Router(RouterConfig(models=FALLING_BACK))
    secret = auth.new_key()
    router.keys = auth.Keys(
        [auth.Principal(KeySettings(name="t", models=("big",)), auth.digest(secret), 0.0)]
    )
    bearer = {"Authorization": f"Bearer {secret}"}
    try:
        listed = await router.handle_models(
            make_mocked_request("GET", "/v1/models", headers=bearer)
        )
        assert [m["id"] for m in msgspec.json.decode(listed.body)["data"]] == ["big"]
        for name, status in (("big", 200), ("secret", 404), ("nope", 404)):
            request = make_mocked_request("GET", f"/v1/models/{name}", headers=bearer)
            assert (await router.handle_model(request)).status == status, name
    finally:
        router.pool.close()
        router.deadlines.close()


def test_a_late_body_refusal_closes_the_connection() -> None:
    late = admission.body_late(1.0)
    assert late.close
    assert late.status == 408
    assert refusal_response(late).keep_alive is False
    assert refusal_response(admission.body_too_large(10)).keep_alive is None


@pytest.mark.parametrize(
    ("version", "known"),
    [
        ("3.12.0", True),
        ("3.14.5", True),
        ("3.15.0", False),
        ("3.11.18", False),
        ("4.0.0a1", False),
        ("garbage", False),
    ],
)
def test_the_aiohttp_guard_knows_its_versions(version: str, known: bool) -> None:
    assert aiohttp_direct.supported(version) is known
    assert (aiohttp_direct._why_not(version, "") == "") is known


def test_the_direct_writes_can_be_turned_off() -> None:
    assert "LLMGW_AIOHTTP_DIRECT=0" in aiohttp_direct._why_not("3.14.5", "0")
    assert aiohttp_direct._why_not("3.14.5", "1") == ""
    # As an environment file may write it: another case, blanks around.
    assert "turned off" in aiohttp_direct._why_not("3.14.5", " Off\n")


def test_a_key_may_use_a_model_by_the_alias_it_was_given_or_by_its_name() -> None:
    profile = ModelProfile(name="m", aliases=("m-latest",))
    assert admission.admit(_principal("m-latest"), "m-latest", profile) is None
    assert admission.admit(_principal("m"), "m-latest", profile) is None
    refused = admission.admit(_principal("other"), "m-latest", profile)
    assert refused is not None
    assert refused.status == 404


def test_a_token_debt_of_years_is_told_as_a_wait_of_a_day_at_most(tmp_path: Path) -> None:
    """A keys-file key with a small limit whose answer ran far past its hold owes its bucket
    for years: its 429 names a wait a client can act on, not a Retry-After of years."""
    key = auth.new_key()
    principal = _keys(tmp_path, key, ("m",), "    tokens_per_min: 1\n").lookup(f"Bearer {key}")
    assert principal is not None
    assert principal.tokens is not None
    principal.tokens.spend(0.0, 10**9)
    refused = holds.local_hold(principal, 1, 0.0)
    assert isinstance(refused, Refusal)
    assert refused.retry_after == holds.LONGEST_WAIT_S
    assert dict(refused.headers)["x-ratelimit-reset-tokens"] == "24h0m0s"


def test_limit_refusals_say_what_to_lower_and_never_a_negative_budget() -> None:
    p = auth.Principal(KeySettings(name="k", budget_tokens=100), auth.digest("k"), 0.0)
    two = admission.never_fits(p, 80, 100, choices=2)
    assert "2 answers (n) of up to 80 completion tokens each" in two.message
    assert "or n so that their product is at most 100" in two.message
    one = admission.never_fits(p, 180, 100)
    assert "up to 180 completion tokens (max_tokens)" in one.message
    overdrawn = admission.over_budget(p, -40, 10, 0.0)
    assert "has 0 tokens left of its budget of 100 tokens" in overdrawn.message
    assert "-40" not in overdrawn.message

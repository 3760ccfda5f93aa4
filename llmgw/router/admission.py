"""Admission: who is asking, for which model, and whether their limits let them.

Every check returns data (a `Principal`, a `ModelProfile`, or a `Refusal`) and
touches no socket: the handler reads the body and turns a refusal into a
response (`llmgw.router.errors.refusal_response`). The order of the checks is
the order a client fixes them in: a key, then a model it may use, then its rate.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping

from llmgw.core import quota, tenancy
from llmgw.core.profile import ModelProfile
from llmgw.router import auth
from llmgw.router import headers as headers_
from llmgw.router.errors import Refusal
from llmgw.router.table import Catalog

NO_KEY = Refusal(
    401,
    "no API key: send it as `Authorization: Bearer <key>` (or `x-api-key: <key>`)",
    "invalid_request_error",
    "missing_api_key",
)
_KEY_HEADERS = ("Authorization", "x-api-key")
BAD_KEY = Refusal(
    401,
    "invalid API key: check the key, or ask the router's operator for one",
    "invalid_request_error",
    "invalid_api_key",
)


def credential(headers: Mapping[str, str]) -> str | Refusal | None:
    """The `Authorization` value a request's key comes in: that header's, else its
    `x-api-key` as a bearer token, the header Anthropic's API takes and its clients send.

    Either header given twice is refused, and so are both headers with different keys:
    which copy counts would be a choice a proxy in front may make the other way (checking
    one key, the router charging another)."""
    for name in _KEY_HEADERS:
        if len(headers_.values(headers, name)) > 1:
            return Refusal(
                400,
                f"the request carries {name} more than once: send the API key once",
                "invalid_request_error",
                "ambiguous_api_key",
            )
    authorization, key = headers.get("Authorization"), headers.get("x-api-key")
    if authorization and key and not _same_key(authorization, key):
        return Refusal(
            400,
            "the request carries different API keys in Authorization and x-api-key: "
            "send the key in one of them",
            "invalid_request_error",
            "ambiguous_api_key",
        )
    if authorization:
        return authorization
    return f"Bearer {key}" if key else None


def _same_key(authorization: str, key: str) -> bool:
    """Whether an `Authorization` value is a bearer token of `key` (a client may send both)."""
    scheme, _, token = authorization.strip().partition(" ")
    return scheme.lower() == "bearer" and token.strip() == key.strip()


def authenticate(
    keys: auth.Keys | None, header: str | Refusal | None, wall: float, anonymous: bool = False
) -> auth.Principal | Refusal | None:
    """The caller's principal; None for an anonymous request (`anonymous`: the router
    takes them; a request with a known key is still that key's). `header` is
    `credential`'s answer. `wall` is the wall clock (keys expire, and rotated secrets'
    overlaps end, at UNIX times)."""
    if keys is None:
        return None
    if isinstance(header, Refusal):
        return header
    if not header:
        return None if anonymous else NO_KEY
    principal = keys.lookup(header, wall)
    if principal is None:
        return None if anonymous else BAD_KEY
    if principal.expired(wall):
        return Refusal(
            401,
            f"this API key ({principal.name}) expired: ask the router's operator for a new"
            " one (llmgw ctl key update --expires)",
            "invalid_request_error",
            "expired_api_key",
        )
    return principal


def body_late(timeout_s: float) -> Refusal:
    return Refusal(
        408,
        f"the request body did not arrive within {timeout_s} s: send the whole body at once",
        "invalid_request_error",
        "request_timeout",
        close=True,
    )


def body_too_large(max_bytes: int) -> Refusal:
    return Refusal(
        413,
        f"the request body is larger than {max_bytes} bytes:"
        " send a shorter prompt or ask the operator to raise max_body_bytes",
        "invalid_request_error",
        "request_too_large",
    )


def bad_body(problem: str) -> Refusal:
    return Refusal(400, problem, "invalid_request_error", "invalid_body")


def may_use(principal: auth.Principal | None, asked: str, profile: ModelProfile) -> bool:
    """Whether the key may use a model, by the name asked or by its canonical name."""
    return principal is None or principal.may_use(asked) or principal.may_use(profile.name)


def no_model(asked: str) -> Refusal:
    """The 404 of a model this key cannot reach: one that does not exist and one it may not
    use get the same words (`admit`), as OpenAI's API answers both."""
    return Refusal(
        404,
        f"the model {asked!r} does not exist here, or this API key may not use it: "
        "GET /v1/models lists the models it may use",
        "invalid_request_error",
        "model_not_found",
    )


def resolve(catalog: Catalog, asked: str) -> ModelProfile | Refusal:
    """The profile of the model asked for, by name or alias."""
    profile = catalog.resolve(asked)
    return no_model(asked) if profile is None else profile


def admit(principal: auth.Principal | None, asked: str, profile: ModelProfile) -> Refusal | None:
    """None when the key may use the model; else the 404 of a model that does not exist,
    word for word: `GET /v1/models` and `/v1/models/{id}` show a key only the models it may
    use, and a 403 here told it which of the names it guessed exist. Its limits are the
    quotas' to check (llmgw.router.quotas: fleet-wide, or this router's buckets)."""
    if principal is None or may_use(principal, asked, profile):
        return None
    return no_model(asked)


def over_requests(principal: auth.Principal, remaining: float, reset_s: float) -> Refusal:
    limit = principal.settings.requests_per_s or 0.0
    return _over(principal, "requests", "requests/s", limit, remaining, reset_s)


def over_tokens(principal: auth.Principal, remaining: float, reset_s: float) -> Refusal:
    limit = principal.settings.tokens_per_min or 0.0
    return _over(principal, "tokens", "tokens/min", limit, remaining, reset_s)


def _over(
    p: auth.Principal, kind: str, unit: str, limit: float, remaining: float, reset_s: float
) -> Refusal:
    return Refusal(
        429,
        f"this API key ({p.name}) is over its limit of {limit:g} {unit}:"
        f" retry in {quota.reset_text(reset_s)}",
        "rate_limit_error",
        "rate_limit_exceeded" if kind == "requests" else "tokens_exceeded",
        retry_after=quota.retry_after(reset_s),
        headers=quota.rate_headers(kind, limit, remaining, reset_s),
    )


def never_fits(
    principal: auth.Principal, max_out: int, limit: int, choices: int = 1,
    field: str = "max_tokens", choices_field: str = "n",
) -> Refusal:  # fmt: skip
    """A request asking for more completion tokens than the key's limit: no wait admits it.
    `field` is the one the client named its maximum in (requests.Parsed.max_field), and
    `choices_field` its count of answers (`n`, or llama-server's `n_cmpl`)."""
    asks, lower = f"up to {max_out} completion tokens ({field})", f"to at most {limit}"
    if choices > 1:
        each = f"of up to {max_out} completion tokens each ({field})"
        asks = f"{choices} answers ({choices_field}) {each}"
        lower = f"or {choices_field} so that their product is at most {limit}"
    return Refusal(
        400,
        f"this request asks for {asks}, more than this API key ({principal.name}) may use:"
        f" {limit} tokens per minute or budget; lower {field} {lower}",
        "invalid_request_error",
        "request_over_token_limit",
    )


def over_budget(
    principal: auth.Principal, left: int, need: int, wall: float, field: str = "max_tokens"
) -> Refusal:
    """The budget holds `left` tokens, under the `need` of this request, at the UNIX time
    `wall`: the answer names when its period ends (the next day, or month, at 00:00 UTC),
    and its Retry-After is the wait until then. `field` is the maximum's, as in never_fits."""
    s = principal.settings
    renews = tenancy.period_end(wall, s.budget_period)
    reset_s = renews - wall
    return Refusal(
        429,
        f"this API key ({principal.name}) has {max(0, left)} tokens left of its budget of"
        f" {s.budget_tokens} tokens per {s.budget_period}, and this request may use {need};"
        f" it renews in {quota.reset_text(reset_s)} (at {utc_minute(renews)}): lower {field},"
        " or ask the operator to raise it (llmgw ctl key update --budget-tokens)",
        "rate_limit_error",
        "budget_exceeded",
        retry_after=quota.retry_after(reset_s),
    )


UNCHECKED_RETRY_S = 5
"""`Retry-After` of a budget this router cannot check: the counters are usually back within
seconds (a restart of the server)."""


def budget_unchecked(
    principal: auth.Principal, need: int, left: int | None, field: str = "max_tokens"
) -> Refusal:
    """The fleet's counters cannot be reached, and this router's share of the key's budget
    does not hold the `need` of this request: `left` tokens remain of it (None: this router
    has no reading of the budget for this period). `field`: the request's maximum."""
    s = principal.settings
    budget = f"this API key's ({principal.name}) budget of {s.budget_tokens} tokens per"
    if left is None:
        known = f" {s.budget_period} cannot be checked: this router has not read it this"
        known += f" {s.budget_period}"
    else:
        known = (f" {s.budget_period} can only be spent here up to this router's share of"
                 f" what was left when it last read it: {max(0, left)} tokens, under the"
                 f" {need} this request may use (lower {field})")  # fmt: skip
    return Refusal(
        503,
        f"the fleet's budget counters cannot be reached, and {budget}{known}; retry in"
        f" {UNCHECKED_RETRY_S} s, or ask the operator to bring the router's NATS back",
        "server_error",
        "budget_unavailable",
        retry_after=UNCHECKED_RETRY_S,
    )


def utc_minute(ts: float) -> str:
    """A UNIX time as `2026-12-01 00:00 UTC`."""
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")

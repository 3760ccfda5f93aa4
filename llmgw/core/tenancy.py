"""Tenants' API keys as the log holds them: a key's settings, their checks, and budget periods.

An operator creates a key with `llmgw ctl key create`; the secret is printed once and the
log keeps only its SHA-256 digest beside the settings here (`KeyCreated`), so anyone who
reads the log learns who may do what, never a key. Every router folds these events and
admits by them (llmgw.router.auth). Pure: Structs, checks that say what to change, and the
calendar arithmetic of budgets (UTC days and months, so every router agrees where a
period ends).
"""

from __future__ import annotations

import calendar
import hashlib
import re
from typing import Annotated, Literal, TypeAlias

import msgspec

from llmgw.core.limits import MAX_LIST, MAX_NAME, WHOLE_END, Name, Time

_KEY_NAME = r"[A-Za-z0-9_][A-Za-z0-9_-]{0,63}"
KEY_NAME = re.compile(_KEY_NAME)
"""A key's name is a token of NATS subjects (its fleet-wide counters are named by it)."""

Period: TypeAlias = Literal["day", "month"]
Priority: TypeAlias = Literal["high", "normal", "low"]
PRIORITIES: tuple[Priority, ...] = ("high", "normal", "low")
MAX_RATE = 10.0**9
MIN_RATE = 1 / 60
"""The slowest request rate a key may have: its fleet-wide window is at most a minute."""
Amount: TypeAlias = Annotated[float, msgspec.Meta(gt=0.0, le=MAX_RATE)]
Tokens: TypeAlias = Annotated[int, msgspec.Meta(gt=0, le=2**53)]
Digest: TypeAlias = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}" + WHOLE_END)]
MAX_OVERLAP_S = 30 * 86_400.0
"""The longest a rotated key's old secret may stay valid: a month."""


class KeySettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What one key may do. Absent limits are no limits."""

    name: Annotated[str, msgspec.Meta(pattern=f"^{_KEY_NAME}" + WHOLE_END)]
    team: Name = ""
    models: Annotated[tuple[Name, ...], msgspec.Meta(max_length=MAX_LIST)] = ("*",)
    """Model names or aliases it may use; "*" is every model."""
    requests_per_s: Amount | None = None
    tokens_per_min: Amount | None = None
    budget_tokens: Tokens | None = None
    """Prompt and completion tokens it may use per `budget_period`, fleet-wide."""
    budget_period: Period = "day"
    expires_at: Time | None = None
    """UNIX seconds after which routers refuse it; None: never."""
    priority: Priority = "normal"
    """Its class when requests queue: high before normal before low."""


class BadKeySettings(ValueError):
    """Settings an operator asked for that cannot be a key; the text says what to change."""


def check_name(name: str) -> str:
    if not KEY_NAME.fullmatch(name):
        raise BadKeySettings(
            f"key name {name!r}: use 1-64 letters, digits, '_' or '-', starting with a"
            " letter, digit or '_' (it names the key's counters on NATS)"
        )
    return name


def problems(settings: KeySettings) -> list[str]:
    """What is wrong with `settings` beyond their types, in words; empty when usable."""
    out: list[str] = []
    if not settings.models:
        out.append("models is empty: give at least one model, or '*' for every model")
    if any(not m.strip() for m in settings.models):
        out.append("models names an empty model")
    if len(settings.team) > MAX_NAME:
        out.append(f"team is longer than {MAX_NAME} characters")
    if settings.requests_per_s is not None and settings.requests_per_s < MIN_RATE:
        out.append("requests_per_s must be at least 1/60 (one request a minute)")
    return out


def checked(settings: KeySettings) -> KeySettings:
    found = problems(settings)
    if found:
        raise BadKeySettings(f"key {settings.name!r}: " + "; ".join(found))
    return settings


def parse_budget(text: str) -> tuple[int, Period]:
    """`N/day` or `N/month` (N tokens; `k`/`M`/`G` suffixes allowed) -> (N, period)."""
    amount, sep, period = text.strip().partition("/")
    if not sep or period not in ("day", "month"):
        raise BadKeySettings(
            f"budget {text!r}: write it as TOKENS/day or TOKENS/month, e.g. 2M/day"
        )
    n = parse_amount(amount, "budget")
    if n != int(n) or n < 1:
        raise BadKeySettings(f"budget {text!r}: a whole number of tokens, at least 1")
    return int(n), period  # type: ignore[return-value]


_SUFFIX = {"": 1, "k": 1_000, "K": 1_000, "m": 1_000_000, "M": 1_000_000, "G": 10**9}


def parse_amount(text: str, what: str) -> float:
    """`20`, `2.5k`, `1M`: a positive number up to 10^9."""
    raw = text.strip()
    suffix = raw[-1:] if raw[-1:] in _SUFFIX and raw[-1:] else ""
    try:
        value = float(raw[: len(raw) - len(suffix)]) * _SUFFIX[suffix]
    except ValueError:
        raise BadKeySettings(f"{what} {text!r}: a number, e.g. 20, 2.5k or 1M") from None
    if not (0 < value <= MAX_RATE):
        raise BadKeySettings(f"{what} {text!r}: above 0 and at most 10^9")
    return value


def _civil(days: int) -> tuple[int, int, int]:
    """(year, month, day) of a count of days since 1970-01-01 (proleptic Gregorian)."""
    z = days + 719_468
    era = z // 146_097
    doe = z - era * 146_097
    yoe = (doe - doe // 1460 + doe // 36_524 - doe // 146_096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    day = doy - (153 * mp + 2) // 5 + 1
    month = mp + 3 if mp < 10 else mp - 9
    return yoe + era * 400 + (month <= 2), month, day


def period_of(ts: float, period: Period) -> str:
    """The budget period holding UNIX time `ts`: `d20261202` or `m202612` (UTC)."""
    year, month, day = _civil(int(ts // 86_400))
    return f"d{year:04d}{month:02d}{day:02d}" if period == "day" else f"m{year:04d}{month:02d}"


def period_end(ts: float, period: Period) -> float:
    """When the budget period holding `ts` ends (UNIX seconds, UTC)."""
    days = int(ts // 86_400)
    if period == "day":
        return (days + 1) * 86_400.0
    year, month, day = _civil(days)
    return (days - day + 1 + calendar.monthrange(year, month)[1]) * 86_400.0


def describe(settings: KeySettings) -> str:
    """One line of a key's limits, for `ctl key list` and refusals."""
    parts = [f"models {','.join(settings.models)}"]
    if settings.team:
        parts.insert(0, f"team {settings.team}")
    if settings.requests_per_s:
        parts.append(f"{settings.requests_per_s:g} req/s")
    if settings.tokens_per_min:
        parts.append(f"{settings.tokens_per_min:g} tokens/min")
    if settings.budget_tokens:
        parts.append(f"budget {settings.budget_tokens}/{settings.budget_period}")
    if settings.priority != "normal":
        parts.append(f"priority {settings.priority}")
    return ", ".join(parts)


# ------------------------------------------------------------------ prefix-cache isolation

CacheIsolation: TypeAlias = Literal["shared", "team", "key"]
"""Which requests may share an engine's prefix cache: every request (`shared`), a team's
keys' (`team`; a key without a team is a team of its own), or one key's (`key`)."""
SALT_PREFIX = "llmgw1-"


def cache_tenant(mode: CacheIsolation, key: str | None, team: str) -> str | None:
    """Who owns the cache a request may read under `mode`, as an unambiguous string (a team
    and a key of the same name are different tenants); None under `shared`. `key` is the
    request's key's name, None for a router without keys (one tenant: anonymous)."""
    if mode == "shared":
        return None
    if key is None:
        return "anonymous"
    if mode == "team" and team:
        return "team:" + team
    return "key:" + key


def cache_salt(mode: CacheIsolation, key: str | None, team: str) -> str | None:
    """The `cache_salt` a router sets on a request under `mode` (None under `shared`).

    The same at every router, so a tenant's requests find its prefix on any engine; a hash
    of the tenant so that a salt names no key. It need not be secret: clients never choose
    it (the router replaces theirs), so knowing another tenant's salt gives nothing."""
    tenant = cache_tenant(mode, key, team)
    if tenant is None:
        return None
    digest = hashlib.blake2b(tenant.encode(), digest_size=16, person=b"llmgw-cache-salt")
    return SALT_PREFIX + digest.hexdigest()

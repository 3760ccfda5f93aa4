"""`llmgw ctl key`'s arithmetic: settings from an operator's flags, and the keys' rows.

Pure apart from the wall clock a caller passes in: llmgw.cli.ctl_keys connects, publishes
and prints. Every bad flag is a `BadInput` (exit 2) that says what to write instead, raised
before anything is published.
"""

from __future__ import annotations

import datetime
from typing import Any

import msgspec

from llmgw.core import tenancy
from llmgw.core.state import KeyState
from llmgw.ctl.errors import BadInput


class Flags(msgspec.Struct, frozen=True, kw_only=True):
    """What an operator gave on the command line; None: not given."""

    team: str | None = None
    models: tuple[str, ...] | None = None
    rps: str | None = None
    tpm: str | None = None
    budget: str | None = None
    expires: str | None = None
    priority: str | None = None


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86_400.0}


def duration(text: str, what: str, most_s: float = tenancy.MAX_OVERLAP_S) -> float:
    """`90s`, `30m`, `1h`, `2d` (or plain seconds) -> seconds, at most `most_s`."""
    raw = text.strip()
    unit = raw[-1:] if raw[-1:] in _UNITS else "s"
    number = raw[:-1] if raw[-1:] in _UNITS else raw
    try:
        value = float(number) * _UNITS[unit]
    except ValueError:
        raise BadInput(f"{what} {text!r}: a duration such as 90s, 30m, 1h or 2d") from None
    if not 0 <= value <= most_s:
        raise BadInput(f"{what} {text!r}: between 0 and {most_s / 86_400:g} days")
    return value


def expiry(text: str, now: float) -> float | None:
    """An ISO date or date-time (UTC unless it says otherwise), `+30d` / `+12h`, or `never`."""
    raw = text.strip()
    if raw == "never":
        return None
    if raw.startswith("+"):
        return now + duration(raw[1:], "expiry")
    try:
        when = datetime.datetime.fromisoformat(raw)
    except ValueError:
        raise BadInput(
            f"expiry {text!r}: a date (2027-01-31), a date-time (2027-01-31T12:00Z), +30d, or never"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    at = when.timestamp()
    if at <= now:
        raise BadInput(f"expiry {text!r} is in the past: give a later date")
    if at > 2.0**34:
        raise BadInput(f"expiry {text!r} is too far away: give a date before 2500")
    return at


def _limit(text: str, what: str) -> float | None:
    """A positive amount, or 0 / `none` for no limit."""
    if text.strip().lower() in ("0", "none"):
        return None
    try:
        return tenancy.parse_amount(text, what)
    except tenancy.BadKeySettings as exc:
        raise BadInput(f"{exc}; or 0 for no limit") from None


def settings(
    name: str, flags: Flags, now: float, base: tenancy.KeySettings | None = None
) -> tenancy.KeySettings:
    """The settings `flags` make of `base` (a new key's when None)."""
    try:
        tenancy.check_name(name)
    except tenancy.BadKeySettings as exc:
        raise BadInput(str(exc)) from None
    s = base if base is not None else tenancy.KeySettings(name=name)
    changes: dict[str, Any] = {}
    if flags.team is not None:
        changes["team"] = flags.team.strip()
    if flags.models is not None:
        changes["models"] = tuple(dict.fromkeys(m.strip() for m in flags.models))
    if flags.rps is not None:
        changes["requests_per_s"] = _limit(flags.rps, "--rps")
    if flags.tpm is not None:
        changes["tokens_per_min"] = _limit(flags.tpm, "--tpm")
    if flags.budget is not None:
        if flags.budget.strip().lower() in ("0", "none"):
            changes["budget_tokens"] = None
        else:
            try:
                changes["budget_tokens"], changes["budget_period"] = tenancy.parse_budget(
                    flags.budget
                )
            except tenancy.BadKeySettings as exc:
                raise BadInput(str(exc)) from None
    if flags.expires is not None:
        changes["expires_at"] = expiry(flags.expires, now)
    if flags.priority is not None:
        if flags.priority not in tenancy.PRIORITIES:
            raise BadInput(f"--priority {flags.priority!r}: one of high, normal, low")
        changes["priority"] = flags.priority
    out = msgspec.structs.replace(s, **changes)
    try:
        # Through the log's own decoder: what the fold will read is what is checked here.
        out = msgspec.convert(msgspec.to_builtins(out), tenancy.KeySettings)
        return tenancy.checked(out)
    except (msgspec.ValidationError, tenancy.BadKeySettings) as exc:
        raise BadInput(f"key {name!r}: {exc}") from None


def require(keys: dict[str, KeyState], name: str) -> KeyState:
    key = keys.get(name)
    if key is None:
        known = ", ".join(sorted(keys)[:8]) or "none yet"
        raise BadInput(
            f"no key named {name!r} (keys: {known}): see `llmgw ctl key list`, or make it"
            " with `llmgw ctl key create`"
        )
    return key


def row(key: KeyState, now: float) -> dict[str, Any]:
    """One key as `ctl key show --json` prints it: never a secret, the digest's head only."""
    s = key.settings
    return {
        "name": s.name,
        "team": s.team,
        "models": list(s.models),
        "requests_per_s": s.requests_per_s,
        "tokens_per_min": s.tokens_per_min,
        "budget_tokens": s.budget_tokens,
        "budget_period": s.budget_period if s.budget_tokens else None,
        "expires_at": s.expires_at,
        "expired": s.expires_at is not None and now >= s.expires_at,
        "priority": s.priority,
        "sha256_prefix": key.sha256[:12],
        "previous_valid_until": key.previous_until
        if key.previous_sha256 and key.previous_until > now
        else None,
        "created_by": key.created_by,
        "created_at": key.created_ts,
        "changed_by": key.changed_by,
        "changed_at": key.changed_ts or None,
    }


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def table_rows(keys: dict[str, KeyState], now: float) -> list[list[str]]:
    out = []
    for name in sorted(keys):
        r = row(keys[name], now)
        limits = tenancy.describe(keys[name].settings).split(", ")
        out.append([
            name, r["team"] or "-", ",".join(r["models"]),
            ", ".join(x for x in limits if not x.startswith(("team ", "models "))) or "-",
            ("expired " if r["expired"] else "") + _when(r["expires_at"]), r["created_by"],
        ])  # fmt: skip
    return out


HEADERS = ("NAME", "TEAM", "MODELS", "LIMITS", "EXPIRES", "CREATED BY")


def show_lines(key: KeyState, now: float) -> list[str]:
    r = row(key, now)
    lines = [
        f"key {r['name']}" + (f" (team {r['team']})" if r["team"] else ""),
        f"  models:      {', '.join(r['models'])}",
        f"  limits:      {tenancy.describe(key.settings)}",
        f"  expires:     {_when(r['expires_at'])}" + (" (expired)" if r["expired"] else ""),
        f"  secret:      sha256 {r['sha256_prefix']}...",
        f"  created:     {_when(r['created_at'])} by {r['created_by']}",
    ]
    if r["changed_at"]:
        lines.append(f"  changed:     {_when(r['changed_at'])} by {r['changed_by']}")
    if r["previous_valid_until"]:
        lines.append(f"  old secret:  valid until {_when(r['previous_valid_until'])}")
    return lines

"""API keys: the hashed keys file, per-key model permissions and rate limits.

Clients send `Authorization: Bearer <key>`. The router keeps only SHA-256
digests of keys (a file that leaks does not leak keys); each entry names the
models it may use and optional requests/s and tokens/min limits. Keys are
random 32-byte secrets made by `llmgw router hash-key`, so a plain fast hash is
enough — a slow password hash would cost milliseconds on every request and
protects nothing that 256 bits of entropy do not already protect.

Keys file (YAML):

    keys:
      - name: team-a                 # shows in logs and metrics; the key itself never does
        sha256: 9f86d0...            # from `llmgw router hash-key`
        models: ["llama-3-8b"]       # "*" allows every model
        requests_per_s: 20           # optional
        tokens_per_min: 200000       # optional, counted from the engines' usage

Limits are token buckets per key per router process: with `--workers N` each
worker enforces 1/N of the limit (SO_REUSEPORT spreads connections evenly).
Used by `llmgw.router.app`.
"""

from __future__ import annotations

import hashlib
import secrets
from pathlib import Path

import msgspec

from llmgw import config

KEY_PREFIX = "llmgw-"


class KeyEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    sha256: str
    models: tuple[str, ...] = ("*",)
    requests_per_s: float | None = None
    tokens_per_min: float | None = None


class KeysFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    keys: tuple[KeyEntry, ...] = ()


def digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def entry_yaml(name: str, key: str, models: tuple[str, ...] = ("*",)) -> str:
    """The keys-file entry for `key`, ready to paste under `keys:`."""
    quoted = ", ".join(f'"{m}"' for m in models)
    return f'  - name: "{name}"\n    sha256: "{digest(key)}"\n    models: [{quoted}]\n'


class Bucket:
    """A token bucket: `rate` per second, holding at most `burst`. `now` is passed in."""

    __slots__ = ("burst", "level", "rate", "stamp")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.level = burst
        self.stamp = now

    def _refill(self, now: float) -> None:
        if now > self.stamp:
            self.level = min(self.burst, self.level + (now - self.stamp) * self.rate)
            self.stamp = now

    def take(self, now: float, amount: float = 1.0) -> bool:
        """Take `amount` if available."""
        self._refill(now)
        if self.level >= amount:
            self.level -= amount
            return True
        return False

    def has_credit(self, now: float) -> bool:
        self._refill(now)
        return self.level > 0

    def spend(self, now: float, amount: float) -> None:
        """Charge after the fact (tokens are known when the response ends); may go negative."""
        self._refill(now)
        self.level -= amount


class Principal:
    """One key's permissions and its live buckets."""

    __slots__ = ("all_models", "entry", "models", "requests", "tokens")

    def __init__(self, entry: KeyEntry, now: float, share: float) -> None:
        self.entry = entry
        self.all_models = "*" in entry.models
        self.models = frozenset(entry.models)
        self.requests = (
            Bucket(entry.requests_per_s * share, max(entry.requests_per_s * share, 1.0), now)
            if entry.requests_per_s
            else None
        )
        self.tokens = (
            Bucket(entry.tokens_per_min * share / 60.0, max(entry.tokens_per_min * share, 1.0), now)
            if entry.tokens_per_min
            else None
        )

    def may_use(self, model: str) -> bool:
        return self.all_models or model in self.models


class Keys:
    """The loaded keys file: digest -> principal."""

    def __init__(self, keys: KeysFile, now: float, share: float = 1.0) -> None:
        self.by_digest = {e.sha256.lower(): Principal(e, now, share) for e in keys.keys}

    def lookup(self, authorization: str | None) -> Principal | None:
        """The principal of an `Authorization` header value, None when missing or unknown."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        key = authorization[7:].strip()
        if not key:
            return None
        return self.by_digest.get(digest(key))


def load_keys(path: str | Path, now: float, share: float = 1.0) -> Keys:
    """Read and check a keys file; errors name the entry and what to fix."""
    data = config.read_yaml(path)
    try:
        kf = msgspec.convert(data, KeysFile, str_keys=True)
    except msgspec.ValidationError as exc:
        raise config.ConfigError(f"keys file {path}: {exc}") from None
    seen: set[str] = set()
    for i, e in enumerate(kf.keys):
        h = e.sha256.lower()
        if len(h) != 64 or any(c not in "0123456789abcdef" for c in h):
            raise config.ConfigError(
                f"keys file {path}: keys[{i}] ({e.name}): sha256 must be 64 hex digits;"
                " make it with `llmgw router hash-key`"
            )
        if h in seen:
            raise config.ConfigError(
                f"keys file {path}: keys[{i}] ({e.name}) repeats another entry's key: remove one"
            )
        seen.add(h)
        for field in ("requests_per_s", "tokens_per_min"):
            v = getattr(e, field)
            if v is not None and v <= 0:
                raise config.ConfigError(
                    f"keys file {path}: keys[{i}] ({e.name}): {field} must be above 0,"
                    " or left out for no limit"
                )
    return Keys(kf, now, share)

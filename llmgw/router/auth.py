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
        team: research               # optional: labels its metrics
        priority: high               # optional: high, normal (default) or low, when queued

An empty file (or one of comments only) is refused, at start and at a reload (SIGHUP, which
then keeps the keys in force): `keys: []` is a file of no keys.

Keys also come from the log: `llmgw ctl key create` records a key's digest and settings
(llmgw.core.tenancy) and every router that follows the log folds them (`merged`), so a new,
changed, rotated or revoked key is in force on every router within the feed's delay; the
keys file stays as the bootstrap of router-only deployments.

Limits are token buckets per key for the router as a whole: with `--workers N`
the buckets live in a file every worker maps (`SharedLimits`), changed under one
lock, so a client whose one keep-alive connection lands on one worker gets its
whole limit, and many connections spread over the workers get no more than it.
Used by `llmgw.router.app`.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import secrets
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import msgspec
import yaml

from llmgw import config
from llmgw.core.state import KeyState
from llmgw.core.tenancy import MIN_RATE, KeySettings, Priority

KEY_PREFIX = "llmgw-"


class KeyEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    sha256: str
    models: tuple[str, ...] = ("*",)
    requests_per_s: float | None = None
    tokens_per_min: float | None = None
    team: str = ""
    priority: Priority = "normal"


class KeysFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    keys: tuple[KeyEntry, ...] = ()


def digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def entry_yaml(name: str, key: str, models: tuple[str, ...] = ("*",)) -> str:
    """The keys-file entry for `key`, ready to paste under `keys:`."""
    quoted = ", ".join(_quoted(m) for m in models)
    return f'  - name: {_quoted(name)}\n    sha256: "{digest(key)}"\n    models: [{quoted}]\n'


def _quoted(text: str) -> str:
    """`text` as a YAML double-quoted scalar, escaped as YAML reads it: a quote, a newline
    or a control character written as it came broke the whole file the entry joined."""
    return yaml.safe_dump(text, default_style='"', allow_unicode=True, width=1 << 30).strip()


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
        """Charge after the fact (tokens are known when the response ends); may go negative.
        A negative amount (a hold's unused rest) gives back, up to the burst."""
        self._refill(now)
        self.level = min(self.burst, self.level - amount)

    def refill_s(self, now: float, level: float) -> float:
        """Seconds from `now` until the bucket holds `level` (0: it does)."""
        self._refill(now)
        return max(0.0, (level - self.level) / self.rate)


class Limiter(Protocol):
    def take(self, now: float, amount: float = 1.0) -> bool: ...

    def has_credit(self, now: float) -> bool: ...

    def spend(self, now: float, amount: float) -> None: ...

    def refill_s(self, now: float, level: float) -> float: ...


SLOTS = 65_536
SLOT_FIELDS = 5
"""Per key: a tag (from the digest's first 8 bytes), then level and stamp of the requests
bucket and of the tokens bucket."""


class SharedLimits:
    """Token buckets kept in a file that every worker maps, changed under one lock.

    A key finds its slot by open addressing on its digest; the first worker to claim a
    slot fills both buckets, the others (and later reloads of the keys file) find them
    as they are, so a reload keeps a key's spent budget. `now` is time.monotonic(),
    the same clock in every process.
    """

    def __init__(self, path: str | Path, lock: Any) -> None:
        self.lock = lock
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, SLOTS * SLOT_FIELDS * 8)
        finally:
            os.close(fd)
        self.floats = memoryview(self._map).cast("d")
        self.tags = memoryview(self._map).cast("q")

    @staticmethod
    def create(path: str | Path) -> None:
        """The zeroed file the workers map (before they start)."""
        with open(path, "wb") as f:
            f.truncate(SLOTS * SLOT_FIELDS * 8)

    def claim(self, digest_hex: str, now: float, bursts: tuple[float, float]) -> int:
        """The slot of this key (the index of its first field), filled on first claim."""
        tag = int(digest_hex[:16], 16) >> 1 | 1  # non-zero, fits a signed 64-bit int
        i = tag % SLOTS
        with self.lock:
            for _ in range(SLOTS):
                at = i * SLOT_FIELDS
                if self.tags[at] == tag:
                    return at
                if self.tags[at] == 0:
                    self.tags[at] = tag
                    self.floats[at + 1], self.floats[at + 2] = bursts[0], now
                    self.floats[at + 3], self.floats[at + 4] = bursts[1], now
                    return at
                i = (i + 1) % SLOTS
        raise config.ConfigError(f"more than {SLOTS} keys with limits: the router holds no more")

    def bucket(self, at: int, rate: float, burst: float) -> SharedBucket:
        return SharedBucket(self, at, rate, burst)

    def close(self) -> None:
        self.floats.release()
        self.tags.release()
        self._map.close()


class SharedBucket:
    """A token bucket whose level and stamp live in `SharedLimits` (see Bucket)."""

    __slots__ = ("at", "burst", "f", "lock", "rate")

    def __init__(self, limits: SharedLimits, at: int, rate: float, burst: float) -> None:
        self.f = limits.floats
        self.lock = limits.lock
        self.at = at
        self.rate = rate
        self.burst = burst

    def _refilled(self, now: float) -> float:
        f, at = self.f, self.at
        level = f[at]
        if now > f[at + 1]:
            level = min(self.burst, level + (now - f[at + 1]) * self.rate)
            f[at], f[at + 1] = level, now
        return level

    def take(self, now: float, amount: float = 1.0) -> bool:
        with self.lock:
            if self._refilled(now) >= amount:
                self.f[self.at] -= amount
                return True
            return False

    def has_credit(self, now: float) -> bool:
        with self.lock:
            return self._refilled(now) > 0

    def spend(self, now: float, amount: float) -> None:
        with self.lock:
            self.f[self.at] = min(self.burst, self._refilled(now) - amount)

    def refill_s(self, now: float, level: float) -> float:
        with self.lock:
            return max(0.0, (level - self._refilled(now)) / self.rate)


class Principal:
    """One key's permissions and its live buckets."""

    __slots__ = (
        "all_models", "fleet", "limited", "metered", "models", "name", "requests", "settings",
        "sha256", "tokens",
    )  # fmt: skip

    def __init__(
        self,
        settings: KeySettings,
        sha256: str,
        now: float,
        shared: SharedLimits | None = None,
    ) -> None:
        self.settings = settings
        self.sha256 = sha256
        self.name = settings.name
        self.fleet = False
        """A key of the log: its limits hold fleet-wide (llmgw.router.quotas)."""
        self.limited = bool(
            settings.requests_per_s or settings.tokens_per_min or settings.budget_tokens
        )
        self.metered = bool(settings.tokens_per_min or settings.budget_tokens)
        """Its requests hold what they may cost of its token limits (llmgw.router.quotas)."""
        self.all_models = "*" in settings.models
        self.models = frozenset(settings.models)
        # A burst of one second's requests, or of a whole minute's tokens.
        rps, tpm = settings.requests_per_s, settings.tokens_per_min
        r_burst = max(rps, 1.0) if rps else 0.0
        t_burst = max(tpm, 1.0) if tpm else 0.0
        self.requests: Limiter | None = None
        self.tokens: Limiter | None = None
        if shared is not None and (rps or tpm):
            at = shared.claim(sha256, now, (r_burst, t_burst))
            if rps:
                self.requests = shared.bucket(at + 1, rps, r_burst)
            if tpm:
                self.tokens = shared.bucket(at + 3, tpm / 60.0, t_burst)
            return
        if rps:
            self.requests = Bucket(rps, r_burst, now)
        if tpm:
            self.tokens = Bucket(tpm / 60.0, t_burst, now)

    def may_use(self, model: str) -> bool:
        return self.all_models or model in self.models

    def expired(self, wall: float) -> bool:
        at = self.settings.expires_at
        return at is not None and wall >= at


class Keys:
    """The keys in force: digest -> principal, and the secrets valid only until a time (a
    rotated key's old secret, during its overlap)."""

    def __init__(
        self, principals: Iterable[Principal] = (), until: dict[str, float] | None = None
    ) -> None:
        self.by_digest: dict[str, Principal] = {p.sha256: p for p in principals}
        self.until: dict[str, float] = until or {}

    def lookup(self, authorization: str | None, wall: float = 0.0) -> Principal | None:
        """The principal of an `Authorization` header value, None when missing or unknown
        (or a rotated-out secret past its overlap, at wall-clock time `wall`)."""
        if not authorization:
            return None
        # The scheme is case-insensitive (RFC 9110, 11.1): `bearer` is as good as `Bearer`.
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            return None
        key = key.strip()
        if not key:
            return None
        d = digest(key)
        principal = self.by_digest.get(d)
        if principal is not None and self.until and d in self.until and wall >= self.until[d]:
            return None
        return principal


def _reused(old: Keys | None, digest_hex: str, settings: KeySettings) -> Principal | None:
    """The principal `old` holds for the same secret and settings: its buckets stay."""
    p = old.by_digest.get(digest_hex) if old is not None else None
    return p if p is not None and p.settings == settings else None


def merged(
    file_keys: Keys | None,
    log_keys: Mapping[str, KeyState],
    now: float,
    shared: SharedLimits | None = None,
    old: Keys | None = None,
) -> Keys:
    """The keys file's keys and the log's (llmgw ctl key) as one set. A secret both hold is
    the file's: the bootstrap a router-only deployment starts from stays as written."""
    out = Keys()
    for name in sorted(log_keys):
        key = log_keys[name]
        for digest_hex, until in ((key.sha256, 0.0), (key.previous_sha256, key.previous_until)):
            if not digest_hex:
                continue
            p = _reused(old, digest_hex, key.settings)
            if p is None:
                p = Principal(key.settings, digest_hex, now, shared)
                p.fleet = True
            out.by_digest[digest_hex] = p
            if until:
                out.until[digest_hex] = until
    if file_keys is not None:
        for digest_hex, p in file_keys.by_digest.items():
            out.by_digest[digest_hex] = p
            out.until.pop(digest_hex, None)
    return out


def file_settings(entry: KeyEntry) -> KeySettings:
    return KeySettings(
        name=entry.name,
        models=entry.models,
        requests_per_s=entry.requests_per_s,
        tokens_per_min=entry.tokens_per_min,
        team=entry.team,
        priority=entry.priority,
    )


def load_keys(path: str | Path, now: float, shared: SharedLimits | None = None) -> Keys:
    """Read and check a keys file; errors name the entry and what to fix."""
    data = config.read_yaml(path)
    if not data or (isinstance(data, dict) and data.get("keys", []) is None):
        # Empty, comments only, or `keys:` with nothing under it: most likely a save that
        # failed (a full disk) or a file being written, which read as "no keys" revoked
        # every key at a reload. No keys at all is said so.
        raise config.ConfigError(
            f"keys file {path} is empty: list the keys under `keys:` (`llmgw router hash-key"
            " >> FILE` writes entries), or write `keys: []` for none"
        )
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
        # As for the fleet's keys (llmgw.core.tenancy): a slower rate's window would
        # outlive the counters that hold it, which would forget it mid-window.
        if e.requests_per_s is not None and 0 < e.requests_per_s < MIN_RATE:
            raise config.ConfigError(
                f"keys file {path}: keys[{i}] ({e.name}): requests_per_s must be at least"
                f" 1/60 ({MIN_RATE:.4g}, one request a minute), or left out for no limit"
            )
    return Keys(Principal(file_settings(e), e.sha256.lower(), now, shared) for e in kf.keys)

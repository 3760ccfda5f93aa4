"""How long a message may stay in the log, by subject: the per-message TTL rule. Pure.

JetStream lets every publisher set a message's TTL (`Nats-TTL`) once the stream allows TTLs,
and the server cannot limit it per subject. Heartbeats need one (the log must not grow with
them); nothing else may have one, because an event that expires would vanish from later
replays while earlier folds included it. So readers refuse, and the control plane deletes:

- a heartbeat without a TTL, with `never`, or with one beyond `MAX_HEARTBEAT_TTL_S`;
- any other message that carries a TTL.
"""

from __future__ import annotations

import re

TTL_HEADER = "Nats-TTL"
MAX_HEARTBEAT_TTL_S = 3600.0
"""An hour: far beyond any lost-node timeout, far below "forever"."""

_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)", re.ASCII)
"""A Go duration's parts, ASCII digits only, as the server reads them."""


def parse_ttl(value: str) -> float | None:
    """Seconds of a `Nats-TTL` value: whole seconds (`60`), or a Go duration (`60s`,
    `1h30m`); `never` is infinity. None for anything else, never an exception: a
    writer controls the value."""
    text = value.strip()
    if text.lower() == "never":
        return float("inf")
    if text.isascii() and text.isdigit():  # "²" is a digit to str.isdigit, not to float
        return float(text)
    if not text or _PART.sub("", text):
        return None
    return sum(float(n) * _UNIT_S[u] for n, u in _PART.findall(text))


def is_heartbeat(subject: str) -> bool:
    parts = subject.split(".")
    return len(parts) == 5 and parts[:3] == ["llmgw", "events", "node"] and parts[4] == "heartbeat"


def ttl_problem(subject: str, ttl: str | None) -> str | None:
    """Why a message on `subject` with `Nats-TTL` value `ttl` (None: no header) may not be
    in the log, or None when it may."""
    if is_heartbeat(subject):
        if ttl is None:
            return "a heartbeat without a TTL (Nats-TTL) would stay in the log forever"
        seconds = parse_ttl(ttl)
        if seconds is None:
            return f"a heartbeat with an unreadable TTL {_shown(ttl)}"
        if not 0 < seconds <= MAX_HEARTBEAT_TTL_S:
            return (
                f"a heartbeat with TTL {_shown(ttl)}: heartbeats expire within "
                f"{MAX_HEARTBEAT_TTL_S:.0f} s"
            )
        return None
    if ttl is not None:
        return f"TTL {_shown(ttl)} on {subject}: only heartbeats expire from the log"
    return None


def _shown(ttl: str, most: int = 40) -> str:
    """A TTL value as a refusal names it: whole when short, else its start and its length
    (a writer may send 64 KiB of it; readers keep and log recent refusals)."""
    if len(ttl) <= most:
        return repr(ttl)
    return f"{ttl[:most]!r}... ({len(ttl)} characters)"

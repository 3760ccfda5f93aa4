"""Whether anyone leads the fleet now: the leader lease as ctl read it, against the log's
last LeaderElected. Purely computational; `llmgw ctl status` (llmgw.cli.ctl_status)
reads both and prints the verdict.
"""

from __future__ import annotations

from typing import Any

import msgspec

from llmgw.ctl import history


class LeaseSeen(msgspec.Struct, kw_only=True):
    """The leader lease's key as ctl read it (llmgw.bus.lease writes it)."""

    holder: str = ""
    epoch: int = 0
    written: float | None = None
    """Server time of the key's last write (a renewal, or the release's delete marker)."""
    ttl_s: float | None = None
    released: bool = False
    """The key's last write is a delete (a clean shutdown gave the lease up)."""


def leader_status(
    lease: LeaseSeen | None, *, leader: str, epoch: int, elected_at: float | None, now: float
) -> dict[str, Any]:
    """Whether anyone leads now, from the lease and the log's last LeaderElected. Pure.

    `state` is `leading` (the lease's holder is the leader the log last elected),
    `none` (nobody holds the lease: free, released or expired) or `unannounced` (the
    holder is not the leader the log names: it has not announced itself, or the log's
    leader lost the lease to it). `since` is when that became so, where known.
    """
    when = history.format_time
    last = f"the log's last elected leader is {leader} (epoch {epoch}" + (
        f", at {when(elected_at)})" if elected_at is not None else ")"
    )
    if not leader:
        last = "no leader was ever elected in the log"
    out: dict[str, Any] = {"state": "leading", "holder": None, "since": None, "text": ""}
    expired_at = None
    if lease is not None and not lease.released and lease.written is not None and lease.ttl_s:
        expired_at = lease.written + lease.ttl_s
    if (
        lease is None
        or lease.released
        or not lease.holder
        or (expired_at is not None and expired_at <= now)
    ):
        out["state"] = "none"
        if lease is not None and lease.released:
            out["since"] = lease.written
            why = "the lease was released" + (
                f" at {when(lease.written)}" if lease.written is not None else ""
            )
        elif expired_at is not None and expired_at <= now:
            out["since"] = expired_at
            why = f"the lease of {lease.holder if lease else '?'} expired at {when(expired_at)}"
        else:
            why = "the lease is free (never taken, or expired)"
        out["text"] = f"NO LEADER: {why}; {last}"
        return out
    out["holder"] = lease.holder
    if lease.holder != leader or lease.epoch != epoch:
        out["state"] = "unannounced"
        out["text"] = (
            f"NO LEADER in the log: {lease.holder} holds the lease (epoch {lease.epoch}) but "
            f"has not announced itself; {last}"
        )
        out["since"] = elected_at
        return out
    out["since"] = elected_at
    out["text"] = f"leader {leader} (epoch {epoch})" + (
        f" since {when(elected_at)}" if elected_at is not None else ""
    )
    return out

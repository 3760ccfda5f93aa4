"""The open-files limit of llmgw's long-running services (router, control plane, agent).

Every client connection, engine connection, subscription and log file is a descriptor,
and a shell's default soft limit is 1024: a router started from one would hold about
500 concurrent streams (a client's connection and its engine's each) before accepting
failed with "Too many open files". The systemd units set `LimitNOFILE`; a service started any
other way raises its soft limit to its hard one itself (as Go programs, nats-server
among them, do), and its children (router workers, engines) inherit it. Where the hard
limit itself is low, the service says so once in its log.
"""

from __future__ import annotations

import resource

from llmgw import logs

WANTED = 1 << 20
"""The soft limit sought (the systemd units' LimitNOFILE), where the hard limit allows."""
LOW = 65_536
"""Below this, a busy router or agent may run out: worth a line in the log."""


def raise_soft_limit(wanted: int = WANTED) -> tuple[int, int]:
    """Raise this process's soft limit on open files toward its hard limit, at most to
    `wanted`; (the soft limit before, after). Never raises: a limit it may not change is
    kept."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinite = resource.RLIM_INFINITY
    target = wanted if hard == infinite else min(hard, wanted)
    if soft != infinite and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft, soft
        return soft, target
    return soft, soft


def at_start() -> None:
    """`raise_soft_limit`, and a warning when what the service may open stays low."""
    before, now = raise_soft_limit()
    if now < LOW:
        logs.get("llmgw.openfiles").warning(
            "open_files_low",
            limit=now,
            before=before,
            action="raise the hard limit on open files (LimitNOFILE in the systemd unit, "
            "`ulimit -Hn` in a shell, the container's nofile ulimit): a busy service needs "
            "one per connection",
        )

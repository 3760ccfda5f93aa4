"""What one request came to, and the access log's line that says so.

The front door (llmgw.router.app) fills an `Outcome` as the request goes: the model
once admitted, the key, what its limits hold; the dispatcher (llmgw.router.dispatch)
adds where it went, for the access log only, and only when that log is on, so the
request path costs the same without it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from llmgw import logs
from llmgw.router import auth
from llmgw.router.attempts import Attempt
from llmgw.router.holds import Held
from llmgw.router.tracing import RequestTrace

log = logs.get("llmgw.router")

AccessLog = Callable[..., Any]
"""The logger's method the access log's lines are written with (`log.info`, `log.debug`)."""


def access_log(enabled: bool) -> AccessLog | None:
    """How the access log is written: at info when the router's `access_log` says so, at
    debug when the log shows debug lines (it always did), else not at all. Decided once:
    requests then test one attribute."""
    if enabled:
        return log.info
    if log.is_enabled_for(logging.DEBUG):
        return log.debug
    return None


class Outcome:
    """What a request's metrics and access log record: the model (once known), the status
    when it is not the response's own (0: the response's), its tokens and key; and, with
    the access log on, where it went (`routed`)."""

    __slots__ = (
        "attempts", "cached_predicted", "endpoint", "held", "key", "model", "node",
        "principal", "served", "status", "tokens", "trace",
    )  # fmt: skip

    def __init__(self) -> None:
        self.trace: RequestTrace | None = None
        self.model = "unknown"
        self.status = 0
        self.tokens = (0, 0)
        self.key: str | None = None
        """The name of the key it authenticated with, whatever came after: a key refused
        a model, or its body, is named in the access log too."""
        self.principal: auth.Principal | None = None
        """The key, once admitted to a model (its name labels the key metrics)."""
        self.held: Held | None = None
        """The tokens its key's limits hold for it, settled when it ends."""
        self.attempts = 0
        """Endpoints it was sent to: more than one when it was retried or fell back."""
        self.endpoint: str | None = None
        """The endpoint its last attempt went to (None: it was sent to none)."""
        self.node: str | None = None
        """That endpoint's node, where the router knows it."""
        self.served: str | None = None
        """The model of its last attempt, where it is not the model asked (a fallback)."""
        self.cached_predicted: int | None = None
        """Prompt tokens predicted cached at that endpoint, where the cache ranked it."""

    def routed(self, last: Attempt | None, attempts: int, cached_predicted: int) -> None:
        """Where the dispatcher sent it: `attempts` endpoints, `last` the last of them, with
        `cached_predicted` tokens predicted cached there (-1: its model's endpoints were
        not ranked on the cache)."""
        self.attempts = attempts
        if last is None:
            return
        ep = last.endpoint
        self.endpoint, self.node = ep.id, ep.node or None
        served = last.profile.name
        self.served = served if served != self.model else None
        self.cached_predicted = cached_predicted if cached_predicted >= 0 else None

    def write(self, line: AccessLog, rid: str, api: str, took: float, status: int) -> None:
        """The access log's line of the request: who asked for what, where it went, how it
        ended."""
        t_in, t_out = self.tokens
        line("request", request_id=rid, api=api, model=self.model, status=status,
             duration_s=took, key=self.key, tokens_in=t_in,
             tokens_out=t_out, endpoint=self.endpoint, node=self.node,
             served_model=self.served, attempts=self.attempts,
             predicted_cached=self.cached_predicted)  # fmt: skip

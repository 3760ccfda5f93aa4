"""Asking a local engine how far it got: nothing listening, up (listening or answering
but the model not listed), or ready (`/health` is 200 and `/v1/models` lists the
served name). Routing on /health alone sends traffic into a loading model.
Used by `llmgw.agent.supervisor`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Literal

import aiohttp

from llmgw.agent.engines.common import Launch
from llmgw.core.events import ShardPhase
from llmgw.core.profile import LaunchSpec
from llmgw.engine_http import bounded_body
from llmgw.jsondepth import nested_deeper_than

Probe = Literal["down", "up", "ready"]

MAX_MODELS_DEPTH = 32
"""The deepest a `/v1/models` body may nest (vLLM's: an object, its list, a model, its
permissions' list, one of them: five)."""
MAX_MODELS_BYTES = 1024 * 1024
"""The most of a `/v1/models` body a probe reads: an engine lists a few names (a few
hundred LoRA adapters at most), and the agent must not hold whatever a port answers."""


class Prober:
    """Probes engines over one HTTP session, opened at the first probe with that probe's
    timeout; `close()` releases it."""

    def __init__(self) -> None:
        self._http: aiohttp.ClientSession | None = None

    async def probe(self, launch: Launch, timeout_s: float) -> Probe:
        """down: nothing listens; up: listening or answering, not ready; ready: model listed.

        A TCP connect that succeeds counts as up: vLLM binds its port before it
        loads the weights, and its HTTP requests stall until loading ends.
        """
        host, port = launch.probe_host, launch.port
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
        except (TimeoutError, OSError):
            return "down"
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))
        base = f"http://{host}:{port}"
        headers = {"Authorization": f"Bearer {launch.api_key}"} if launch.api_key else None
        # Redirects are not followed (a 3xx is no 200): an engine must not point the agent,
        # its key and the node's network position at another address.
        try:
            async with self._http.get(f"{base}/health", allow_redirects=False) as resp:
                if resp.status != 200:
                    return "up"
            async with self._http.get(
                f"{base}/v1/models", headers=headers, allow_redirects=False
            ) as resp:
                if resp.status != 200:
                    return "up"
                raw = await bounded_body(resp, MAX_MODELS_BYTES)
        except (TimeoutError, aiohttp.ClientError):
            return "up"
        # A list of names nests a few levels: one nested deeper is not decoded at all
        # (decoding it would recurse to the interpreter's limit: llmgw.jsondepth).
        if raw is None or nested_deeper_than(raw, MAX_MODELS_DEPTH):
            return "up"
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            return "up"
        return "ready" if launch.served_name in listed_models(body) else "up"

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None


def listed_models(body: object) -> set[str]:
    """The model ids a `/v1/models` body lists; none for a body of another shape. An id
    that is not a string names nothing (and one that is a list or an object, unhashable,
    raised out of the probe and ended the shard's watch)."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return set()
    return {m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)}


class Startup:
    """The clock of one engine's start: when it began, when it first answered, and the
    deadlines its phases must meet."""

    def __init__(self, launch: Launch, spec: LaunchSpec, began: float) -> None:
        self.launch = launch
        self.spec = spec
        self.began = began
        self.up_since: float | None = None
        """When a probe first found the engine listening or answering."""
        self.deadline = spec.start_timeout_s
        self.rule = "start_timeout_s"
        if not launch.listens_before_loading:
            self.deadline += spec.load_timeout_s
            self.rule = "start_timeout_s + load_timeout_s: this engine listens only once loaded"

    def overdue(self, phase: ShardPhase, now: float) -> str:
        """Why an engine in `phase` has failed to start by `now`; empty while it is in time."""
        launch, spec = self.launch, self.spec
        if phase == "starting" and now - self.began > self.deadline:
            return (
                f"engine did not open port {launch.port} within {self.deadline:g} s ({self.rule})"
            )
        if (
            phase == "loading"
            and self.up_since is not None
            and now - self.up_since > spec.load_timeout_s
        ):
            return (
                f"/v1/models did not list {launch.served_name!r} within "
                f"{spec.load_timeout_s:g} s of the engine opening its port "
                "(load_timeout_s)"
            )
        return ""

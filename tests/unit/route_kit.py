"""A router in-process, with a fleet state the test sets, for comparing what the admin
listener's `POST /route` says of a body with where the front door sends the same body.

Both are driven through their real handlers (llmgw.router.front.build_server and
llmgw.router.admin.build_admin_server) with mocked requests; the engine is never asked:
an attempt records where it went and answers 200. The clocks the router reads are frozen
for the duration, so that /route and the front door see the same moment.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import msgspec
from aiohttp import web
from aiohttp.streams import StreamReader
from aiohttp.test_utils import make_mocked_request

from llmgw.core import kvblocks, tenancy
from llmgw.core.kvblocks import KvUpdate
from llmgw.core.profile import ModelProfile
from llmgw.router import admin, app, auth, dispatch, explain, front, kvroute, prompts, requests
from llmgw.router.attempts import Attempt
from llmgw.router.config import (
    AuthConfig,
    CacheConfig,
    EndpointConfig,
    RouterConfig,
    TenancyConfig,
)
from llmgw.router.errors import Retry
from llmgw.router.relay import ClientStream

MONOTONIC = 5_000.0
WALL = 1_750_000_000.0
SESSION = "x-session-id"

MODELS = (
    ModelProfile(name="m", engine="sim", aliases=("ma",), fallbacks=("f",)),
    ModelProfile(name="f", engine="sim"),
    ModelProfile(name="w", engine="llamacpp", fallbacks=("m",)),
)
"""A tokenized model with an alias and a fallback, its fallback, and a model the router
cannot tokenize (ranked by weights) whose engine serves fewer APIs, falling back to `m`."""
ENDPOINTS = ("e0", "e1", "e2", "e3")
NODES = {"e0": "n0", "e1": "n0", "e2": "n1", "e3": "n2"}
TENANTS = {"ka": ("t1", ("*",)), "kb": ("t2", ("*",)), "kc": ("t1", ("m", "ma"))}
"""Key name -> (team, models it may use)."""
SECRETS = {name: f"sk-llmgw-route-truth-{name}-0123456789abcdef" for name in TENANTS}


def _keys_file() -> str:
    folder = Path(tempfile.mkdtemp(prefix="route-kit-"))
    entries = [
        {"name": name, "sha256": auth.digest(SECRETS[name]), "team": team, "models": list(models)}
        for name, (team, models) in TENANTS.items()
    ]
    path = folder / "keys.json"
    path.write_bytes(msgspec.json.encode({"keys": entries}))
    return str(path)


KEYS_FILE = _keys_file()


def config(
    mode: tenancy.CacheIsolation,
    served: dict[str, tuple[str, ...]] | None = None,
    recent_s: float = 2.0,
) -> RouterConfig:
    """A router of `MODELS` on `ENDPOINTS` (`served`: endpoint -> its models; all of them by
    default), its caches isolated as `mode` says."""
    served = served or {}
    return RouterConfig(
        models=MODELS,
        endpoints=tuple(
            EndpointConfig(
                id=ep,
                url=f"http://127.0.0.1:{9000 + i}",
                node=NODES[ep],
                models=served.get(ep, ("m", "f", "w")),
            )
            for i, ep in enumerate(ENDPOINTS)
        ),
        auth=AuthConfig(allow_anonymous=True, keys_file=KEYS_FILE),
        tenancy=TenancyConfig(cache_isolation=mode),
        cache=CacheConfig(recent_s=recent_s),
        seed=11,
    )


class _Frozen:
    """The `time` module with its clocks stopped."""

    monotonic = staticmethod(lambda: MONOTONIC)
    time = staticmethod(lambda: WALL)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


CLOCKED: tuple[ModuleType, ...] = (app, admin, dispatch, explain, kvroute)


@contextlib.contextmanager
def frozen_clocks() -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for module in CLOCKED:
            if hasattr(module, "time"):
                stack.enter_context(mock.patch.object(module, "time", _Frozen()))
        yield


def _request(
    path: str, body: bytes, headers: dict[str, str], method: str = "POST", whole: bool = True
) -> web.BaseRequest:
    """A request of `body` (`whole`: all of it sent; else more is still to come)."""
    loop = asyncio.get_running_loop()
    reader = StreamReader(mock.Mock(_reading_paused=False), 2**16, loop=loop)
    reader.feed_data(body)
    if whole:
        reader.feed_eof()
    return make_mocked_request(method, path, headers=headers, payload=reader)


class Fleet:
    """A router in-process whose attempts record where they went."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.router = app.Router(cfg, clock=lambda: WALL)
        self.front = front.build_server(self.router)
        self.admin = admin.build_admin_server(self.router)
        self.attempts: list[tuple[str, str]] = []
        self.router.dispatcher._attempt = self._attempt  # type: ignore[method-assign]

    async def _attempt(self, at: Attempt, body: bytes, state: ClientStream) -> web.StreamResponse:
        self.attempts.append((at.endpoint.id, at.profile.name))
        return web.Response(status=200, body=b"{}", content_type="application/json")

    def endpoint(self, ep_id: str) -> Any:
        return self.router.table.by_id[ep_id]

    async def send(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, str | None]:
        """The front door's answer to a request, and the endpoint its first attempt went to."""
        before = len(self.attempts)
        resp = await self.front.request_handler(_request(path, body, headers))  # type: ignore[misc]
        went = self.attempts[before][0] if len(self.attempts) > before else None
        return resp.status, went

    async def route(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, Any]:
        """The admin listener's `/route` answer for a body the front door would get at `path`."""
        asked = f"/route?path={path}"
        resp = await self.admin.request_handler(_request(asked, body, headers))  # type: ignore[misc]
        assert isinstance(resp, web.Response)
        assert isinstance(resp.body, bytes)
        return resp.status, msgspec.json.decode(resp.body)

    async def admin_answer(
        self, method: str, path: str, headers: dict[str, str], body: bytes = b"",
        whole: bool = True,
    ) -> web.Response:  # fmt: skip
        """The admin listener's answer to any request."""
        resp = await self.admin.request_handler(_request(path, body, headers, method, whole))  # type: ignore[misc]
        assert isinstance(resp, web.Response)
        return resp

    def cached(self, ep_id: str, parsed: requests.Parsed, salt: str | None, blocks: int) -> None:
        """The engine of `ep_id` reports holding the first `blocks` blocks of a prompt sent
        with `cache_salt` = `salt` (its KV events, as an agent relays them)."""
        tokens = prompts.for_profile(MODELS[0])
        assert tokens is not None
        got = tokens.tokens(parsed)
        if got is not None:
            self.reports(ep_id, got.keys(16, kvblocks.salt_root(salt))[:blocks])

    def reports(self, ep_id: str, keys: list[int]) -> None:
        """The engine of `ep_id` reports storing the blocks of `keys` (none: it reports,
        holding nothing more)."""
        index = self.router.dispatcher.kv.index
        held = index.endpoints.get((NODES[ep_id], ep_id))
        seq = held.seq + 1 if held is not None else 1
        update = KvUpdate(endpoint=ep_id, model="m", block_size=16, instance="i", seq=seq,
                          full=held is None, stored=keys, roots=keys[:1], ts=WALL)  # fmt: skip
        assert index.apply(update, NODES[ep_id], WALL) is None


CHAT = "/v1/chat/completions"


class Recording(Fleet):
    """A fleet of `m` and `w` on e0 and e1 and of `f` on e2, all ready (e3 never is), whose
    attempts also record the request id and the body each one sends; attempts on a model in
    `failing` fail as an engine's 503 would. `anonymous`: keyless requests are served."""

    def __init__(self, failing: tuple[str, ...] = (), anonymous: bool = True) -> None:
        cfg = config("shared", {"e0": ("m", "w"), "e1": ("m", "w"), "e2": ("f",)})
        if not anonymous:
            cfg = msgspec.structs.replace(cfg, auth=AuthConfig(keys_file=KEYS_FILE))
        super().__init__(cfg)
        for ep_id in ("e0", "e1", "e2"):
            self.endpoint(ep_id).ready = True
        self.failing = failing
        self.sent: list[tuple[str, str, dict[str, Any]]] = []
        self.drops_usage: list[bool] = []
        self.router.dispatcher._attempt = self._recorded  # type: ignore[method-assign]

    async def _recorded(self, at: Attempt, body: bytes, state: ClientStream) -> web.StreamResponse:
        self.sent.append((at.profile.name, state.rid, msgspec.json.decode(body)))
        self.drops_usage.append(state.drop_usage)
        if at.profile.name in self.failing:
            raise Retry("status_503", 503, "engine answered 503")
        return await self._attempt(at, body, state)

    async def get(self, path: str, headers: dict[str, str]) -> tuple[int, Any]:
        resp = await self.front.request_handler(_request(path, b"", headers, "GET"))
        assert isinstance(resp, web.Response)
        assert isinstance(resp.body, bytes)
        return resp.status, msgspec.json.decode(resp.body)

    async def chat(
        self, model: str, headers: dict[str, str] | None = None, **fields: Any
    ) -> web.StreamResponse:
        body = msgspec.json.encode(
            {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            | fields
        )
        hs = {"Content-Type": "application/json", **(headers or {})}
        resp: web.StreamResponse = await self.front.request_handler(_request(CHAT, body, hs))
        return resp

    def close(self) -> None:
        self.router.pool.close()
        self.router.deadlines.close()


def auth_headers(key: str | None, session: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {SECRETS[key]}"
    if session is not None:
        headers[SESSION] = session
    return headers

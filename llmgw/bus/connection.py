"""Connections to NATS: mutual TLS, one identity, and reconnection that never gives up.

Every llmgw process (agent, control plane, router, `llmgw ctl`) talks to the log
through one `BusClient` made by `connect`. It differs from a plain nats-py client
in three ways that matter in production:

- it reconnects forever, waiting an exponentially growing, jittered delay between
  attempts, so a fleet of agents does not stampede a restarted server in lockstep;
- its error callback recognises a permissions violation and logs it as such (a
  JetStream publish the server refuses on permissions otherwise surfaces only as a
  timeout, see docs/design.md) and keeps the recent ones in `permission_violations`;
- it can hand the messages of a subscription straight to a synchronous function
  (`fast_subscribe`), skipping nats-py's per-message header parsing and queueing;
  the `Reader` uses it to replay the log several times faster.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.protocol.parser import Parser

from llmgw import logs
from llmgw.bus.keys import Keys, bind
from llmgw.bus.wire import FastHandler, FrameParser
from llmgw.pki.identity import Identity

log = logs.get("llmgw.bus")

ErrorCallback = Callable[[Exception], Awaitable[None]]


def backoff_delay(attempt: int, *, base: float, cap: float, rand: random.Random) -> float:
    """Seconds to wait before reconnect attempt `attempt` (1, 2, ...). Pure given `rand`.

    "Full jitter": uniform in [0, min(cap, base * 2**(attempt-1))], with a floor of
    a tenth of the window so that a failing server is never hammered in a tight loop.
    """
    window = min(cap, base * (2.0 ** min(max(attempt - 1, 0), 30)))
    return float(window * (0.1 + 0.9 * rand.random()))


class BusClient(Client):
    """A nats-py client with jittered exponential reconnect backoff and a fast dispatch path."""

    def __init__(self) -> None:
        super().__init__()
        self.permission_violations: deque[str] = deque(maxlen=100)
        self.backoff_base = 0.25
        self.backoff_cap = 10.0
        self._rand = random.Random()
        self._fast: dict[int, FastHandler] = {}
        self._failed_attempts = 0
        # Message frames without nats-py's per-frame regular expressions (llmgw.bus.wire);
        # only over the parser it was written against.
        if type(self._ps) is Parser:
            self._ps = FrameParser(self)

    # nats-py's own loop waits a fixed `reconnect_time_wait` between attempts at the
    # same server. This replaces it with a jittered exponential backoff; the body
    # otherwise follows nats-py 2.16's `_select_next_server`.
    async def _select_next_server(self) -> None:
        while True:
            if len(self._server_pool) == 0:
                self._current_server = None
                raise nats.errors.NoServersError
            server = self._server_pool.pop(0)
            max_attempts = self.options["max_reconnect_attempts"]
            if max_attempts > 0 and server.reconnects > max_attempts:
                continue
            self._server_pool.append(server)
            if server.last_attempt is not None or self._failed_attempts:
                self._failed_attempts += 1
                delay = backoff_delay(
                    self._failed_attempts,
                    base=self.backoff_base,
                    cap=self.backoff_cap,
                    rand=self._rand,
                )
                await asyncio.sleep(delay)
            try:
                await self._connect_to_server(server)
            except Exception as exc:
                server.last_attempt = time.monotonic()
                # What `max_reconnect_attempts` counts: without it a client that should
                # give up (ctl, tests) would retry a dead server forever.
                server.reconnects += 1
                log.warning(
                    "bus.connect_failed",
                    server=server.uri.netloc,
                    attempt=self._failed_attempts + 1,
                    error=str(exc) or type(exc).__name__,
                )
                continue
            self._current_server = server
            self._failed_attempts = 0
            server.last_attempt = None
            server.reconnects = 0
            return

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes
    ) -> None:
        handler = self._fast.get(sid)
        if handler is None:
            await super()._process_msg(sid, subject, reply, data, headers)
            return
        self.stats["in_msgs"] += 1
        self.stats["in_bytes"] += len(data)
        try:
            handler(subject, reply, data, headers or b"")
        except Exception as exc:  # a handler bug must not kill the connection's reader
            log.error("bus.fast_handler_failed", error=repr(exc))

    async def fast_subscribe(self, subject: str, handler: FastHandler) -> Subscription:
        """Subscribe with `handler` called inline, in order, for every message on `subject`.

        The handler gets raw bytes and must not block; it is the caller's job to decode.
        """
        sub = await self.subscribe(subject)
        self._fast[sub._id] = handler
        return sub

    async def fast_unsubscribe(self, sub: Subscription) -> None:
        self._fast.pop(sub._id, None)
        with contextlib.suppress(
            nats.errors.ConnectionClosedError, nats.errors.BadSubscriptionError
        ):
            await sub.unsubscribe()


def _describe(exc: Exception) -> str:
    return str(exc) or type(exc).__name__


async def connect(
    servers: str | Sequence[str],
    *,
    tls: ssl.SSLContext | None,
    identity: Identity | None,
    name: str,
    tls_hostname: str | None = None,
    connect_timeout: int = 5,
    max_reconnect_attempts: int = -1,
    error_cb: ErrorCallback | None = None,
    keys: Keys | None = None,
    **options: Any,
) -> BusClient:
    """Connect to NATS as `identity` over mutual TLS (`tls` from llmgw.pki).

    Reconnects forever by default (`max_reconnect_attempts=-1`), also on the
    first connection: a daemon started before its server waits for it. Pass a
    positive `max_reconnect_attempts` where giving up is right (`llmgw ctl`, tests).
    `error_cb`, when given, is called after the bus has logged the error.
    `keys` (llmgw.bus.keys) sign what is published and check what is read on this
    connection; their signer must be `identity`.
    """
    if keys is not None and keys.signer is not None and keys.signer.identity != identity:
        raise ValueError(
            f"the signing certificate is {keys.signer.identity}'s, not {identity}'s: "
            "sign with the certificate this service connects with"
        )
    nc = BusClient()
    if keys is not None:
        bind(nc, keys)
    server_list = [servers] if isinstance(servers, str) else list(servers)
    who = str(identity) if identity is not None else name

    async def on_error(exc: Exception) -> None:
        text = _describe(exc)
        if "permissions violation" in text.lower():
            nc.permission_violations.append(text)
            # The identity's certificate does not allow this: a bug or a misconfigured
            # authorization, never something a retry fixes.
            log.error("bus.permission_violation", identity=who, detail=text)
        else:
            log.warning("bus.error", identity=who, error=text)
        if error_cb is not None:
            await error_cb(exc)

    async def on_disconnected() -> None:
        log.warning("bus.disconnected", identity=who)

    async def on_reconnected() -> None:
        url = nc.connected_url
        log.info("bus.reconnected", identity=who, server=url.netloc if url else None)

    async def on_closed() -> None:
        log.info("bus.closed", identity=who)

    if identity is not None:
        options.setdefault("inbox_prefix", identity.inbox_prefix)
    await nc.connect(
        servers=server_list,
        name=name,
        tls=tls,
        tls_hostname=tls_hostname,
        connect_timeout=connect_timeout,
        allow_reconnect=True,
        max_reconnect_attempts=max_reconnect_attempts,
        reconnect_time_wait=0,  # BusClient waits its own jittered backoff instead
        error_cb=on_error,
        disconnected_cb=on_disconnected,
        reconnected_cb=on_reconnected,
        closed_cb=on_closed,
        **options,
    )
    url = nc.connected_url
    log.info("bus.connected", identity=who, server=url.netloc if url else None)
    return nc

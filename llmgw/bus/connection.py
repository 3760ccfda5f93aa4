"""Connections to NATS: mutual TLS, one identity, and reconnection that never gives up.

Every llmgw process (agent, control plane, router, `llmgw ctl`) talks to the log
through one `BusClient` made by `connect`. It differs from a plain nats-py client
in three ways that matter in production:

- it reconnects forever, waiting an exponentially growing, jittered delay between
  attempts, so a fleet of agents does not stampede a restarted server in lockstep;
- its error callback recognises a permissions violation and logs it as such (a
  JetStream publish the server refuses on permissions otherwise surfaces only as a
  timeout, see docs/design.md) and keeps the recent ones in `permission_violations`;
  a TLS refusal (llmgw.bus.tlsrefusal: a server certificate this client's CA did not sign,
  a client certificate the server will not take) is logged as `tls_refused` with what to
  change, and ends the first connection at once where the caller asks (`llmgw ctl`);
- it can hand the messages of a subscription straight to a synchronous function
  (`fast_subscribe`), skipping nats-py's per-message header parsing and queueing;
  the `Reader` uses it to replay the log several times faster.

The backoff and the fast path override nats-py internals; they live in
llmgw.bus.natspy, behind a check of nats-py's version.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypedDict

from llmgw import logs
from llmgw.bus import natspy
from llmgw.bus.keys import Keys, bind
from llmgw.bus.natspy import backoff_delay as backoff_delay
from llmgw.bus.tlsrefusal import Refusal, TlsRefused, refusal
from llmgw.pki.identity import Identity

log = logs.get("llmgw.bus")

ErrorCallback = Callable[[Exception], Awaitable[None]]
_Notice = Callable[[], Awaitable[None]]


class BusClient(natspy.Client):
    """A nats-py client with llmgw's reconnect backoff and fast dispatch (llmgw.bus.natspy),
    and a record of the permission violations the server reported."""

    def __init__(self) -> None:
        super().__init__()
        self.permission_violations: deque[str] = deque(maxlen=100)
        self.connected_once = False
        """Whether `connect` has returned: what fails after is an outage, not a setup."""


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
    fail_on_tls_refusal: bool = False,
    **options: Any,
) -> BusClient:
    """Connect to NATS as `identity` over mutual TLS (`tls` from llmgw.pki).

    Reconnects forever by default (`max_reconnect_attempts=-1`), also on the
    first connection: a daemon started before its server waits for it. Pass a
    positive `max_reconnect_attempts` where giving up is right (`llmgw ctl`, tests).
    `error_cb`, when given, is called after the bus has logged the error.
    `keys` (llmgw.bus.keys) sign what is published and check what is read on this
    connection; their signer must be `identity`.
    `fail_on_tls_refusal`: a TLS refusal on the first connection raises TlsRefused at
    once (a command: no retry mends it). Off, the client retries it with the rest (a
    service: the server may come back with a certificate of its CA).
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
    callbacks = _logging_callbacks(nc, who, error_cb, fail_on_tls_refusal)
    if identity is not None:
        options.setdefault("inbox_prefix", identity.inbox_prefix)
    try:
        await nc.connect(
            servers=server_list,
            name=name,
            tls=tls,
            tls_hostname=tls_hostname,
            connect_timeout=connect_timeout,
            allow_reconnect=True,
            max_reconnect_attempts=max_reconnect_attempts,
            # 0 where BusClient waits its own jittered backoff instead (llmgw.bus.natspy).
            reconnect_time_wait=nc.reconnect_wait_s,
            **callbacks,
            **options,
        )
    except TlsRefused:
        await close(nc)
        raise
    nc.connected_once = True
    url = nc.connected_url
    log.info("connected", identity=who, server=url.netloc if url else None)
    return nc


async def close(nc: natspy.Client, timeout_s: float = 5.0) -> None:
    """Close `nc` if open, within `timeout_s`, never raising: a shutdown goes on whatever the
    connection's state. nats-py's close fails in more ways than its errors (an
    AttributeError from asyncio's TLS transport when the server went away mid-reconnect)."""
    if nc.is_closed:
        return
    try:
        await asyncio.wait_for(nc.close(), timeout_s)
    except Exception as exc:
        log.debug("close_failed", error=_describe(exc))


class _Callbacks(TypedDict):
    error_cb: ErrorCallback
    disconnected_cb: _Notice
    reconnected_cb: _Notice
    closed_cb: _Notice


def _logging_callbacks(
    nc: BusClient, who: str, error_cb: ErrorCallback | None, fail_on_tls_refusal: bool
) -> _Callbacks:
    """nats-py's connection callbacks (`error_cb`, `disconnected_cb`, `reconnected_cb`,
    `closed_cb`, as its connect takes them), each logging as `who`. An error is also
    handed to `error_cb`, after a permissions violation is kept in
    `nc.permission_violations`. With `fail_on_tls_refusal`, a TLS refusal before the
    first connection instead raises TlsRefused out of nats-py's connect, for the caller
    to report."""

    said: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        if said and exc is said[0]:
            return  # nats-py's close after a failed attempt raises the attempt's error again
        said[:] = [exc]
        text = _describe(exc)
        refused = refusal(exc)
        if refused is not None and fail_on_tls_refusal and not nc.connected_once:
            raise TlsRefused(nc.server_tried, refused)
        if refused is not None:
            _log_refusal(who, nc.server_tried, refused)
        elif "permissions violation" in text.lower():
            nc.permission_violations.append(text)
            # The identity's certificate does not allow this: a bug or a misconfigured
            # authorization, never something a retry fixes.
            log.error("permission_violation", identity=who, detail=text)
        else:
            log.warning("error", identity=who, error=text)
        if error_cb is not None:
            await error_cb(exc)

    async def on_disconnected() -> None:
        log.warning("disconnected", identity=who)

    async def on_reconnected() -> None:
        url = nc.connected_url
        log.info("reconnected", identity=who, server=url.netloc if url else None)

    async def on_closed() -> None:
        log.info("closed", identity=who)

    return _Callbacks(
        error_cb=on_error,
        disconnected_cb=on_disconnected,
        reconnected_cb=on_reconnected,
        closed_cb=on_closed,
    )


_REFUSAL_ACTIONS = {
    "server_untrusted": "set this service's ca_file to the fleet's CA (`llmgw ctl cert init`'s"
    " ca.pem), or give the server a certificate of that CA (`llmgw ctl cert server`)",
    "server_name": "list in servers a name or address the server's certificate holds, or"
    " reissue the server's certificate with it (`llmgw ctl cert server --host`)",
    "server_dates": "reissue the server's certificate (`llmgw ctl cert server`), or check"
    " this machine's clock",
    "server_other": "set this service's ca_file to the fleet's CA, or give the server a"
    " certificate of that CA (`llmgw ctl cert server`)",
    "client_refused": "give this service a certificate of the fleet's CA that the server"
    " admits (`llmgw ctl cert issue KIND NAME`), and the server that CA in its ca_file",
}


def _log_refusal(who: str, server: str, refused: Refusal) -> None:
    """One `tls_refused` line: what the server or its certificate refused, and what to
    change; the client goes on retrying, since a server may come back with another."""
    log.error(
        "tls_refused",
        identity=who,
        server=server,
        problem=refused.problem,
        detail=refused.detail,
        action=_REFUSAL_ACTIONS[refused.kind] + "; retrying meanwhile",
    )

"""The engines' KV blocks on NATS: agents publish `KvUpdate`s, routers read them.

Each node's agent relays what its engines hold (llmgw.agent.kvrelay) as signed
`llmgw.core.kvblocks.KvUpdate` messages on `llmgw.kv.<node>.<endpoint>`, which only that
node may publish (llmgw.pki.authorization) and the stream `llmgw-kv` keeps for a minute
(llmgw.bus.provisioning). They are published without waiting for an acknowledgement: an
update lost is healed by the agent's next full update, a few seconds later, and an engine
step must never wait on the bus.

`KvReader` is a `Reader` over that stream: the same consumer, order and signature
checks, but its records carry a `KvUpdate` in `event`, and an update whose endpoint is
not the one its subject names is refused, as a log event off its owner's subject is.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, cast

from nats.aio.client import Client

from llmgw import logs
from llmgw.bus.intake import Record
from llmgw.bus.keys import signer_of
from llmgw.bus.reader import Reader
from llmgw.core import kvblocks, subjects
from llmgw.pki.signing import Signer

log = logs.get("llmgw.bus")

START_WINDOW_S = 12.0
"""How far back a KvReader starts: more than two of every engine's full updates (each
agent sends one every `llmgw.agent.kvrelay.FULL_EVERY_S`), so a router that starts now
has each engine's whole resident set in the first second."""


class KvPublisher:
    """Signs and publishes one node's KV updates (fire and forget)."""

    def __init__(self, nc: Client, node: str, *, signer: Signer | None = None) -> None:
        self._nc = nc
        self._node = subjects.check_token(node, "node id")
        self.signer = signer_for(nc, signer, "KV updates")
        self.sent = 0
        self.bytes = 0

    async def publish(self, update: kvblocks.KvUpdate) -> None:
        subject = subjects.kv_updates(self._node, update.endpoint)
        payload = kvblocks.encode_update(update)
        await publish_signed(self._nc, self.signer, subject, payload)
        self.sent += 1
        self.bytes += len(payload)


async def publish_signed(nc: Client, signer: Signer, subject: str, payload: bytes) -> None:
    """Publish derived data (not the log) signed, without waiting for an acknowledgement."""
    msg_id = secrets.token_hex(12)
    headers = {"Nats-Msg-Id": msg_id}
    headers.update(signer.event_headers(subject, msg_id, payload))
    await nc.publish(subject, payload, headers=headers)


def signer_for(nc: Client, signer: Signer | None, who: str) -> Signer:
    """`signer`, or the one `bus.connect(..., keys=...)` attached to `nc`."""
    found = signer if signer is not None else signer_of(nc)
    if found is None:
        raise ValueError(
            f"a publisher of {who} needs a Signer: connect with bus.connect(..., keys=...) "
            "using this identity's certificate and key, or pass signer="
        )
    return found


class KvReader(Reader):
    """Reads `llmgw-kv` from `START_WINDOW_S` ago (or `since`), then follows it."""

    def __init__(self, nc: Client, *, since: float | None = None, **options: Any) -> None:
        options.setdefault("name", "kv")
        options.setdefault("batch", 2_000)
        # Unbounded, unlike the log's readers: bounded, a node's flood of large updates had
        # the router fold all of it, its event loop late by 56 ms at the median; unbounded,
        # the server closes the feed's own connection, which costs the KV index alone
        # (docs/security.md, "The engines' KV blocks").
        options.setdefault("max_bytes", 0)
        super().__init__(
            nc,
            since=time.time() - START_WINDOW_S if since is None else since,
            subjects_filter=subjects.KV_SUBJECTS,
            stream=subjects.KV_STREAM,
            **options,
        )

    def _accept(
        self, seq: int, name: str, data: bytes, size: int, ttl: bytes | None, when: float
    ) -> None:
        owner = subjects.kv_owner(name)
        try:
            update = kvblocks.decode_update(data)
        except ValueError as exc:
            self._skip(seq, name, when, str(exc), size=size)
            return
        if owner is None or owner[1] != update.endpoint:
            self._skip(
                seq,
                name,
                when,
                f"a KV update of {update.endpoint!r} does not belong on {name}",
                size=size,
            )
            return
        # Records of this stream carry a KvUpdate where the log's carry an event.
        self._buf.append(Record(seq, name, when, cast(Any, update), size))


def update_of(record: Record) -> kvblocks.KvUpdate:
    """The KvUpdate a KvReader's record carries."""
    return cast(kvblocks.KvUpdate, record.event)

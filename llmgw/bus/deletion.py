"""Deleting messages from the log by sequence: what the control plane does with messages
that no fold uses (a quarantined node's flood, messages with a forbidden TTL).

`delete_messages(nc, seqs)` sends one `$JS.API.STREAM.MSG.DELETE.<stream>` request per
sequence, a bounded number at a time, and says how many the server deleted, how many
were already gone (deleted before, or expired) and which failed. Only the control
identity may call it (llmgw.pki.authorization `_manage_stream`). `no_erase` spares the
server overwriting the bytes on disk: the point is to free the log's storage, fast.

Deleting a message never changes any fold if no fold uses it; the caller decides that.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable

import msgspec
import nats.errors
from nats.aio.client import Client

from llmgw.core import subjects

_API = "$JS.API"
_NO_MESSAGE = 10037
"""JetStream's error code for "no message found": deleted already, or expired."""


class Deleted(msgspec.Struct, kw_only=True):
    """What `delete_messages` did."""

    deleted: int = 0
    gone: int = 0
    """Not there any more (deleted before, or expired): nothing to do."""
    failed: list[tuple[int, str]] = []
    """(sequence, why) of each request that failed: try again later."""


async def delete_messages(
    nc: Client,
    seqs: Iterable[int],
    *,
    stream: str = subjects.STREAM,
    concurrency: int = 32,
    timeout_s: float = 5.0,
) -> Deleted:
    """Delete the messages at `seqs` from `stream`; never raises for one message's failure."""
    out = Deleted()
    subject = f"{_API}.STREAM.MSG.DELETE.{stream}"
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(seq: int) -> None:
        body = json.dumps({"seq": seq, "no_erase": True}).encode()
        async with gate:
            try:
                msg = await nc.request(subject, body, timeout=timeout_s)
            except (TimeoutError, nats.errors.Error) as exc:
                out.failed.append((seq, str(exc) or type(exc).__name__))
                return
        try:
            resp = json.loads(msg.data)
        except ValueError:
            out.failed.append((seq, "the server's answer is not JSON"))
            return
        err = resp.get("error") if isinstance(resp, dict) else None
        if err:
            if err.get("err_code") == _NO_MESSAGE:
                out.gone += 1
            else:
                out.failed.append((seq, f"{err.get('description')} (code {err.get('err_code')})"))
        elif isinstance(resp, dict) and resp.get("success"):
            out.deleted += 1
        else:
            out.failed.append((seq, f"unexpected answer {resp!r}"))

    await asyncio.gather(*(one(seq) for seq in sorted(set(seqs))))
    return out

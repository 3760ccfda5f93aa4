"""JetStream counters: add to a subject's total and learn the new total, or read totals.

A counter stream (`allow_msg_counter`, nats-server 2.12 and later) keeps one total per
subject: a publish with the header `Nats-Incr: +N` adds N (N may be 0, which only reads)
and the server's acknowledgement carries the total after it. The server applies
increments one after another, so every writer's answer is exact without any coordination
between them: what llmgw's fleet-wide limits and usage stand on (llmgw.core.quota).
"""

from __future__ import annotations

import json

import nats.errors
from nats.aio.client import Client
from nats.js import api
from nats.js.client import JetStreamContext

from llmgw import logs

log = logs.get("llmgw.bus.counters")


class CounterError(RuntimeError):
    """The server did not add to a counter (no stream, refused, no answer in time)."""


class Counters:
    """Adds to counters over one connection."""

    def __init__(self, nc: Client, *, timeout_s: float = 0.5) -> None:
        self.nc = nc
        self.timeout_s = timeout_s

    async def add(self, subject: str, amount: int) -> int:
        """Add `amount` (0 reads) to the counter on `subject`; the total after it."""
        try:
            msg = await self.nc.request(
                subject, b"", timeout=self.timeout_s, headers={"Nats-Incr": f"{amount:+d}"}
            )
        except nats.errors.NoRespondersError:
            raise CounterError(f"no counter stream holds {subject}: is it provisioned?") from None
        except nats.errors.Error as exc:  # a timeout, a closed or reconnecting connection
            raise CounterError(f"no answer for {subject}: {type(exc).__name__}") from None
        return total_of(msg.data, subject)


def total_of(data: bytes, subject: str) -> int:
    """The total in a counter's acknowledgement or stored message (`{"val": "N"}`)."""
    try:
        doc = json.loads(data)
        if "error" in doc:
            raise CounterError(f"{subject}: {doc['error'].get('description', doc['error'])}")
        return int(doc["val"])
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CounterError(f"{subject}: not a counter's answer: {data[:100]!r}") from None


async def totals(
    nc: Client, stream: str, subject: str, *, batch: int = 1000, timeout_s: float = 5.0
) -> dict[str, int]:
    """Every subject's total in `stream` under the filter `subject`: the last message of each,
    through an ephemeral pull consumer (push consumers deliver nothing across llmgw's
    accounts)."""
    js = nc.jetstream(timeout=timeout_s)
    config = api.ConsumerConfig(
        deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
        ack_policy=api.AckPolicy.NONE,
        inactive_threshold=30.0,
        mem_storage=True,
    )
    try:
        if not (await js.stream_info(stream)).state.messages:
            return {}
        sub = await js.pull_subscribe(subject, stream=stream, config=config)
        try:
            return await _read_all(sub, batch, timeout_s)
        finally:
            await sub.unsubscribe()
    except (nats.errors.Error, TimeoutError) as exc:  # nats-py raises its own and asyncio's
        raise CounterError(f"cannot read {stream}: {exc or type(exc).__name__}") from None


async def _read_all(
    sub: JetStreamContext.PullSubscription, batch: int, timeout_s: float
) -> dict[str, int]:
    """Read until the consumer says nothing is left for it, so a slow server gives an error,
    never a partial total."""
    out: dict[str, int] = {}
    pending = (await sub.consumer_info()).num_pending
    while pending:
        msgs = await sub.fetch(min(batch, pending), timeout=timeout_s)
        if not msgs:  # fetch raises rather than answer nothing; never spin on an empty one
            raise TimeoutError
        for m in msgs:
            try:
                out[m.subject] = total_of(m.data, m.subject)
            except CounterError as exc:
                log.warning("counter_unreadable", error=str(exc))
        pending = msgs[-1].metadata.num_pending
    return out

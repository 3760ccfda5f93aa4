"""Publishing events to the log, with deduplication, per-message TTL and leader fencing.

Every producer (agent, control plane, `llmgw ctl`) publishes through a `Publisher`.
Each event's id travels as `Nats-Msg-Id`, so a retry after a lost acknowledgement
is stored once (inside the stream's duplicate window); the retry's result says
`duplicate=True`. Heartbeats pass `ttl_s` so that the log does not grow with them.

Fencing (docs/design.md, invariant 5): the control-plane leader passes
`Fence(subject_filter="llmgw.events.control.>", last_seq=N)` where N is the last
sequence it has folded on those subjects. If anything else was written there
since (a second leader that believes it still holds the lease), the server refuses
the write and `publish` raises `FenceRefused`: the caller must stop deciding and
re-read the log.

Every event is signed (llmgw.pki.signing): a `Publisher` gets a `Signer`, given or
bound to its connection (`bus.connect(..., keys=...)`), and adds the signature of
(subject, Nats-Msg-Id, payload) and the signer's certificate as headers, so that
readers trust the event because of who signed it, not because of where it is stored.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable

import msgspec
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext, api

from llmgw import logs
from llmgw.bus.keys import signer_of
from llmgw.core import events, retention, subjects
from llmgw.pki.signing import Signer

log = logs.get("llmgw.bus")

# A heartbeat published without a TTL of its own gets this one.
DEFAULT_HEARTBEAT_TTL_S = 120.0
# Server error code for a failed expected-last-sequence check (JSStreamWrongLastSequenceErr).
WRONG_LAST_SEQUENCE = 10071
EXPECTED_LAST_SUBJECT_SEQUENCE = "Nats-Expected-Last-Subject-Sequence"
# No nats-py constant: makes the expected-sequence check apply to a wildcard filter.
EXPECTED_LAST_SUBJECT_SEQUENCE_SUBJECT = "Nats-Expected-Last-Subject-Sequence-Subject"


class PublishError(RuntimeError):
    """The server did not store the event; the message says why and what to check."""


class FenceRefused(PublishError):
    """A fenced write was refused: something else was written to the fenced subjects first."""

    def __init__(self, fence: Fence, detail: str) -> None:
        super().__init__(
            f"write refused: {fence.subject_filter} has advanced past sequence {fence.last_seq} "
            f"({detail}); another leader wrote first. Stop deciding, re-read the log, and "
            "re-acquire the lease before publishing again."
        )
        self.fence = fence


class Fence(msgspec.Struct, frozen=True):
    """Publish only if the last message on `subject_filter` still has sequence `last_seq`."""

    subject_filter: str
    last_seq: int


class Published(msgspec.Struct, frozen=True):
    """The server's acknowledgement: where the event is, and whether it was a duplicate."""

    seq: int
    duplicate: bool
    stream: str


def stored_ttl_s(event: events.Event, ttl_s: float | None) -> int | None:
    """Whole seconds after which the log drops `event`, or None when it never does. Pure.

    Only heartbeats expire, and every one does (readers refuse anything else:
    llmgw.core.retention); raises ValueError for a TTL on anything else.
    """
    if isinstance(event, events.Heartbeat):
        if ttl_s is None:
            ttl_s = DEFAULT_HEARTBEAT_TTL_S
        ttl_s = min(ttl_s, retention.MAX_HEARTBEAT_TTL_S)
    elif ttl_s is not None:
        raise ValueError(
            f"ttl_s on a {type(event).__name__}: only heartbeats may expire from the log"
        )
    if ttl_s is None:
        return None
    if not ttl_s > 0:
        raise ValueError(f"ttl_s must be positive, got {ttl_s!r}")
    # The server's TTL granularity is one second; round up so nothing expires early.
    return max(1, math.ceil(ttl_s))


def _headers(
    signer: Signer,
    subject: str,
    event: events.Event,
    payload: bytes,
    ttl_s: float | None,
    fence: Fence | None,
) -> dict[str, str]:
    headers = {"Nats-Msg-Id": event.id}
    headers.update(signer.event_headers(subject, event.id, payload))
    ttl = stored_ttl_s(event, ttl_s)
    if ttl is not None:
        headers["Nats-TTL"] = f"{ttl}s"
    if fence is not None:
        headers[EXPECTED_LAST_SUBJECT_SEQUENCE] = str(fence.last_seq)
        headers[EXPECTED_LAST_SUBJECT_SEQUENCE_SUBJECT] = fence.subject_filter
    return headers


class Publisher:
    """Publishes llmgw events to the stream `llmgw-events` and waits for the server's ack."""

    def __init__(
        self,
        js: JetStreamContext,
        *,
        timeout_s: float = 2.0,
        attempts: int = 5,
        retry_wait_s: float = 0.2,
        signer: Signer | None = None,
    ) -> None:
        found = signer if signer is not None else signer_of(js)
        if found is None:
            raise ValueError(
                "a Publisher needs a Signer: connect with bus.connect(..., keys=Keys.load(...)) "
                "using this identity's certificate and key, or pass signer="
            )
        self.signer = found
        self._js = js
        self.timeout_s = timeout_s
        self.attempts = max(1, attempts)
        self.retry_wait_s = retry_wait_s

    async def publish(
        self,
        event: events.Event,
        *,
        ttl_s: float | None = None,
        fence: Fence | None = None,
        subject: str | None = None,
    ) -> Published:
        """Publish `event` on its subject; retry timeouts (safe: the id deduplicates).

        `subject` overrides `events.subject_of(event)` where the writer decides it: a control
        plane's own operator events go to its namespace (`subjects.control_operator_event`).
        Raises FenceRefused when `fence` no longer holds, PublishError otherwise.
        """
        if subject is None:
            subject = events.subject_of(event)
        payload = events.encode(event)
        headers = _headers(self.signer, subject, event, payload, ttl_s, fence)
        for attempt in range(1, self.attempts + 1):
            try:
                ack = await self._js.publish(
                    subject,
                    payload,
                    timeout=self.timeout_s,
                    stream=subjects.STREAM,
                    headers=dict(headers),
                )
            except (TimeoutError, nats.errors.TimeoutError, nats.js.errors.NoStreamResponseError):
                if attempt == self.attempts:
                    raise PublishError(
                        f"no acknowledgement for {type(event).__name__} {event.id} on {subject} "
                        f"after {self.attempts} attempts: check that the stream "
                        f"{subjects.STREAM} is provisioned and that this identity may publish "
                        "on that subject (a permission violation is logged as "
                        "bus.permission_violation)"
                    ) from None
                log.warning("publish_retry", subject=subject, id=event.id, attempt=attempt)
                await asyncio.sleep(self.retry_wait_s * attempt)
                continue
            except nats.js.errors.APIError as exc:
                if fence is not None and exc.err_code == WRONG_LAST_SEQUENCE:
                    # The server checks the fence before the duplicate window, so a retry
                    # of a write that did land (its ack was lost) is refused too: look
                    # whether the last message on the subject is this very event.
                    stored = await self._stored_last(subject, event.id)
                    if stored is not None:
                        log.info("publish_duplicate", subject=subject, id=event.id, seq=stored)
                        return Published(seq=stored, duplicate=True, stream=subjects.STREAM)
                    raise FenceRefused(fence, exc.description or str(exc)) from None
                raise PublishError(
                    f"the server refused {type(event).__name__} {event.id} on {subject}: "
                    f"{exc.description or exc} (code {exc.err_code})"
                ) from None
            result = Published(seq=ack.seq, duplicate=bool(ack.duplicate), stream=ack.stream)
            if result.duplicate:
                log.info("publish_duplicate", subject=subject, id=event.id, seq=result.seq)
            return result
        raise AssertionError("unreachable")

    async def _stored_last(self, subject: str, event_id: str) -> int | None:
        """Sequence of the last message on `subject` if it carries `event_id`, else None."""
        try:
            last = await self._js.get_last_msg(subjects.STREAM, subject, direct=True)
        except (nats.errors.Error, TimeoutError):
            return None
        if (last.headers or {}).get("Nats-Msg-Id") == event_id and last.seq is not None:
            return int(last.seq)
        return None

    async def publish_all(
        self, batch: Iterable[events.Event], *, ttl_s: float | None = None
    ) -> list[Published]:
        """Publish many events with pipelined (asynchronous) acknowledgements, in order.

        Much faster than awaiting each ack; an event whose ack times out is retried
        with `publish`. Unfenced: a leader publishes fenced decisions one by one.
        """
        items = list(batch)
        futures: list[asyncio.Future[api.PubAck]] = []
        for event in items:
            subject = events.subject_of(event)
            payload = events.encode(event)
            future = await self._js.publish_async(
                subject,
                payload,
                stream=subjects.STREAM,
                headers=_headers(self.signer, subject, event, payload, ttl_s, None),
            )
            futures.append(future)
        # Wait for the whole batch at once (a wait_for per future costs a task each),
        # as long as acks keep coming; what is left after timeout_s without any
        # progress is retried one by one below.
        waiting: set[asyncio.Future[api.PubAck]] = set(futures)
        while waiting:
            done, waiting = await asyncio.wait(waiting, timeout=self.timeout_s)
            if not done:
                break
        results: list[Published] = []
        for event, future in zip(items, futures, strict=True):
            if not future.done() or future.cancelled():
                future.cancel()
                results.append(await self.publish(event, ttl_s=ttl_s))
                continue
            exc = future.exception()
            if isinstance(exc, (TimeoutError, nats.errors.TimeoutError)):
                results.append(await self.publish(event, ttl_s=ttl_s))
                continue
            if isinstance(exc, nats.js.errors.APIError):
                raise PublishError(
                    f"the server refused {type(event).__name__} {event.id}: "
                    f"{exc.description or exc} (code {exc.err_code})"
                ) from None
            if exc is not None:
                raise exc
            ack = future.result()
            results.append(Published(seq=ack.seq, duplicate=bool(ack.duplicate), stream=ack.stream))
        return results

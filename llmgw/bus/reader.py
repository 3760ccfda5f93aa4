"""Reading the log: replay from a sequence number or a time, in batches, then follow live.

Every process that folds state reads through a `Reader`: the control plane (snapshot
+ tail, then live), routers (endpoint events), agents (their own commands) and
`llmgw ctl replay` (up to now, then stop). It yields `Record(seq, subject, time,
event)` in stream order, each event decoded with `llmgw.core.events.decode`.

A message that does not decode, or whose event is not on the subject its writer
owns (a node putting a control decision on its own subject: the server checks the
subject, the reader checks the content), is counted (`undecodable`), logged with its
sequence, kept in `skipped` (the most recent ones, for `ctl replay` to show) and
passed over; the reader never leaves its loop because of the log's content
(docs/design.md, invariant 7).

Before it decodes anything, the reader checks the message's signature with its
`Verifier` (given, or bound to the connection with `bus.connect(..., keys=...)`;
llmgw.pki.signing): valid, by a certificate of the fleet's CA whose identity owns
the subject. A message that fails (unsigned, tampered, signed by another identity,
or stored by anyone who is not its owner) is counted in `undecodable` and in
`refused`, logged as `bus.signature_refused` with its sequence, kept in `skipped`,
and never handed out. A reader without a verifier cannot be made.

How it reads, and why: an ephemeral pull consumer with no acknowledgements, asked
for large batches whose messages a `BusClient` hands straight to one synchronous
function. That measured 3-5 times faster than nats-py's push, ordered or
`fetch` consumers here (tests/bench/bench_log.py). It keeps the ordered-consumer
guarantee itself: it checks the consumer sequence of every message and, on a gap,
a deleted consumer, an empty message (the server ends its response there) or a silent
server (no heartbeat), recreates the consumer from the last sequence it delivered.
Asking for the next batch only when the previous one is consumed bounds memory to
about two batches. Each batch's bytes are bounded too (`max_bytes`, `PULL_MAX_BYTES`):
asked for 10,000 messages of up to 1 MiB each, the server pushed one node's flood (junk
below its own log subjects, or its largest load reports) onto the control plane's
connection faster than it read them, until it closed the connection as a slow consumer
(64 MiB pending), and with it the lease the control plane held on it; with the junk stored,
again at every reconnection. A message larger than the bound is still read: a request that
brings nothing for it asks for twice as much next.

What each message goes through on arrival (its place in the consumer's order, its
trust, its subject, its TTL, decoding) is the reader's intake, llmgw.bus.intake.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import secrets
from collections.abc import AsyncIterator, Sequence
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.subscription import Subscription

from llmgw import logs
from llmgw.bus.connection import BusClient
from llmgw.bus.intake import Intake
from llmgw.bus.intake import Record as Record
from llmgw.bus.intake import Skipped as Skipped
from llmgw.bus.intake import SkipSink as SkipSink
from llmgw.bus.keys import verifier_of
from llmgw.core import attestation, subjects
from llmgw.pki.signing import Verifier

log = logs.get("llmgw.bus")

_API = "$JS.API"
_NS = 1_000_000_000


PULL_MAX_BYTES = 16 * 1024 * 1024
"""What one pull request may bring: a batch of 10,000 ordinary events, a few dozen of the
largest; with the load reports' reader (llmgw.bus.signals) well under the 64 MiB the
server lets a connection fall behind before it closes it. 0: no bound."""


def filter_problem(filters: Sequence[str]) -> str | None:
    """Why the server would refuse a consumer on `filters`, or None. Pure."""
    if isinstance(filters, str):
        return f"subjects_filter must be a list of subjects, not the string {filters!r}"
    if not filters:
        return "subjects_filter is empty: give at least one subject (or leave it out for all)"
    for f in filters:
        if not f or any(c.isspace() for c in f) or "" in f.split("."):
            return (
                f"subjects_filter has {f!r}, which is not a subject: give dot-separated "
                "tokens without spaces (wildcards * and > allowed)"
            )
    return None


class ReaderError(RuntimeError):
    """The reader cannot start: the message says what to check."""


def _start_time(since: float | datetime.datetime) -> str:
    if isinstance(since, datetime.datetime):
        when = since if since.tzinfo else since.replace(tzinfo=datetime.UTC)
    else:
        when = datetime.datetime.fromtimestamp(since, datetime.UTC)
    return when.astimezone(datetime.UTC).isoformat().replace("+00:00", "Z")


class Reader(Intake):
    """Replays the stream `llmgw-events` from a point, then follows it (unless `follow=False`).

    Start points: `after_seq=N` yields the events with sequence > N (a snapshot that
    includes N is completed by exactly these); `since=t` (UNIX seconds or an aware
    datetime) yields those stored at or after t. Use as an async context manager,
    then iterate `batches()` (lists of records) or the reader itself (one record).
    """

    def __init__(
        self,
        nc: Client,
        *,
        after_seq: int = 0,
        since: float | datetime.datetime | None = None,
        subjects_filter: Sequence[str] = subjects.STREAM_SUBJECTS,
        follow: bool = True,
        batch: int = 10_000,
        max_bytes: int = PULL_MAX_BYTES,
        heartbeat_s: float = 2.0,
        expires_s: float = 30.0,
        name: str = "reader",
        consumer_name: str | None = None,
        max_skipped_kept: int = 1000,
        verifier: Verifier | None = None,
        attestations: attestation.Attestations | None = None,
        attester: attestation.Sink | None = None,
        stream: str = subjects.STREAM,
        on_skip: SkipSink | None = None,
    ) -> None:
        found = verifier if verifier is not None else verifier_of(nc)
        if found is None:
            raise ReaderError(
                "a Reader needs a Verifier to check signatures: connect with "
                "bus.connect(..., keys=Keys.load(ca_file=...)) or pass verifier="
            )
        if after_seq < 0:
            raise ValueError(f"after_seq must be >= 0, got {after_seq}")
        if since is not None and after_seq:
            raise ValueError("give after_seq or since, not both")
        if (problem := filter_problem(subjects_filter)) is not None:
            raise ValueError(problem)
        super().__init__(
            found,
            after_seq=after_seq,
            max_skipped_kept=max_skipped_kept,
            attestations=attestations,
            attester=attester,
            on_skip=on_skip,
        )
        self._nc = nc
        self._stream = stream
        self._since = since
        self._filters = list(subjects_filter)
        self.follow = follow
        self._batch = max(1, batch)
        self._max_bytes = max(0, max_bytes)
        self._heartbeat_s = heartbeat_s
        # Without following, a pull request that waits long for messages that will
        # not come only delays the end.
        self._expires_s = expires_s if follow else max(2 * heartbeat_s, 1.0)
        self._name_prefix = name
        # A fixed name, for identities allowed exactly one consumer (a node's `cmd-<node>`).
        self._fixed_name = consumer_name
        self.resets = 0
        self._consumer = ""
        self._sub: Subscription | None = None
        self._started = False
        self._closed = False

    # ----------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> Reader:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Create the consumer; raises ReaderError when the stream cannot be read."""
        if self._started:
            return
        self._started = True
        await self._open()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wakeup.set()
        await self._drop_consumer()

    # ----------------------------------------------------------------- consumer

    def _consumer_config(self, name: str) -> dict[str, Any]:
        config: dict[str, Any] = {
            "name": name,
            "ack_policy": "none",
            "replay_policy": "instant",
            "mem_storage": True,
            "num_replicas": 1,
            # A reader that died leaves nothing behind for long.
            "inactive_threshold": int(max(30.0, 4 * self._expires_s) * _NS),
        }
        # Until a first message arrives, a start time still applies (also after a reset).
        if self._since is not None and self.last_seq == 0:
            config["deliver_policy"] = "by_start_time"
            config["opt_start_time"] = _start_time(self._since)
        elif self.last_seq > 0:
            config["deliver_policy"] = "by_start_sequence"
            config["opt_start_seq"] = self.last_seq + 1
        else:
            config["deliver_policy"] = "all"
        single = self._single_filter()
        if single is not None:
            config["filter_subject"] = single
        elif self._stream != subjects.STREAM or sorted(self._filters) != sorted(
            subjects.STREAM_SUBJECTS
        ):
            config["filter_subjects"] = self._filters
        return config

    def _single_filter(self) -> str | None:
        if len(self._filters) == 1 and self._filters[0] != ">":
            return self._filters[0]
        return None

    def _create_subject(self, name: str) -> str:
        # With one filter, name it in the API subject too: that is what lets the
        # authorization allow a node to create consumers on its own commands only.
        single = self._single_filter()
        if single is not None:
            return f"{_API}.CONSUMER.CREATE.{self._stream}.{name}.{single}"
        return f"{_API}.CONSUMER.CREATE.{self._stream}.{name}"

    async def _api(self, subject: str, payload: bytes) -> dict[str, Any]:
        msg = await self._nc.request(subject, payload, timeout=5.0)
        data: dict[str, Any] = json.loads(msg.data)
        return data

    async def _open(self) -> None:
        """(Re)create the consumer and its inbox, starting after `last_seq`."""
        name = self._fixed_name or f"{self._name_prefix}-{secrets.token_hex(6)}"
        if self._fixed_name is not None:
            await self._delete_fixed(name)
        config = self._consumer_config(name)
        request = json.dumps(
            {"stream_name": self._stream, "config": config, "action": "create"}
        ).encode()
        try:
            resp = await self._api(self._create_subject(name), request)
        except (TimeoutError, nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
            raise ReaderError(
                f"no answer creating a consumer on {self._stream}: check that the stream is "
                "provisioned and that this identity may create consumers on it "
                f"(a permission violation is logged as bus.permission_violation): {exc!r}"
            ) from None
        if "error" in resp:
            err = resp["error"]
            raise ReaderError(
                f"cannot read {self._stream}: {err.get('description')} "
                f"(code {err.get('err_code')}); provision the stream with `llmgw control` "
                "or check the reader's subject filter"
            )
        inbox = self._nc.new_inbox()
        if isinstance(self._nc, BusClient):
            self._sub = await self._nc.fast_subscribe(inbox, self._on_raw)
        else:
            self._sub = await self._nc.subscribe(inbox, cb=self._on_msg)
        self._consumer = name
        self._expect_cseq = 1
        self._outstanding = 0
        self._request_open = False
        self._reset_needed = False
        if int(resp.get("num_pending", 0)) == 0:
            self.caught_up.set()

    async def _delete_fixed(self, name: str) -> None:
        """Remove a previous consumer of this fixed name: a create with another start
        point would be refused while it exists."""
        try:
            resp = await self._api(f"{_API}.CONSUMER.DELETE.{self._stream}.{name}", b"")
        except (TimeoutError, nats.errors.Error):
            return  # the create below reports what is wrong
        err = resp.get("error") or {}
        if err and err.get("code") != 404:
            log.warning("reader_delete_failed", consumer=name, detail=err.get("description"))

    async def _drop_consumer(self) -> None:
        sub, name = self._sub, self._consumer
        self._sub, self._consumer = None, ""
        if sub is not None:
            if isinstance(self._nc, BusClient):
                await self._nc.fast_unsubscribe(sub)
            else:
                with contextlib.suppress(
                    nats.errors.ConnectionClosedError, nats.errors.BadSubscriptionError
                ):
                    await sub.unsubscribe()
        if name and not self._nc.is_closed:
            # Best effort: the server removes it after inactive_threshold anyway.
            with contextlib.suppress(nats.errors.Error):
                await self._nc.publish(f"{_API}.CONSUMER.DELETE.{self._stream}.{name}", b"")

    async def _reset(self) -> None:
        """Start a new consumer after `last_seq`; retries until the server answers.

        After an empty message (`Intake._on_raw`) nothing was missed: that new consumer
        is routine, counted in `resets` only if it cannot be had at once. Any node may
        write empty messages on its own subjects, and readers take a reset to mean their
        view of the log was interrupted (the control plane then judges heartbeat silence
        only from then on)."""
        routine, self._routine_reset = self._routine_reset, False
        if not routine:
            self._count_reset()
        await self._drop_consumer()
        wait = 0.2
        while not self._closed:
            if self._nc.is_closed:
                raise ReaderError("the connection is closed: open a new one and a new Reader")
            try:
                await self._open()
                return
            except (ReaderError, nats.errors.Error) as exc:
                if routine:
                    routine = False
                    self._count_reset()
                log.warning("reader_reopen_failed", error=str(exc), retry_in_s=wait)
                await asyncio.sleep(wait)
                wait = min(wait * 2, 5.0)

    def _count_reset(self) -> None:
        self.resets += 1
        log.warning("reader_reset", consumer=self._consumer, after_seq=self.last_seq)

    async def _request(self) -> None:
        assert self._sub is not None
        body = json.dumps(
            {
                "batch": self._batch,
                **({"max_bytes": self._max_bytes} if self._max_bytes else {}),
                "expires": int(self._expires_s * _NS),
                "idle_heartbeat": int(self._heartbeat_s * _NS),
            }
        ).encode()
        self._outstanding = self._requested = self._batch
        self._request_open = True
        self._ended_quietly = False
        await self._nc.publish(
            f"{_API}.CONSUMER.MSG.NEXT.{self._stream}.{self._consumer}",
            body,
            reply=self._sub.subject,
        )

    # ----------------------------------------------------------------- iteration

    async def _pending_now(self) -> int | None:
        try:
            resp = await self._api(f"{_API}.CONSUMER.INFO.{self._stream}.{self._consumer}", b"")
        except (TimeoutError, nats.errors.Error):
            return None
        if "error" in resp:
            self._reset_needed = True
            return None
        return int(resp.get("num_pending", 0))

    async def batches(self) -> AsyncIterator[list[Record]]:
        """Yield lists of records in stream order; ends only when `follow=False` and caught up."""
        await self.start()
        quiet_ticks = 0
        while not self._closed:
            if self._reset_needed:
                await self._reset()
                continue
            if self._buf:
                out, self._buf = self._buf, []
                quiet_ticks = 0
                yield out
                continue
            if not self.follow and self.caught_up.is_set():
                return
            if not self._request_open:
                # Expired messages can leave the last pending count above zero.
                quiet_end = self._ended_quietly and not self.caught_up.is_set()
                if quiet_end and await self._pending_now() == 0:
                    self.caught_up.set()
                    continue
                await self._request()
            self._wakeup.clear()
            if self._buf or self._reset_needed:
                continue  # arrived while the request was being sent
            seen = self._activity
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), timeout=self._heartbeat_s)
            if self._activity == seen and self._request_open:
                quiet_ticks += 1
                if quiet_ticks >= 3:
                    # Neither messages nor heartbeats: the request or the consumer is
                    # gone (server restart, reconnect); start a new one.
                    quiet_ticks = 0
                    self._reset_needed = True
            else:
                quiet_ticks = 0

    async def __aiter__(self) -> AsyncIterator[Record]:
        async for batch in self.batches():
            for record in batch:
                yield record

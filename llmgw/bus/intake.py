"""The Reader's intake: every message of the log, placed in order, checked, decoded.

`Intake` is the part of `Reader` (llmgw.bus.reader) that each message passes through,
inline, from the connection's read loop (`BusClient.fast_subscribe`, llmgw.bus.natspy).
`_on_raw` places the message in the consumer's sequence (a gap asks the reader for a
new consumer), reads the pull request's status messages and checks the message's trust
(a leader's attestation, or its signature and headers: `_check_headers`); `_accept`
decodes it, checks its subject and its TTL (none on one an attestation confirmed: its
leader checked it) and keeps it for the next batch, or skips it with the reason. Nothing in
the log makes it raise. `Record` is what a reader yields, `Skipped` what it passed over.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

import msgspec
from nats.aio.msg import Msg

from llmgw import logs
from llmgw.bus import acks
from llmgw.bus.headers import header_block, message_headers
from llmgw.core import attestation, events, retention
from llmgw.pki.signing import Verifier

log = logs.get("llmgw.bus")

_NS = 1_000_000_000
_KEPT_SUBJECT_MAX = 300
"""Longest subject whose reading a reader keeps (`_learn_subject`): llmgw's own are shorter
(two tokens of at most 128 characters after the root). Longer ones, which a node may write
below its own subjects up to the server's limit (about 4 KiB), are read again each time
rather than kept: what a reader keeps does not grow with the size of what a node writes."""
_KEPT_TTL_MAX = 32
"""Longest `Nats-TTL` value whose verdict a reader keeps (`_ttl_problem`); llmgw's own are
a few characters, a writer's may fill the server's 64 KiB of headers."""
SKIP_LINES = 100
SKIP_LINES_EVERY_S = 10.0
"""A reader logs at most `SKIP_LINES` of the messages it passes over every this many
seconds, then how many more it passed over (`skipped_unlogged`, at the next one after
the period): a line costs ten times the reading of an unsigned message, and any node may
write as many of those on its own subjects as the server takes. `undecodable`, `skipped`
and the sink still hear of each."""
_clock = time.monotonic


class Record(msgspec.Struct, frozen=True, gc=False):
    """One event of the log with where and when the server stored it."""

    seq: int
    subject: str
    time: float
    """Server's store time, UNIX seconds (UTC)."""
    event: events.AnyEvent
    size: int = 0
    """Bytes of the message's subject, headers and payload: what it costs the log (quotas)."""


class Skipped(msgspec.Struct, frozen=True):
    """A message that is not a valid llmgw event: passed over, reported."""

    seq: int
    subject: str
    time: float
    error: str
    size: int = 0
    """Bytes of the message's subject, headers and payload: what it cost the log, read or
    not (a node's share of the log counts it: llmgw.control.quota)."""


SkipSink = Callable[[Skipped], None]
"""Told of every message a reader passes over, in order, as it passes it over."""


class Intake:
    """What a Reader knows of the messages handed to it, and the functions that take them."""

    def __init__(
        self,
        verifier: Verifier,
        *,
        after_seq: int,
        max_skipped_kept: int,
        attestations: attestation.Attestations | None,
        attester: attestation.Sink | None,
        on_skip: SkipSink | None = None,
    ) -> None:
        self.verifier = verifier
        # `skipped` keeps only the latest; a sink hears of each, however many in a row.
        self._on_skip = on_skip
        # Messages a leader's attestation covers are checked by digest, not signature
        # (llmgw.core.attestation); an attester (the control plane's) is told what passed.
        self._attested = attestations if attestations is not None and len(attestations) else None
        self._attester = attester
        self.confirmed = 0
        """Messages accepted on an attestation's word rather than a signature check."""
        self.ttl_refused: deque[int] = deque(maxlen=10_000)
        """Sequences refused for their TTL (llmgw.core.retention), for the control plane
        to delete."""
        self.last_seq = after_seq
        """Sequence of the last message handed out or skipped."""
        self.last_time = 0.0
        """When the server stored that message (UNIX seconds); 0 before any."""
        self.more_pending = False
        """More of the consumer's messages were stored after that one, not yet read: with
        `last_time`, how far behind the log the reader is."""
        self.undecodable = 0
        self.refused = 0
        """Messages refused for their signature (also counted in `undecodable`)."""
        self.skipped: deque[Skipped] = deque(maxlen=max_skipped_kept)
        self.caught_up = asyncio.Event()
        """Set once everything stored when reading began has been handed out."""
        self._buf: list[Record] = []
        # Subjects repeat (one per node and kind): decode each once.
        self._subjects: dict[bytes, tuple[str, bool, bytes, str | None]] = {}
        self._ttl_verdicts: dict[tuple[str, bytes | None], str | None] = {}
        self._wakeup = asyncio.Event()
        # Where the consumer's delivery stands; the reader resets these with a new one.
        self._expect_cseq = 1
        self._outstanding = 0
        self._requested = 0
        self._max_bytes = 0
        """Bytes one pull request may bring (0: any); see llmgw.bus.reader."""
        self._request_open = False
        self._reset_needed = False
        self._routine_reset = False
        """The reset needed follows an empty message only (see `Reader._reset`)."""
        self._skip_lines = 0
        self._skip_period = -SKIP_LINES_EVERY_S
        self._unlogged: tuple[int, int, str] = (0, 0, "")
        """Skipped and not logged this period: how many, the last one's seq and subject."""
        self._activity = 0
        self._ended_quietly = False

    # long: the hot path of a replay, one call per event, written flat on purpose
    def _on_raw(self, subject: bytes, reply: bytes, data: bytes, headers: bytes) -> None:
        """Called inline for every message on the inbox. Never raises on content.

        The hot path of a replay, one call per event: it places the message in the
        consumer's order (its ack subject), checks its trust (a leader's attestation, or
        its signature), and hands what passes to `_accept`. One function, without calls
        of the reader's own in between: each measured (tests/bench/bench_replay.py).
        """
        self._activity += 1
        if not self._wakeup.is_set():
            self._wakeup.set()
        if not reply.startswith(acks.PREFIX):
            if headers.startswith(b"NATS/1.0 "):
                self._on_status(headers[9:12], headers)
            return
        if self._reset_needed:
            return
        ack = acks.parse(reply)
        if ack is None:
            # Not the server's ack subject format: nothing we can place in the order.
            log.warning("reader_bad_reply_subject", reply=reply.decode(errors="replace"))
            return
        seq, cseq, ts, caught_up = ack
        if cseq != self._expect_cseq:
            # A message was lost (e.g. delivered while we were disconnected): start over
            # from the last one we have, so that the fold never misses an event.
            self._reset_needed = True
            return
        self._expect_cseq = cseq + 1
        self._outstanding -= 1
        if self._outstanding <= 0:
            self._request_open = False
        self.last_seq = seq
        self.last_time = when = ts / _NS
        self.more_pending = not caught_up
        known = self._subjects.get(subject)
        if known is None:
            known = self._learn_subject(subject)
        name, heartbeat, prefix, foreign = known
        size = len(subject) + len(data) + len(headers)  # what the server stores of it
        if foreign is not None:
            self._skip(seq, name, when, foreign, size=size)
        else:
            # Heartbeats are never attested (llmgw.control.attesting): no digest for them.
            digest = b""
            attested = self._attested
            if not heartbeat and (attested is not None or self._attester is not None):
                digest = attestation.digest_after(prefix, data)
            verdict: str | None = attestation.NOT_COVERED
            if attested is not None and seq <= attested.last_seq:
                verdict = attested.check(seq, digest)
            if verdict is None:
                # Confirmed by its subject and payload: the header block, whose signature,
                # certificate and TTL the attestation's signer checked, is not read at all.
                self.confirmed += 1
                if self._attester is not None and not heartbeat:
                    self._attester.accepted(seq, digest)
                self._accept(seq, name, data, size, None, when)
            else:
                self._check_headers(seq, subject, known, data, headers, size, digest, verdict, when)
        if not data and not headers:
            # The server ends a response it streams to another account (a pull request's, for
            # every llmgw identity: llmgw.pki.authorization) at a message with neither payload
            # nor headers, which anyone who may write to a subject can store: nothing more of
            # this request arrives, not even its heartbeats. Start over after it now, rather
            # than after the silence of three heartbeats: routine, nothing was missed.
            self._reset_needed = True
            self._routine_reset = True
        if caught_up:
            self.caught_up.set()

    def _check_headers(
        self,
        seq: int,
        subject: bytes,
        known: tuple[str, bool, bytes, str | None],
        data: bytes,
        headers: bytes,
        size: int,
        digest: bytes,
        verdict: str | None,
        when: float,
    ) -> None:
        """`_on_raw` for a message it could not accept on an attestation's word alone: one
        no attestation covers (its signature is checked), one an attestation of scheme 1
        covers (which digested the id and signature), or one an attestation refused. An
        attester is told a message with a TTL the log refuses (llmgw.core.retention) as
        refused, so that a message an attestation confirms needs no TTL check (`_on_raw`
        reads nothing of its headers); one an attestation refused with such a TTL is
        refused for its TTL, as the leader that refused it did, for the control plane to
        delete (`ttl_refused`)."""
        name, heartbeat = known[0], known[1]
        if (found := message_headers(headers)) is None:
            self._refuse(seq, name, when, "signature headers appear twice", size)
            return
        msg_id, sig, cert, ttl = found
        if verdict == attestation.OTHER_SCHEME and self._attested is not None:
            older = attestation.digest_v1(subject, msg_id or b"", data, sig or b"")
            verdict = self._attested.check(seq, older, scheme=1)
        by_attestation = verdict is not None and verdict != attestation.NOT_COVERED
        if verdict is None:
            self.confirmed += 1
        elif verdict == attestation.NOT_COVERED:
            verdict = self._signature_refusal(seq, name, data, msg_id, sig, cert, when)
        if verdict is not None:
            problem = self._ttl_problem(name, ttl) if by_attestation and ttl is not None else None
            if problem is None:
                self._refuse(seq, name, when, verdict, size)
                return
            if self._attester is not None:
                self._attester.refused(seq)
            self.ttl_refused.append(seq)
            self._skip(seq, name, when, f"refused: {problem}", "bus.ttl_refused", size=size)
            return
        if self._attester is not None and not heartbeat:
            if ttl is not None and self._ttl_problem(name, ttl) is not None:
                self._attester.refused(seq)
            else:
                self._attester.accepted(seq, digest)
        self._accept(seq, name, data, size, ttl, when)

    def _accept(
        self, seq: int, name: str, data: bytes, size: int, ttl: bytes | None, when: float
    ) -> None:
        """A trusted message: decode its event and keep its record, or skip it with why.

        The log's decoding; the readers of the other streams (load reports, KV updates)
        override it with their own, behind the same order and signature checks."""
        try:
            event = events.decode(data)
        except Exception as exc:  # DecodeError; anything else is a decoder bug, same treatment
            self._skip(seq, name, when, str(exc) or type(exc).__name__, size=size)
            return
        if not events.published_where_owned(event, name):
            self._skip(
                seq,
                name,
                when,
                f"{events.tag_of(type(event))} event refused: it does not belong on {name} "
                "(only its owner's subject is trusted; see events.published_where_owned)",
                size=size,
            )
            return
        # Only a TTL, or a heartbeat without one, can be refused (llmgw.core.retention).
        if (ttl is not None or name.endswith(".heartbeat")) and (
            problem := self._ttl_problem(name, ttl)
        ) is not None:
            self.ttl_refused.append(seq)
            self._skip(seq, name, when, f"refused: {problem}", "bus.ttl_refused", size=size)
            return
        self._buf.append(Record(seq, name, when, event, size))

    def _learn_subject(self, subject: bytes) -> tuple[str, bool, bytes, str | None]:
        """A subject's name, whether it is a heartbeat's, the start of its messages'
        attested digests and `_foreign`'s verdict; kept, as subjects repeat (one per node
        and kind)."""
        name = subject.decode(errors="replace")
        heartbeat = name.endswith(".heartbeat")
        known = (name, heartbeat, attestation.subject_prefix(subject), self._foreign(name))
        if len(self._subjects) < 100_000 and len(subject) <= _KEPT_SUBJECT_MAX:
            self._subjects[subject] = known
        return known

    def _foreign(self, name: str) -> str | None:
        """Why no message on `name` is accepted, whoever signed it, or None: such messages
        are skipped before their signature is checked. The log's reader leaves subjects to
        `_accept`; the load reports' reader refuses any but the reports' own there."""
        return None

    def _refuse(self, seq: int, name: str, when: float, why: str, size: int) -> None:
        self.refused += 1
        if self._attester is not None:  # before the sink, which may have it dropped
            self._attester.refused(seq)
        self._skip(
            seq,
            name,
            when,
            f"signature refused: {why}",
            "bus.signature_refused",
            size=size,
        )

    def _signature_refusal(
        self,
        seq: int,
        name: str,
        data: bytes,
        msg_id: bytes | None,
        sig: bytes | None,
        cert: bytes | None,
        when: float,
    ) -> str | None:
        """Why the message at `seq` is not trusted by its signature, or None."""
        try:
            return self.verifier.event_refusal(name, msg_id, data, sig, cert, seq=seq, when=when)
        except Exception as exc:  # a verifier bug: refused, never a lost message
            return f"the signature could not be checked: {exc!r}"

    def _ttl_problem(self, name: str, ttl: bytes | None) -> str | None:
        """llmgw.core.retention's verdict on a TTL header, remembered per subject and value:
        both repeat (one heartbeat subject per node, one TTL per fleet), and the verdict is
        on every message of a replay."""
        key = (name, ttl)
        try:
            return self._ttl_verdicts[key]
        except KeyError:
            pass
        verdict = retention.ttl_problem(
            name, None if ttl is None else ttl.decode("utf-8", "replace")
        )
        if (
            len(self._ttl_verdicts) < 100_000
            and len(name) <= _KEPT_SUBJECT_MAX
            and (ttl is None or len(ttl) <= _KEPT_TTL_MAX)
        ):
            self._ttl_verdicts[key] = verdict
        return verdict

    def _skip(
        self,
        seq: int,
        name: str,
        when: float,
        error: str,
        what: str = "bus.undecodable",
        *,
        size: int = 0,
    ) -> None:
        self.undecodable += 1
        item = Skipped(seq=seq, subject=name, time=when, error=error, size=size)
        self.skipped.append(item)
        self._log_skip(what, seq, name, error)
        if self._on_skip is not None:
            try:
                self._on_skip(item)
            except Exception as exc:  # the sink's bug: logged, never the read loop's end
                log.error("reader_skip_sink_failed", seq=seq, error=repr(exc))

    def _log_skip(self, what: str, seq: int, name: str, error: str) -> None:
        """One line per message passed over, up to `SKIP_LINES` a period (see there)."""
        now = _clock()
        if now - self._skip_period >= SKIP_LINES_EVERY_S:
            count, last_seq, last_subject = self._unlogged
            if count:
                log.warning(
                    "skipped_unlogged",
                    count=count,
                    last_seq=last_seq,
                    last_subject=last_subject,
                    period_s=SKIP_LINES_EVERY_S,
                )
            self._skip_period, self._skip_lines, self._unlogged = now, 0, (0, 0, "")
        if self._skip_lines < SKIP_LINES:
            self._skip_lines += 1
            log.warning(what, seq=seq, subject=name, error=error)
        else:
            self._unlogged = (self._unlogged[0] + 1, seq, name)

    def _on_status(self, code: bytes, headers: bytes) -> None:
        if code == b"100":
            return  # idle heartbeat: the request is alive
        # 404 no messages, 408 request expired, 409 consumer deleted / leadership change
        # / limits: this pull request is over.
        self._request_open = False
        if code in (b"404", b"408"):
            self._ended_quietly = True
        elif code == b"409":
            text = headers[13:].split(b"\r\n", 1)[0].decode(errors="replace")
            if "Exceeds MaxBytes" in text:
                # The request's bytes are spent: the next asks again. One that brought
                # nothing met a message larger than them (a stream whose messages may be
                # larger than its readers expect): ask for more, or it stays stuck there.
                if self._max_bytes and self._outstanding >= self._requested:
                    self._max_bytes *= 2
                    log.warning("reader_max_bytes_raised", max_bytes=self._max_bytes)
            elif (
                "Consumer Deleted" in text
                or "Consumer is push based" in text
                or "Leadership Change" in text
                or "Server Shutdown" in text
            ):
                self._reset_needed, self._routine_reset = True, False
            else:
                log.warning("reader_pull_status", status=409, detail=text)
        else:
            text = headers[9:].split(b"\r\n", 1)[0].decode(errors="replace")
            log.warning("reader_pull_status", detail=text)
            self._reset_needed, self._routine_reset = True, False

    async def _on_msg(self, msg: Msg) -> None:
        """Slow path for a plain nats-py client: rebuild what `_on_raw` needs."""
        status = (msg.headers or {}).get("Status")
        if status and not msg.reply:
            desc = (msg.headers or {}).get("Description", "")
            raw = f"NATS/1.0 {status} {desc}\r\n\r\n".encode()
            self._on_raw(msg.subject.encode(), b"", b"", raw)
        else:
            raw = header_block(msg.headers)
            self._on_raw(msg.subject.encode(), (msg.reply or "").encode(), msg.data, raw)

"""The control-plane leader lease: one key in the KV bucket `llmgw-lease`, with a TTL.

Several control-plane instances may run; the one holding the lease decides
(docs/design.md, invariant 5). The lease is the key `leader` written with a
per-message TTL: `acquire` creates it only if it does not exist (an expired
lease does not); `renew` rewrites it with a fresh TTL only if nobody wrote it
since (expected-last-subject-sequence), so a holder that paused past its TTL
learns it lost the lease instead of overwriting its successor. `release`
deletes it for a quick hand-over.

The epoch is the stream sequence of the acquiring write: it increases with every
new holder, and the holder stamps it on its decisions (`ControlEvent.epoch`).
A lease alone cannot stop a paused ex-leader's in-flight write; the fenced
publish (`Publisher.publish(..., fence=...)`) does.

The value is signed by the control identity it names (llmgw.pki.signing): a
contender reads a value that does not verify (unsigned, another identity's, garbled)
as no holder at all, and takes such a lease over with a write that expects exactly
that revision, so a forged value can neither make a leader nor keep one from leading.
The signed value also says until when it holds (`until`, the writer's clock plus the
TTL): a genuine value stored again later (by anyone able to write the bucket) counts
as free once that time and one more TTL (for clock skew) have passed. Written by one
host and judged by another, `until` is read on the clock a contender is given: a control
plane's is the server's time (llmgw.bus.servertime), whatever its host's says, so
that a standby does not take over from a leader whose host's clock is behind.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from llmgw import logs
from llmgw.bus import servertime
from llmgw.bus.keys import client_of, signer_of, verifier_of
from llmgw.bus.provisioning import LEASE_BUCKET
from llmgw.bus.publisher import EXPECTED_LAST_SUBJECT_SEQUENCE, WRONG_LAST_SEQUENCE
from llmgw.pki.identity import Identity
from llmgw.pki.signing import SignatureRefused, Signer, Verifier, lease_message

log = logs.get("llmgw.bus")

KEY = "leader"


class LeaseLost(RuntimeError):
    """This instance no longer holds the lease: stop deciding at once."""


class Holder(msgspec.Struct, frozen=True):
    """Who holds the lease, since which epoch, and the revision of its last renewal."""

    holder: str
    epoch: int
    revision: int


class _Value(msgspec.Struct, frozen=True):
    holder: str
    epoch: int = 0
    """0 in the acquiring write itself: its epoch is its own revision."""
    until: float = 0.0
    """UNIX time (the writer's clock) until which this write holds the lease."""
    sig: str = ""
    """Signature of (holder, epoch, until) by the certificate `cert` (base64 DER)."""
    cert: str = ""


def signed_value(signer: Signer, holder: str, epoch: int, until: float) -> bytes:
    """The stored lease value for `holder` at `epoch`, held until `until`, signed."""
    sig = signer.sign(lease_message(holder, epoch, until))
    return msgspec.json.encode(_Value(holder, epoch, until, sig, signer.cert_b64))


def verified_value(verifier: Verifier, raw: bytes, now: float, grace_s: float) -> _Value | str:
    """The lease value if its holder signed it and it has not run out (`until` plus
    `grace_s` for clock skew), else why not. Pure given `now`."""
    try:
        value = msgspec.json.decode(raw, type=_Value)
    except msgspec.DecodeError:
        return "garbled"
    if not value.sig or not value.cert:
        return "unsigned"
    try:
        message = lease_message(value.holder, value.epoch, value.until)
        signer = verifier.verify(message, value.sig, value.cert, now)
    except SignatureRefused as exc:
        return str(exc)
    if signer.kind != "control" or signer.name != value.holder:
        return f"signed by {signer}, not by control/{value.holder}"
    if now > value.until + grace_s:
        return f"ran out at {value.until:.0f} (a stale value stored again)"
    return value


def _ttl_header(ttl_s: float) -> str:
    return f"{max(1, round(ttl_s))}s"


class Lease:
    """One contender for the leader lease, named `name` (its instance name)."""

    def __init__(
        self,
        js: JetStreamContext,
        kv: KeyValue,
        name: str,
        *,
        ttl_s: float,
        signer: Signer | None = None,
        verifier: Verifier | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`clock` (UNIX seconds) writes and judges the value's `until`."""
        signer = signer if signer is not None else signer_of(js)
        verifier = verifier if verifier is not None else verifier_of(js)
        if signer is None or verifier is None:
            raise ValueError(
                "a Lease needs this control plane's Signer and the CA's Verifier: connect "
                "with bus.connect(..., keys=...) or pass signer= and verifier="
            )
        if signer.identity != Identity("control", name):
            raise ValueError(
                f"lease contender {name} must sign as control/{name}, not {signer.identity}"
            )
        self._signer = signer
        self._verifier = verifier
        if ttl_s < 1:
            raise ValueError(f"lease ttl_s must be at least 1 second (server granularity): {ttl_s}")
        self._js = js
        self._kv = kv
        self._clock = clock
        self.name = name
        self.ttl_s = float(round(ttl_s))
        self.epoch = 0
        self._revision = 0
        self._valid_until = 0.0
        self._renewals = 0

    @classmethod
    async def open(
        cls,
        js: JetStreamContext,
        name: str,
        *,
        ttl_s: float = 10.0,
        signer: Signer | None = None,
        verifier: Verifier | None = None,
        clock: Callable[[], float] = time.time,
    ) -> Lease:
        try:
            kv = await js.key_value(LEASE_BUCKET)
        except nats.js.errors.BucketNotFoundError:
            raise RuntimeError(
                f"KV bucket {LEASE_BUCKET} does not exist: call llmgw.bus.provision first "
                "(the control plane does at start-up)"
            ) from None
        return cls(js, kv, name, ttl_s=ttl_s, signer=signer, verifier=verifier, clock=clock)

    @property
    def renew_every_s(self) -> float:
        """Renew this often: three chances before the TTL runs out."""
        return self.ttl_s / 3

    @property
    def held(self) -> bool:
        """True while the last acquire/renew is younger than the TTL (by the local clock)."""
        return self._revision > 0 and time.monotonic() < self._valid_until

    async def _entry(self) -> tuple[int, _Value | str] | None:
        """The stored lease's revision and value (or why it is not trusted); None if free."""
        try:
            entry = await self._kv.get(KEY)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        if entry.value is None or entry.revision is None:
            return None
        return entry.revision, verified_value(
            self._verifier, entry.value, self._clock(), self.ttl_s
        )

    async def holder(self) -> Holder | None:
        """The current holder, or None when the lease is free (or its value is forged)."""
        found = await self._entry()
        if found is None:
            return None
        revision, value = found
        if isinstance(value, str):
            log.warning("lease_refused", revision=revision, why=value)
            return None
        return Holder(value.holder, value.epoch or revision, revision)

    async def acquire(self) -> bool:
        """Take the lease if it is free; True when this instance holds it afterwards."""
        if self.held:
            return True
        started = time.monotonic()
        try:
            revision = await self._kv.create(
                KEY,
                signed_value(self._signer, self.name, 0, self._clock() + self.ttl_s),
                msg_ttl=self.ttl_s,
            )
        except nats.js.errors.KeyWrongLastSequenceError:
            revision = await self._take_over_forged()
        except nats.js.errors.KeyNotFoundError:
            # create() re-reads the key after a refusal; the holder's value can expire (its
            # TTL) between the two, and that error carries no err_code. Free now: the next
            # try creates it.
            revision = 0
        except nats.js.errors.APIError as exc:
            if exc.err_code != WRONG_LAST_SEQUENCE:
                raise
            revision = await self._take_over_forged()
        if revision == 0:
            return False
        self._revision = revision
        self.epoch = revision
        self._valid_until = started + self.ttl_s
        log.info("lease_acquired", holder=self.name, epoch=self.epoch)
        return True

    async def _take_over_forged(self) -> int:
        """Replace a stored value that no control plane signed; its revision, or 0."""
        found = await self._entry()
        if found is None or not isinstance(found[1], str):
            return 0  # held by a genuine holder (or freed meanwhile: the next try creates)
        stored, why = found
        log.warning("lease_refused", revision=stored, why=why, action="taking it over")
        headers = {EXPECTED_LAST_SUBJECT_SEQUENCE: str(stored), "Nats-TTL": _ttl_header(self.ttl_s)}
        try:
            ack = await self._js.publish(
                f"$KV.{LEASE_BUCKET}.{KEY}",
                signed_value(self._signer, self.name, 0, self._clock() + self.ttl_s),
                headers=headers,
                timeout=1.0,
            )
        except (nats.js.errors.APIError, nats.errors.TimeoutError, TimeoutError):
            return 0  # someone else wrote first: read again at the next try
        return int(ack.seq)

    async def renew(self) -> None:
        """Extend the lease by its TTL; raises LeaseLost when someone else holds it now."""
        if self._revision == 0:
            raise LeaseLost(f"{self.name} does not hold the lease: acquire it first")
        started = time.monotonic()
        self._renewals += 1
        headers = {
            EXPECTED_LAST_SUBJECT_SEQUENCE: str(self._revision),
            # A retried renewal after a lost ack is then stored once, not refused.
            "Nats-Msg-Id": f"lease-{self.name}-{self.epoch}-{self._renewals}",
            "Nats-TTL": _ttl_header(self.ttl_s),
        }
        payload = signed_value(self._signer, self.name, self.epoch, self._clock() + self.ttl_s)
        subject = f"$KV.{LEASE_BUCKET}.{KEY}"
        seq = 0
        for attempt in range(3):
            try:
                ack = await self._js.publish(subject, payload, headers=dict(headers), timeout=1.0)
            except nats.js.errors.APIError as exc:
                if exc.err_code == WRONG_LAST_SEQUENCE:
                    self._lose("another instance took the lease")
                raise
            except (TimeoutError, nats.errors.TimeoutError):
                if attempt == 2 or time.monotonic() >= self._valid_until:
                    self._lose("renewal not acknowledged before the lease ran out")
                continue
            seq = ack.seq
            break
        self._revision = seq
        self._valid_until = started + self.ttl_s

    async def server_time(self) -> float | None:
        """The server's clock now, as it answers a request, or None when it does not
        answer with one (llmgw.bus.servertime.ask). Reads only: any instance may ask,
        leading or not."""
        nc = client_of(self._js)
        return None if nc is None else await servertime.ask(nc)

    def _lose(self, why: str) -> None:
        epoch = self.epoch
        self._revision = 0
        self._valid_until = 0.0
        log.warning("lease_lost", holder=self.name, epoch=epoch, why=why)
        raise LeaseLost(f"{self.name} lost the lease (epoch {epoch}): {why}")

    async def release(self) -> None:
        """Give the lease up now (clean shutdown), so a standby takes over without waiting."""
        if self._revision == 0:
            return
        revision, self._revision, self._valid_until = self._revision, 0, 0.0
        epoch = self.epoch
        try:
            await self._kv.delete(KEY, last=revision)
        except nats.js.errors.APIError as exc:
            # A renewal cancelled by the shutdown may have been stored after all, its ack
            # lost: the lease is still ours at a later revision. Someone else's: leave it.
            found = await self._entry() if exc.err_code == WRONG_LAST_SEQUENCE else None
            ours = (
                found is not None
                and not isinstance(found[1], str)
                and found[1].holder == self.name
                and (found[1].epoch or found[0]) == epoch
            )
            if found is None or not ours:
                log.info("lease_release_skipped", holder=self.name, detail=str(exc))
                return
            await self._kv.delete(KEY, last=found[0])
        log.info("lease_released", holder=self.name, epoch=epoch)

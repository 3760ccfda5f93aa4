"""The lease's acquire under the races a real KV bucket can show, without a server.

nats-py's `create` re-reads the key after the server refuses it; when the holder's value
expires (its TTL) between those two reads, the second raises KeyNotFoundError, an APIError
with no err_code. A control plane starting up at that moment must treat the lease as not
held yet and try again, not crash.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import nats.aio.client
import nats.js
import nats.js.errors
import pytest

from llmgw.bus import lease
from llmgw.core import subjects
from llmgw.pki import signing
from llmgw.pki.ca import CertificateAuthority
from llmgw.pki.identity import Identity

NOW = dt.datetime.now(dt.UTC)
CA = CertificateAuthority.create(now=NOW, name="unit CA")


def signer(name: str) -> signing.Signer:
    issued = CA.issue_client(Identity("control", name), now=NOW)
    return signing.Signer.from_pem(issued.cert_pem, issued.key_pem)


class RacingKV:
    """A bucket whose create fails the way it was told to; counts the calls."""

    def __init__(self, error: Exception | None, revision: int = 5) -> None:
        self.error = error
        self.revision = revision
        self.creates = 0

    async def create(self, key: str, value: bytes, msg_ttl: float | None = None) -> int:
        self.creates += 1
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        return self.revision


def contender(kv: RacingKV) -> lease.Lease:
    js: Any = object()  # acquire never reaches JetStream directly on these paths
    return lease.Lease(
        js, kv, "control-a", ttl_s=3, signer=signer("control-a"), verifier=signing.Verifier(CA.cert)
    )


def test_a_lease_that_expires_inside_create_is_not_held_and_the_next_try_takes_it() -> None:
    kv = RacingKV(nats.js.errors.KeyNotFoundError())
    held = contender(kv)

    async def twice() -> tuple[bool, bool]:
        return await held.acquire(), await held.acquire()

    first, second = asyncio.run(twice())
    assert (first, second) == (False, True)
    assert kv.creates == 2
    assert held.epoch == kv.revision


def test_any_other_refusal_from_the_bucket_is_raised_not_swallowed() -> None:
    refusal = nats.js.errors.APIError(code=503, err_code=10008, description="unavailable")
    held = contender(RacingKV(refusal))
    with pytest.raises(nats.js.errors.APIError) as raised:
        asyncio.run(held.acquire())
    assert raised.value is refusal
    assert held.epoch == 0


class Answer:
    def __init__(self, data: bytes) -> None:
        self.data = data


def asking(answer: bytes) -> tuple[lease.Lease, list[str]]:
    """A contender on a connection whose every request is answered `answer`; the subjects
    it asked on."""
    asked: list[str] = []
    nc = nats.aio.client.Client()

    async def request(subject: str, payload: bytes = b"", **_: Any) -> Answer:
        asked.append(subject)
        return Answer(answer)

    nc.request = request  # type: ignore[method-assign]
    js = nats.js.JetStreamContext(nc)
    kv: Any = object()
    contender = lease.Lease(
        js, kv, "control-a", ttl_s=3, signer=signer("control-a"), verifier=signing.Verifier(CA.cert)
    )
    return contender, asked


def test_the_time_is_asked_of_the_stream_whose_stored_times_are_judged() -> None:
    # In a cluster each stream has its own leader, which stamps what it stores and answers
    # its stream's info: heartbeats are judged by the log stream's leader's clock, which
    # need not be the lease bucket's.
    contender, asked = asking(b'{"ts": "2026-12-05T17:00:00.5Z"}')
    assert asyncio.run(contender.server_time()) == pytest.approx(1796490000.5)
    assert asked == [f"$JS.API.STREAM.INFO.{subjects.STREAM}"]


@pytest.mark.parametrize(
    "answer",
    [
        b'{"ts": "0001-01-01T00:00:00Z"}',  # Go's zero time: a field the server did not set
        b"[]",
        b'"2026-12-05T17:00:00Z"',
        b'{"error": {"code": 503, "description": "JetStream system temporarily unavailable"}}',
        b"\xff",
    ],
    ids=["zero-time", "list", "string", "error", "not-utf8"],
)
def test_an_answer_that_tells_no_time_measures_nothing(answer: bytes) -> None:
    contender, _ = asking(answer)
    assert asyncio.run(contender.server_time()) is None


def test_a_lease_held_past_its_ttl_is_no_longer_held_and_is_asked_for_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A holder that went silent past its TTL (renewals failing) does not hold the lease by
    its own account: its next acquire asks the bucket again instead of leading on."""
    kv = RacingKV(None)
    held = contender(kv)
    clock = [1000.0]
    monkeypatch.setattr(lease.time, "monotonic", lambda: clock[0])
    assert asyncio.run(held.acquire())
    assert held.held
    clock[0] += held.ttl_s - 0.1
    assert held.held
    clock[0] += 0.2
    assert not held.held
    kv.error = nats.js.errors.KeyWrongLastSequenceError()
    held._take_over_forged = _none_to_take  # type: ignore[method-assign]
    assert not asyncio.run(held.acquire())
    assert kv.creates == 2


async def _none_to_take() -> int:
    return 0  # a genuine holder's value: nothing to take over


def test_a_lease_is_held_for_its_ttl_from_before_the_request_not_after_the_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server counts the TTL from when it stored the value, which may be long before a
    slow answer arrives: the holder must not believe it holds the lease any longer."""
    clock = [1000.0]
    monkeypatch.setattr(lease.time, "monotonic", lambda: clock[0])

    class SlowKV(RacingKV):
        async def create(self, key: str, value: bytes, msg_ttl: float | None = None) -> int:
            clock[0] += 2.0  # the answer took 2 s of a 3 s TTL
            return await super().create(key, value, msg_ttl)

    held = contender(SlowKV(None))
    assert asyncio.run(held.acquire())
    clock[0] += 0.9
    assert held.held
    clock[0] += 0.2
    assert not held.held


class _Ack:
    def __init__(self, seq: int) -> None:
        self.seq = seq


class _Stores:
    """JetStream that stores every renewal (each a new revision of the key)."""

    def __init__(self, revision: int) -> None:
        self.revision = revision

    async def publish(self, subject: str, payload: bytes, **_: Any) -> _Ack:
        self.revision += 1
        return _Ack(self.revision)


def test_a_renewal_holds_the_lease_for_a_ttl_from_that_renewal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [1000.0]
    monkeypatch.setattr(lease.time, "monotonic", lambda: clock[0])
    kv = RacingKV(None, revision=5)
    held = lease.Lease(
        _Stores(5),  # type: ignore[arg-type]
        kv,  # type: ignore[arg-type]
        "control-a",
        ttl_s=3,
        signer=signer("control-a"),
        verifier=signing.Verifier(CA.cert),
    )
    assert asyncio.run(held.acquire())
    clock[0] += 2.0
    asyncio.run(held.renew())
    clock[0] += 2.0  # 4 s after the acquisition, 2 s after the renewal
    assert held.held
    assert held.epoch == 5
    clock[0] += 1.1
    assert not held.held


def test_a_renewal_unanswered_past_the_lease_is_not_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lease ran out while the renewal waited for its answer: another instance may hold
    it by now, so this one gives up at once instead of writing again."""
    clock = [1000.0]
    monkeypatch.setattr(lease.time, "monotonic", lambda: clock[0])

    class Unanswered:
        tries = 0

        async def publish(self, subject: str, payload: bytes, **_: Any) -> _Ack:
            self.tries += 1
            clock[0] += 5.0  # longer than the TTL
            raise TimeoutError

    js = Unanswered()
    held = lease.Lease(
        js,  # type: ignore[arg-type]
        RacingKV(None),  # type: ignore[arg-type]
        "control-a",
        ttl_s=3,
        signer=signer("control-a"),
        verifier=signing.Verifier(CA.cert),
    )
    assert asyncio.run(held.acquire())
    with pytest.raises(lease.LeaseLost, match="renewal not acknowledged"):
        asyncio.run(held.renew())
    assert js.tries == 1
    assert not held.held

"""Reading the leader's attestations before a long replay (llmgw.core.attestation).

A replay from the start, or from an old snapshot, first reads every `control.log_attested`
event (one server-side filtered pass, signatures verified like any control event), then
reads the log with those attestations: a message they cover costs a hash instead of an
ECDSA verification.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from nats.aio.client import Client

from llmgw import logs
from llmgw.core import attestation, events, subjects

if TYPE_CHECKING:
    from llmgw.bus.reader import Record

log = logs.get("llmgw.bus")

SUBJECT = subjects.control_event("log_attested")


async def load(nc: Client, *, after_seq: int = 0) -> attestation.Attestations:
    """Every attestation in the log covering a sequence after `after_seq`."""
    from llmgw.bus.reader import Reader  # the reader imports this module

    book = attestation.Attestations()
    reader = Reader(nc, subjects_filter=[SUBJECT], follow=False, name="attestations")
    async with reader:
        async for batch in reader.batches():
            add(book, batch, after_seq=after_seq)
    return book


def of_event(event: events.LogAttested) -> attestation.Attested | None:
    """The attestation an event holds, by the scheme its fields say (llmgw.core.attestation):
    the subject-and-payload digests leaders write now, or the older ones; None for one
    that holds both, or does not hold together."""
    v2 = bool(event.payload_accepted or event.payload_digests)
    if v2 and (event.accepted or event.digests):
        return None
    accepted, digests = (
        (event.payload_accepted, event.payload_digests) if v2 else (event.accepted, event.digests)
    )
    return attestation.Attested.of(
        event.first_seq, event.last_seq, accepted, digests, event.refused, scheme=2 if v2 else 1
    )


def add(book: attestation.Attestations, records: Iterable[Record], *, after_seq: int) -> None:
    """Add to `book` the attestations among `records` that cover a sequence after
    `after_seq`; a malformed one is logged and passed over."""
    for record in records:
        event = record.event
        if not isinstance(event, events.LogAttested) or event.last_seq <= after_seq:
            continue
        item = of_event(event)
        if item is None:
            log.warning("attestation_malformed", seq=record.seq, id=event.id)
            continue
        book.add(item)

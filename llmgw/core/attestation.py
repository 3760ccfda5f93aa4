"""Verifying each event once: the leader's attestations of what it accepted. Pure.

Checking an event's signature costs an ECDSA verification (tens of microseconds), so a
reader that verified every event of a long log at every replay would replay ten times
slower than it decodes and folds. The control-plane leader already verifies every event it
folds; every so often it publishes what it accepted as a `control.log_attested` event (a
signed control event like any other): the range of sequences it read, the sequences in it
that it accepted, and for each a 128-bit digest of the message (subject, id, payload and
signature). A later reader checks the attestation's own signature once, then for each
message in the range compares the message's digest with the attested one (a hash: about a
microsecond) instead of verifying its signature. A message whose digest differs, or that
the leader did not accept, is refused, so an attestation can only confirm what its signer
verified. Messages after the last attestation are verified one by one.

Digests are per message, not a chain, so heartbeats that expired and messages deleted since
change nothing for the others.
"""

from __future__ import annotations

import base64
import bisect
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

DIGEST_BYTES = 16
MAX_PER_ATTESTATION = 4096
"""Sequences one attestation covers at most: its digests then fit well inside one message."""
_DOMAIN = b"llmgw-attested-v1\x00"


def digest(subject: bytes, msg_id: bytes, payload: bytes, signature: bytes) -> bytes:
    """The attested digest of one stored message: each field length-prefixed, so no two
    different messages share an encoding."""
    h = hashlib.sha256(_DOMAIN)
    for part in (subject, msg_id, payload, signature):
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    return h.digest()[:DIGEST_BYTES]


def runs(seqs: Iterable[int]) -> tuple[tuple[int, int], ...]:
    """Ascending sequences as inclusive runs: 1, 2, 3, 7 -> (1, 3), (7, 7)."""
    out: list[list[int]] = []
    for seq in seqs:
        if out and seq == out[-1][1] + 1:
            out[-1][1] = seq
        elif out and seq <= out[-1][1]:
            raise ValueError(f"sequences must ascend: {seq} after {out[-1][1]}")
        else:
            out.append([seq, seq])
    return tuple((a, b) for a, b in out)


def encode_digests(digests: Iterable[bytes]) -> str:
    return base64.b64encode(b"".join(digests)).decode()


@dataclass(frozen=True)
class Attested:
    """One attestation, ready for look-ups: the range it covers and its accepted messages."""

    first_seq: int
    last_seq: int
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    offsets: tuple[int, ...]
    """Index of each run's first digest in `digests`."""
    digests: bytes

    @classmethod
    def of(
        cls, first_seq: int, last_seq: int, accepted: Sequence[tuple[int, int]], digests: str
    ) -> Attested | None:
        """None for an attestation that does not hold together (runs outside the range,
        overlapping, or a digest count that does not match): such a one confirms nothing."""
        try:
            raw = base64.b64decode(digests, validate=True)
        except ValueError:
            return None
        starts, ends, offsets = [], [], []
        count, previous = 0, first_seq - 1
        for a, b in accepted:
            if not previous < a <= b <= last_seq:
                return None
            starts.append(a)
            ends.append(b)
            offsets.append(count)
            count += b - a + 1
            previous = b
        if first_seq > last_seq or len(raw) != count * DIGEST_BYTES:
            return None
        return cls(first_seq, last_seq, tuple(starts), tuple(ends), tuple(offsets), raw)

    def lookup(self, seq: int) -> bytes | None:
        """The attested digest of `seq`, or None when the range holds `seq` but the leader
        did not accept it (the caller checks `first_seq <= seq <= last_seq` first)."""
        i = bisect.bisect_right(self.starts, seq) - 1
        if i < 0 or seq > self.ends[i]:
            return None
        at = (self.offsets[i] + seq - self.starts[i]) * DIGEST_BYTES
        return self.digests[at : at + DIGEST_BYTES]


LOOK_BACK = 8
NOT_COVERED = "not covered"


class Sink(Protocol):
    """What a reader tells an attester: every sequence it read, and each it accepted."""

    def read(self, seq: int) -> None: ...

    def accepted(self, seq: int, digest: bytes) -> None: ...


"""`Attestations.check`: no attestation covers the sequence; verify the signature."""


@dataclass
class Attestations:
    """The attestations a reader knows, by range. Overlapping ones (two leaders attesting
    the same stretch) must agree: a sequence is confirmed by the first that covers it."""

    _items: list[Attested] = field(default_factory=list)
    _firsts: list[int] = field(default_factory=list)
    _last: int = 0

    def add(self, item: Attested) -> None:
        i = bisect.bisect_right(self._firsts, item.first_seq)
        self._items.insert(i, item)
        self._firsts.insert(i, item.first_seq)
        self._last = max(self._last, item.last_seq)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def last_seq(self) -> int:
        """The highest sequence any attestation covers (0 for none)."""
        return self._last

    def check(self, seq: int, message_digest: bytes) -> str | None:
        """None when an attestation confirms the message, NOT_COVERED when none covers its
        sequence, else why it is refused."""
        if seq > self._last:
            return NOT_COVERED
        i = bisect.bisect_right(self._firsts, seq) - 1
        # Ranges may overlap (a new leader attests from where its own reading began): look
        # back over a few of those that start at or before `seq`.
        stop = max(-1, i - LOOK_BACK)
        while i > stop:
            item = self._items[i]
            if item.first_seq <= seq <= item.last_seq:
                attested = item.lookup(seq)
                if attested is None:
                    return "the control plane that attested this range did not accept it"
                if attested != message_digest:
                    return "it differs from the message the control plane attested"
                return None
            i -= 1
        return NOT_COVERED

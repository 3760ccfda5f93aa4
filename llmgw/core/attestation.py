"""Verifying each event once: the leader's attestations of what it accepted. Pure.

Checking an event's signature costs an ECDSA verification (tens of microseconds), so a
reader that verified every event of a long log at every replay would replay ten times
slower than it decodes and folds. The control-plane leader already verifies every event it
folds; every so often it publishes what it checked as a `control.log_attested` event (a
signed control event like any other): a range of sequences, the sequences in it it accepted
with a 128-bit digest of each message (its subject and payload: what a reader folds), and
those it refused. A later reader checks the attestation's own signature once, then for
each message the attestation lists compares the message's digest with the attested one (a
hash: under a microsecond) instead of verifying its signature, and refuses what the leader
refused. A message whose digest differs is refused, so an attestation can only confirm
what its signer verified. Messages it does not list (heartbeats, which expire and are not
worth a digest kept forever) and those after the last attestation are verified one by one.

Digests are per message, not a chain, so messages that expired or were deleted since change
nothing for the others.

The digest covers what a reader folds (the subject and the payload) and nothing of the
headers, so a reader never reads the header block of a message an attestation confirms:
the signature and certificate there are what the attestation's signer already checked,
and a message whose TTL the log refuses (llmgw.core.retention) its signer attests as
refused. Attestations written before this (scheme 1) digested the message id and signature
too; readers still check those (`digest_v1`), reading the headers for them. The two kinds
of digest travel in different fields of `control.log_attested` (llmgw.bus.attestations), so
that a reader from before scheme 2 confirms nothing by it (it checks signatures instead).
"""

from __future__ import annotations

import base64
import bisect
import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

DIGEST_BYTES = 16
MAX_PER_ATTESTATION = 4096
"""Sequences one attestation covers at most: its digests then fit well inside one message."""
SCHEME = 2
"""The digest leaders attest with now (`digest`); 1 is `digest_v1`, still checked."""
SCHEMES = (1, 2)
_DOMAIN = b"llmgw-attested-v2\x00"
_DOMAIN_V1 = b"llmgw-attested-v1\x00"
_LEN = struct.Struct(">I").pack
_sha256 = hashlib.sha256
_blake2b = hashlib.blake2b


def subject_prefix(subject: bytes) -> bytes:
    """The start of every digest of a message on `subject` (`digest_after`): subjects
    repeat, one per node and kind, so a reader keeps this per subject."""
    return _DOMAIN + _LEN(len(subject)) + subject


def digest_after(prefix: bytes, payload: bytes) -> bytes:
    """`digest` of a message whose subject's `subject_prefix` is `prefix`: computed on
    every attested message of a replay, in one call. BLAKE2b, which measured about twice
    as fast as SHA-256 on such messages here; the payload comes last, so it needs no
    length."""
    return _blake2b(prefix + payload, digest_size=DIGEST_BYTES).digest()


def digest(subject: bytes, payload: bytes) -> bytes:
    """The attested digest of one stored message (scheme 2): BLAKE2b-128 over the domain,
    the subject with its length, and the payload."""
    return digest_after(subject_prefix(subject), payload)


def digest_v1(subject: bytes, msg_id: bytes, payload: bytes, signature: bytes) -> bytes:
    """The digest of scheme 1: SHA-256 over the domain and each field with its 4-byte
    length, cut to 16 bytes, so no two different messages share an encoding."""
    encoding = [_DOMAIN_V1]
    for part in (subject, msg_id, payload, signature):
        encoding += (_LEN(len(part)), part)
    return _sha256(b"".join(encoding)).digest()[:DIGEST_BYTES]


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


def _index(starts: Sequence[int], ends: Sequence[int], seq: int) -> int:
    """Which run holds `seq`, or -1."""
    i = bisect.bisect_right(starts, seq) - 1
    return i if i >= 0 and seq <= ends[i] else -1


def _valid_runs(runs_: Sequence[tuple[int, int]], first: int, last: int) -> bool:
    previous = first - 1
    for a, b in runs_:
        if not previous < a <= b <= last:
            return False
        previous = b
    return True


@dataclass(frozen=True)
class Attested:
    """One attestation, ready for look-ups: the range it covers, the messages it accepted
    (with their digests) and those it refused."""

    first_seq: int
    last_seq: int
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    offsets: tuple[int, ...]
    """Index of each accepted run's first digest in `digests`."""
    digests: bytes
    refused_starts: tuple[int, ...] = ()
    refused_ends: tuple[int, ...] = ()
    scheme: int = SCHEME
    """Which digest its signer computed (`SCHEMES`)."""

    @classmethod
    def of(
        cls,
        first_seq: int,
        last_seq: int,
        accepted: Sequence[tuple[int, int]],
        digests: str,
        refused: Sequence[tuple[int, int]] = (),
        *,
        scheme: int,
    ) -> Attested | None:
        """None for an attestation that does not hold together (runs outside the range,
        overlapping, a digest count that does not match, a scheme this reader does not
        know): such a one confirms nothing."""
        if scheme not in SCHEMES:
            return None
        try:
            raw = base64.b64decode(digests, validate=True)
        except ValueError:
            return None
        if first_seq > last_seq or not _valid_runs(accepted, first_seq, last_seq):
            return None
        if not _valid_runs(refused, first_seq, last_seq):
            return None
        offsets, count = [], 0
        for a, b in accepted:
            offsets.append(count)
            count += b - a + 1
        if len(raw) != count * DIGEST_BYTES:
            return None
        starts = tuple(a for a, _ in accepted)
        ends = tuple(b for _, b in accepted)
        r_starts = tuple(a for a, _ in refused)
        r_ends = tuple(b for _, b in refused)
        if any(_index(starts, ends, a) >= 0 or _index(starts, ends, b) >= 0 for a, b in refused):
            return None
        return cls(first_seq, last_seq, starts, ends, tuple(offsets), raw, r_starts, r_ends, scheme)

    def lookup(self, seq: int) -> bytes | None:
        """The attested digest of `seq`, or None when it did not accept it."""
        i = _index(self.starts, self.ends, seq)
        if i < 0:
            return None
        at = (self.offsets[i] + seq - self.starts[i]) * DIGEST_BYTES
        return self.digests[at : at + DIGEST_BYTES]

    def run_of(self, seq: int) -> tuple[int, int, int] | None:
        """The accepted run holding `seq` as (first, last, byte offset of first's digest),
        or None when it did not accept `seq`."""
        i = _index(self.starts, self.ends, seq)
        if i < 0:
            return None
        return self.starts[i], self.ends[i], self.offsets[i] * DIGEST_BYTES

    def refused(self, seq: int) -> bool:
        return _index(self.refused_starts, self.refused_ends, seq) >= 0


LOOK_BACK = 8
NOT_COVERED = "not covered"
"""`Attestations.check`: no attestation covers the sequence; verify the signature."""
OTHER_SCHEME = "another scheme"
"""`Attestations.check`: the attestation that decides the sequence has another digest
scheme than the one asked about (of two, the other: a reader that asked by `SCHEME` checks
again by `digest_v1`)."""
_DIFFERS = "it differs from the message the control plane attested"


class Sink(Protocol):
    """What a reader tells an attester: each message it refused, and each it accepted."""

    def refused(self, seq: int) -> None: ...

    def accepted(self, seq: int, digest: bytes) -> None: ...


@dataclass
class Attestations:
    """The attestations a reader knows, by range. Overlapping ones (two leaders attesting
    the same stretch) must agree: a sequence is confirmed by the first that covers it."""

    _items: list[Attested] = field(default_factory=list)
    _firsts: list[int] = field(default_factory=list)
    _last: int = 0
    # The stretch of sequences [_lo, _hi] that one accepted run of one attestation decides
    # alone, with that run's digests from byte `_base` on: a replay checks sequences in
    # order, so nearly every check is answered here without a search.
    _lo: int = field(default=1, compare=False, repr=False)
    _hi: int = field(default=0, compare=False, repr=False)
    _base: int = field(default=0, compare=False, repr=False)
    _digests: bytes = field(default=b"", compare=False, repr=False)
    _scheme: int = field(default=SCHEME, compare=False, repr=False)

    def add(self, item: Attested) -> None:
        i = bisect.bisect_right(self._firsts, item.first_seq)
        self._items.insert(i, item)
        self._firsts.insert(i, item.first_seq)
        self._last = max(self._last, item.last_seq)
        self._lo, self._hi = 1, 0  # the order changed: search again

    def __len__(self) -> int:
        return len(self._items)

    @property
    def last_seq(self) -> int:
        """The highest sequence any attestation covers (0 for none)."""
        return self._last

    def check(self, seq: int, message_digest: bytes, scheme: int = SCHEME) -> str | None:
        """None when an attestation confirms the message (`message_digest` is its digest by
        `scheme`), NOT_COVERED when none covers its sequence, OTHER_SCHEME when the one
        that decides it digested by another scheme, else why it is refused."""
        if self._lo <= seq <= self._hi:
            if self._scheme != scheme:
                return OTHER_SCHEME
            at = self._base + (seq - self._lo) * DIGEST_BYTES
            if self._digests[at : at + DIGEST_BYTES] == message_digest:
                return None
            return _DIFFERS
        if seq > self._last:
            return NOT_COVERED
        i = bisect.bisect_right(self._firsts, seq) - 1
        if i >= 0:
            self._remember(i, seq)
        # Ranges may overlap (a new leader attests from where its own reading began): look
        # back over a few of those that start at or before `seq`.
        stop = max(-1, i - LOOK_BACK)
        while i > stop:
            item = self._items[i]
            if item.first_seq <= seq <= item.last_seq:
                attested = item.lookup(seq)
                if attested is not None:
                    if item.scheme != scheme:
                        return OTHER_SCHEME
                    if attested != message_digest:
                        return _DIFFERS
                    return None
                if item.refused(seq):
                    return "the control plane that attested this range refused it"
            i -= 1
        return NOT_COVERED

    def _remember(self, i: int, seq: int) -> None:
        """Keep the stretch around `seq` that the attestation at `i` decides alone: inside
        its accepted run, and before the next attestation begins (which the search would
        look at first)."""
        item = self._items[i]
        run = item.run_of(seq) if seq <= item.last_seq else None
        if run is None:
            return
        first, last, base = run
        if i + 1 < len(self._firsts):
            last = min(last, self._firsts[i + 1] - 1)
        self._lo, self._hi, self._digests, self._scheme = seq, last, item.digests, item.scheme
        self._base = base + (seq - first) * DIGEST_BYTES

"""The leader's side of verifying each event once: collecting what its reader checked and
turning it into `control.log_attested` events (llmgw.core.attestation says why).

The control plane's reader verifies every message's signature as it reads, and tells an
`Attester` each message it accepted (with its digest) and each it refused. The leader
publishes an attestation when enough has gathered (`every`) or some time has passed
(`within_s`); every instance, leading or not, drops what an attestation in the log already
covers, so a new leader attests only the stretch nobody has. Heartbeats are not attested
(they expire; a digest kept forever is not worth it), nor do attestations alone make one due.
Nor is what the leader deletes (`drop`: a quarantined node's flood, llmgw.control.policing),
which no later reader meets: attested, each message of a flood left its digest in the log
for ever, written by the leader for the node whatever its quarantine. An attestation covers
only what the fold has passed, so a message is dropped before it could be attested.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

from llmgw.core import attestation, events

DEFAULT_EVERY = attestation.MAX_PER_ATTESTATION
DEFAULT_WITHIN_S = 10.0


class Attester:
    """Digests of accepted messages and refused sequences, waiting to be attested."""

    def __init__(
        self,
        *,
        every: int = DEFAULT_EVERY,
        within_s: float = DEFAULT_WITHIN_S,
        clock: Callable[[], float],
    ) -> None:
        self.every = max(1, min(every, attestation.MAX_PER_ATTESTATION))
        self.within_s = within_s
        self.clock = clock
        self._seqs: list[int] = []
        self._digests: list[bytes] = []
        self._refused: list[int] = []
        self._quiet: set[int] = set()
        self._dropped: set[int] = set()
        self._covered = 0
        self._since = clock()

    def clock_moved(self, step_s: float) -> None:
        """The clock's reading was corrected by `step_s`: so is the last attestation's time."""
        self._since += step_s

    # -- fed by the reader -----------------------------------------------------------------

    def accepted(self, seq: int, digest: bytes) -> None:
        if seq <= self._covered or (self._seqs and seq <= self._seqs[-1]):
            return
        self._seqs.append(seq)
        self._digests.append(digest)

    def refused(self, seq: int) -> None:
        if seq <= self._covered or (self._refused and seq <= self._refused[-1]):
            return
        self._refused.append(seq)

    # -- fed by the fold -------------------------------------------------------------------

    def drop(self, seq: int) -> None:
        """The leader deletes the message at `seq`: it is not attested."""
        for pending in (self._seqs, self._refused):
            i = bisect.bisect_left(pending, seq)
            if i < len(pending) and pending[i] == seq:
                self._dropped.add(seq)
        if len(self._dropped) >= self.every:
            self._compact()  # a flood left out whole makes no attestation due

    def _compact(self) -> None:
        """Forget what was dropped."""
        dropped, self._dropped = self._dropped, set()
        keep = [i for i, s in enumerate(self._seqs) if s not in dropped]
        self._seqs = [self._seqs[i] for i in keep]
        self._digests = [self._digests[i] for i in keep]
        self._refused = [s for s in self._refused if s not in dropped]

    def quiet(self, seq: int) -> None:
        """The message at `seq` is an attestation: attested like any, due for none."""
        if seq > self._covered:
            self._quiet.add(seq)

    def attested(self, event: events.LogAttested) -> None:
        """An attestation reached the log: what it covers needs none from us."""
        if event.last_seq <= self._covered:
            return
        self._covered = event.last_seq
        keep = [i for i, s in enumerate(self._seqs) if s > self._covered]
        self._seqs = [self._seqs[i] for i in keep]
        self._digests = [self._digests[i] for i in keep]
        self._refused = [s for s in self._refused if s > self._covered]
        self._quiet = {s for s in self._quiet if s > self._covered}
        self._dropped = {s for s in self._dropped if s > self._covered}

    # -- for the leader --------------------------------------------------------------------

    @property
    def pending(self) -> int:
        return len(self._seqs) + len(self._refused) - len(self._dropped)

    def due(self) -> bool:
        worth = self.pending - len(self._quiet)
        if worth <= 0:
            return False
        return self.pending >= self.every or self.clock() - self._since >= self.within_s

    def take(self, *, event_id: str, epoch: int, basis_seq: int) -> events.LogAttested | None:
        """The next attestation (at most `every` sequences, none after `basis_seq`, the
        fold's), or None with nothing pending. What it covers stays pending until it is
        folded back (`attested`): a write that fails is attested again."""
        if self._dropped:
            self._compact()
        merged = sorted(
            [(s, True) for s in self._seqs if s <= basis_seq]
            + [(s, False) for s in self._refused if s <= basis_seq]
        )
        if not merged:
            return None
        chunk = merged[: self.every]
        last = chunk[-1][0]
        accepted = [s for s, ok in chunk if ok]
        digests = self._digests[: len(accepted)]
        self._since = self.clock()
        return events.LogAttested(
            id=event_id,
            ts=self.clock(),
            epoch=epoch,
            basis_seq=basis_seq,
            first_seq=chunk[0][0],
            last_seq=last,
            payload_accepted=attestation.runs(accepted),
            payload_digests=attestation.encode_digests(digests),
            refused=attestation.runs(s for s, ok in chunk if not ok),
        )

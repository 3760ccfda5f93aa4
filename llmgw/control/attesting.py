"""The leader's side of verifying each event once: collecting what its reader accepted and
turning it into `control.log_attested` events (llmgw.core.attestation says why).

The control plane's reader verifies every message's signature as it reads, and hands each
accepted message's digest to an `Attester`. The leader publishes an attestation when enough
has gathered (`every`) or some time has passed (`within_s`); every instance, leading or not,
drops what an attestation in the log already covers, so a new leader attests only the
stretch nobody has.
"""

from __future__ import annotations

from collections.abc import Callable

from llmgw.core import attestation, events

DEFAULT_EVERY = attestation.MAX_PER_ATTESTATION
DEFAULT_WITHIN_S = 10.0


class Attester:
    """Digests of accepted messages, waiting to be attested, in sequence order."""

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
        self._first = 0  # first sequence of the pending range (0: nothing read yet)
        self._last = 0
        self._seqs: list[int] = []
        self._digests: list[bytes] = []
        self._since = clock()
        self._covered = 0

    # -- fed by the reader -----------------------------------------------------------------

    def read(self, seq: int) -> None:
        """The reader has handed out or refused everything up to `seq`."""
        if seq <= self._covered:
            return
        if not self._first:
            self._first = max(seq, self._covered + 1)
        self._last = max(self._last, seq)

    def accepted(self, seq: int, digest: bytes) -> None:
        """The reader verified the message at `seq` (and read everything before it)."""
        if seq <= self._covered or (self._seqs and seq <= self._seqs[-1]):
            return
        self.read(seq)
        self._seqs.append(seq)
        self._digests.append(digest)

    # -- fed by the fold -------------------------------------------------------------------

    def attested(self, event: events.LogAttested) -> None:
        """An attestation reached the log: what it covers needs none from us."""
        if event.last_seq <= self._covered:
            return
        self._covered = event.last_seq
        keep = [i for i, s in enumerate(self._seqs) if s > self._covered]
        self._seqs = [self._seqs[i] for i in keep]
        self._digests = [self._digests[i] for i in keep]
        self._first = self._covered + 1 if self._last > self._covered else 0
        if not self._first:
            self._last = 0

    # -- for the leader --------------------------------------------------------------------

    @property
    def pending(self) -> int:
        return len(self._seqs)

    def due(self) -> bool:
        if not self._seqs:
            return False
        return len(self._seqs) >= self.every or self.clock() - self._since >= self.within_s

    def take(self, *, event_id: str, epoch: int, basis_seq: int) -> events.LogAttested | None:
        """The next attestation (at most `every` messages), or None with nothing pending.
        What it covers stays pending until it is folded back (`attested`): a write that
        fails is attested again."""
        if not self._seqs:
            return None
        n = min(len(self._seqs), self.every)
        seqs, digests = self._seqs[:n], self._digests[:n]
        last = self._last if n == len(self._seqs) else self._seqs[n - 1]
        self._since = self.clock()
        return events.LogAttested(
            id=event_id,
            ts=self.clock(),
            epoch=epoch,
            basis_seq=basis_seq,
            first_seq=min(self._first or seqs[0], seqs[0]),
            last_seq=last,
            accepted=attestation.runs(seqs),
            digests=attestation.encode_digests(digests),
        )

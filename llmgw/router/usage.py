"""A router's usage rows for `llmgw ctl usage`: each (key, model)'s tokens and requests
counted on the hot path and added to the fleet's hourly counters in batches
(llmgw.router.quotas' flusher), so that their writes grow with the keys and models in
use, not with requests."""

from __future__ import annotations

from llmgw.bus.counters import Counters
from llmgw.core import subjects
from llmgw.router import auth

COUNTS = ("in", "out", "req")
"""What a row counts, in its order: prompt tokens, completion tokens, requests."""


class UsageRows:
    """(key, model) -> [tokens in, tokens out, requests] not yet added to the counters."""

    def __init__(self) -> None:
        self._rows: dict[tuple[str, str], list[int]] = {}
        self._sending: dict[tuple[str, str], list[int]] = {}
        """The rows of a flush under way: still owed until each add is answered."""

    def used(self, principal: auth.Principal, model: str, prompt: int, completion: int) -> None:
        """A response's tokens, for the key's usage (the hot path: counted here, sent by the
        flusher). Its limits count them when its request is settled (llmgw.router.quotas)."""
        if principal.fleet:
            row = self.row(principal.name, model)
            row[0] += prompt
            row[1] += completion

    def request_done(self, principal: auth.Principal, model: str) -> None:
        if principal.fleet:
            self.row(principal.name, model)[2] += 1

    def row(self, name: str, model: str) -> list[int]:
        """(key, model)'s counts since the last flush, to add to."""
        row = self._rows.get((name, model))
        if row is None:
            row = self._rows[(name, model)] = [0, 0, 0]
        return row

    def add(self, name: str, model: str, counts: tuple[int, ...] | list[int]) -> None:
        row = self.row(name, model)
        for i, n in enumerate(counts):
            row[i] += n

    def pending(self) -> list[tuple[str, str, int, int, int]]:
        """Every (key, model, in, out, requests) the counters do not hold yet: the rows,
        and those of a flush not answered yet."""
        merged: dict[tuple[str, str], list[int]] = {}
        for rows in (self._sending, self._rows):
            for where, counts in rows.items():
                into = merged.setdefault(where, [0, 0, 0])
                for i, n in enumerate(counts):
                    into[i] += n
        return [(name, model, c[0], c[1], c[2]) for (name, model), c in merged.items() if any(c)]

    async def flush(self, counters: Counters, hour: int) -> None:
        """Add each (key, model)'s counts to its counters of UNIX hour `hour`. A count that
        fails, and every count after it, is kept for the next flush rather than lost (also
        when the flush is cancelled: a stopping router spools what it still owes)."""
        if not self._rows:
            return
        self._sending, self._rows = self._rows, {}
        try:
            for (name, model), counts in self._sending.items():
                for i, what in enumerate(COUNTS):
                    if counts[i]:
                        await counters.add(
                            subjects.usage_counter(name, hour, model, what), counts[i]
                        )
                        counts[i] = 0
        except BaseException:
            for (name, model), counts in self._sending.items():
                if any(counts):
                    self.add(name, model, counts)
            raise
        finally:
            self._sending = {}

"""What a router process owes the fleet's counters, kept on disk through an outage.

While the counters cannot be reached, a router admits a metered key's requests against its
share of the budget it last read, and owes the counters what they spent
(llmgw.router.quotas). So that a router stopped, restarted or killed during the outage
does not forget it, each router process keeps what it owes in a file of its own,
`<state_dir>/owed-<worker>.json`:

- budgets: each (key, period)'s tokens not yet added to the budget's counter: money;
- usage: each (key, model)'s tokens and requests not yet added to the hourly counters
  `llmgw ctl usage` bills from (added in the hour they are sent, as after any outage).

Tokens/min windows' debts are not kept: a window is a rate over the last minutes, gone
by the time a restarted router could add to it.

Written while the counters do not answer (no connection, or no answer to the last add), at
most every `FLUSH_S` and only when what is owed changed, and at stop: a temporary file,
fsynced, renamed over the last, the folder fsynced. While they answer, what is owed is
added within a turn and needs no file: each turn the counters answer leaves in it only
what it held and is still owed (`settle`), and it goes once that is nothing. A process
that starts reads its file before it serves and owes what it holds as it owes its own
charges: the flusher adds it once the counters answer (a budget's lease adds what its key
owes first). At least once: a process killed after an add was answered but before the
file was rewritten (a turn later) adds that charge again when it restarts; the budget errs
on the side of the fleet's money. What a process spent in its last `FLUSH_S` before a
kill is not in the file yet.

A file that cannot be read (torn, corrupt, or hostile: amounts beyond the counters'
bounds, a key name no key can have) is renamed aside (`owed-<worker>.json.bad-<time>`)
and logged, saying what to do, and the router starts without it. A folder the router
cannot write is logged, and what it owes stays in memory only.

The writes, each fsynced, run in a thread (`keeping`, and the flusher's `settle`), one at a
time: a slow disk must not stall the router's event loop, which relays every stream.

One process per file: each holds a lock (`owed-<worker>.lock`, flock) while it runs, so
that a second router given the same `state_dir` runs without a spool, saying so, rather
than pay the first one's charges twice. Worker 0 also takes over the files of workers a
router no longer has (started with fewer `workers` than before): their debts join its own,
and their files go (their locks held until then) once its file holds what of them is still
owed, or the counters have all of it, so that no start charges them twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from llmgw import durable, logs
from llmgw.core import tenancy
from llmgw.core.limits import MAX_COUNTER, WHOLE_END, Counter, Text
from llmgw.router.holds import Owed, Owing
from llmgw.router.usage import UsageRows

log = logs.get("llmgw.router.spool")

MAX_SPOOL_BYTES = 64 * 1024 * 1024
"""The largest spool file read: some 500,000 keys' and models' rows."""
KeyName = Annotated[str, msgspec.Meta(pattern=f"^{tenancy.KEY_NAME.pattern}{WHOLE_END}")]
PeriodName = Annotated[str, msgspec.Meta(pattern=f"^(d[0-9]{{8}}|m[0-9]{{6}}){WHOLE_END}")]
"""A budget's period as `tenancy.period_of` names it: d20261202, m202612."""
Tokens = Annotated[int, msgspec.Meta(gt=0, le=MAX_COUNTER)]


class BudgetOwed(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Tokens a key spent of its budget's `period` that its counter does not hold yet."""

    key: KeyName
    period: PeriodName
    tokens: Tokens


class UsageOwed(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A key's usage of one model that the hourly counters do not hold yet."""

    key: KeyName
    model: Text
    tokens_in: Counter = 0
    tokens_out: Counter = 0
    requests: Counter = 0


class Spooled(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """All one router process owes the counters."""

    version: Literal[1] = 1
    budgets: tuple[BudgetOwed, ...] = ()
    usage: tuple[UsageOwed, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.budgets or self.usage)


NOTHING = Spooled()
_decoder = msgspec.json.Decoder(Spooled)


class SpoolUnreadable(ValueError):
    """A spool file's bytes are not what a router writes; the text says what is wrong."""


def decode(data: bytes) -> Spooled:
    """The spool in `data`, else SpoolUnreadable: never another error, whatever the bytes."""
    if len(data) > MAX_SPOOL_BYTES:
        raise SpoolUnreadable(f"{len(data)} bytes, more than a router writes ({MAX_SPOOL_BYTES})")
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise SpoolUnreadable(str(exc)) from None


def encode(spooled: Spooled) -> bytes:
    return msgspec.json.encode(spooled)


def _bounded(n: int) -> int:
    """An amount as the counters bound it: a sum of amounts may pass the bound."""
    return min(n, MAX_COUNTER)


def spooled(
    budgets: Iterable[tuple[str, str, int]], usage: Iterable[tuple[str, str, int, int, int]]
) -> Spooled:
    """What is owed: (key, period, tokens) of budgets, (key, model, in, out, requests) of
    usage; nothing owed is left out, and every amount is bounded (`_bounded`), so that any
    state a router holds is one its spool reads back."""
    return Spooled(
        budgets=tuple(
            BudgetOwed(key=k, period=period, tokens=_bounded(n))
            for k, period, n in budgets
            if n > 0
        ),
        usage=tuple(
            UsageOwed(
                key=k,
                model=model,
                tokens_in=_bounded(i),
                tokens_out=_bounded(o),
                requests=_bounded(r),
            )
            for k, model, i, o, r in usage
            if i or o or r
        ),
    )


def owed_of(owed: Mapping[tuple[str, Owing], Owed], usage: UsageRows) -> Spooled:
    """What a router owes budgets (its `owed` charges but its windows') and `usage`."""
    budgets = ((name, to, o.owing()) for (name, to), o in owed.items() if to)
    return spooled(budgets, usage.pending())


def still_owed(held: Spooled, owed: Spooled) -> Spooled:
    """Of what a file `held`, what is still `owed`: each amount the smaller of the two. What
    was added since leaves the file; what was charged since does not enter it."""
    budgets = {(b.key, b.period): b.tokens for b in owed.budgets}
    usage = {(u.key, u.model): (u.tokens_in, u.tokens_out, u.requests) for u in owed.usage}
    rows: list[tuple[str, str, int, int, int]] = []
    for u in held.usage:
        now = usage.get((u.key, u.model), (0, 0, 0))
        rows.append((u.key, u.model, min(u.tokens_in, now[0]), min(u.tokens_out, now[1]),
                     min(u.requests, now[2])))  # fmt: skip
    kept = (
        (b.key, b.period, min(b.tokens, budgets.get((b.key, b.period), 0))) for b in held.budgets
    )
    return spooled(kept, rows)


def merged(parts: Iterable[Spooled]) -> Spooled:
    """Several spools (or one with repeated entries) as one, each amount summed."""
    budgets: dict[tuple[str, str], int] = {}
    usage: dict[tuple[str, str], list[int]] = {}
    for part in parts:
        for b in part.budgets:
            budgets[(b.key, b.period)] = budgets.get((b.key, b.period), 0) + b.tokens
        for u in part.usage:
            row = usage.setdefault((u.key, u.model), [0, 0, 0])
            for i, n in enumerate((u.tokens_in, u.tokens_out, u.requests)):
                row[i] += n
    rows = ((k, m, row[0], row[1], row[2]) for (k, m), row in usage.items())
    return spooled(((k, p, n) for (k, p), n in budgets.items()), rows)


class OwedSpool:
    """One router process's spool file (see the module's text); made by `open`."""

    def __init__(self, folder: Path, worker: int, lock: int) -> None:
        self.folder = folder
        self.worker = worker
        self._lock = lock
        self._writing = threading.RLock()
        """One write or removal at a time: `keeping`'s and the flusher's run in threads."""
        self._written = NOTHING
        """What the file holds (NOTHING: there is none)."""
        self._taken: list[tuple[Path, int]] = []
        self._taken_held = NOTHING
        """Files taken over (`load`) that stay, with their locks, until this file holds
        what of their debts is still owed, or nothing of them is (then they go): what
        they held (`_taken_held`) is owed once, never again by the next start."""
        self._failing = False

    @property
    def path(self) -> Path:
        return spool_path(self.folder, self.worker)

    @classmethod
    def open(cls, state_dir: str, worker: int) -> OwedSpool | None:
        """Worker `worker`'s spool in `state_dir`, locked; None, logged, when the folder
        cannot be written or another process holds it."""
        folder = Path(state_dir)
        try:
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)  # the router user's alone
            lock = _locked(folder, worker)
        except OSError as exc:
            log.error("owed_spool_unavailable", folder=str(folder), error=str(exc),
                      advice="set the router's state_dir to a folder it may write: until "
                      "then, what it owes the fleet's budgets through an outage is lost if "
                      "it stops before the counters answer")  # fmt: skip
            return None
        if lock is None:
            log.error("owed_spool_taken", folder=str(folder), worker=worker,
                      advice="another router process on this host uses this state_dir: "
                      "give each router its own state_dir; this one keeps what it owes in "
                      "memory only")  # fmt: skip
            return None
        return cls(folder, worker, lock)

    def load(self, workers: int) -> Spooled:
        """What this process's file holds, and for worker 0 what the files of workers
        beyond `workers` hold (taken over: written into its own file, theirs removed)."""
        own = read(self.path)
        self._written = own
        orphans = self._orphans(workers) if self.worker == 0 else []
        if not orphans:
            return own
        everything = merged([own, *(s for _, s, _ in orphans)])
        with self._writing:
            self._taken = [(path, lock) for path, _, lock in orphans]
            self._taken_held = merged(s for _, s, _ in orphans)
            self._keep(everything)  # their files go once it is written
        return everything

    def _orphans(self, workers: int) -> list[tuple[Path, Spooled, int]]:
        """(file, its spool, its lock) of every worker number from `workers` on that has a
        file no process holds."""
        found: list[tuple[Path, Spooled, int]] = []
        for path in sorted(self.folder.glob("owed-*.json")):
            number = path.name[len("owed-") : -len(".json")]
            if not (number.isascii() and number.isdigit()) or int(number) < workers:
                continue
            with contextlib.suppress(OSError):
                lock = _locked(self.folder, int(number))
                if lock is not None:
                    found.append((path, read(path), lock))
        return found

    def keep(self, owed: Spooled) -> None:
        """Make the file hold `owed`, when it holds something else: written whole, or
        removed when nothing is owed. A disk that refuses is logged, once."""
        with self._writing:
            self._keep(owed)

    def _keep(self, owed: Spooled) -> None:
        """Make the file hold `owed`: all that is owed (`keep`), or all of what the files
        held that is still owed (`settle`); the files taken over go once it does."""
        if owed == self._written:
            self._drop_taken()
            return
        if not owed:
            self.paid()
            self._drop_taken()
            return
        try:
            durable.replace(self.path, encode(owed))
        except OSError as exc:
            if not self._failing:
                log.error("owed_spool_not_durable", file=str(self.path), error=str(exc),
                          advice="free space or fix the folder's permissions: until then "
                          "what this router owes the fleet's budgets is lost if it stops "
                          "before the counters answer")  # fmt: skip
            self._failing = True
            return
        self._failing = False
        self._written = owed
        self._drop_taken()

    def _drop_taken(self) -> None:
        for path, lock in self._taken:
            with contextlib.suppress(OSError):
                durable.remove(path)
            os.close(lock)
        self._taken, self._taken_held = [], NOTHING

    def settle(self, owed: Spooled) -> None:
        """The counters answered a turn of the flusher, which added what it could: the file
        keeps only what it held that is still `owed` (`still_owed`), and goes once that is
        nothing."""
        with self._writing:
            held = merged((self._written, self._taken_held)) if self._taken else self._written
            if held or self._taken:
                self._keep(still_owed(held, owed))

    def paid(self) -> None:
        """All the file held was added to the counters: it goes."""
        with self._writing:
            if self._written:
                with contextlib.suppress(OSError):
                    durable.remove(self.path)
                    self._written = NOTHING

    def close(self) -> None:
        # Under the writes' lock: a write in a thread may be giving the taken files' locks
        # back, and a descriptor closed twice may by then be another file's.
        with self._writing:
            taken, self._taken = self._taken, []
            for fd in (*(lock for _, lock in taken), self._lock):
                with contextlib.suppress(OSError):
                    os.close(fd)


async def keeping(
    spool: OwedSpool, owed_now: Callable[[], Spooled], unreached: Callable[[], bool],
    stop: asyncio.Event, every_s: float,
) -> None:  # fmt: skip
    """Until `stop`: every `every_s`, while the counters are `unreached`, make `spool` hold
    what its router owes now. While they answer, what is owed is added within a turn of the
    flusher, or with the next usage batch: no file."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
        if unreached():
            await asyncio.to_thread(spool.keep, owed_now())  # fsyncs: off the event loop


def spool_path(folder: Path, worker: int) -> Path:
    return folder / f"owed-{worker}.json"


def _locked(folder: Path, worker: int) -> int | None:
    """The lock of worker `worker`'s file, held; None when another process holds it."""
    fd = os.open(folder / f"owed-{worker}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def read(path: Path) -> Spooled:
    """The spool in `path`; NOTHING when there is none, or when it cannot be read: then
    it is set aside and said so (`set_aside`)."""
    try:
        owed = decode(_contents(path))
    except FileNotFoundError:
        return NOTHING
    except (OSError, SpoolUnreadable) as exc:
        set_aside(path, str(exc))
        return NOTHING
    if owed:
        log.info("owed_spool_loaded", file=str(path), budgets=len(owed.budgets),
                 usage=len(owed.usage))  # fmt: skip
    return merged([owed])


def _contents(path: Path) -> bytes:
    """Up to one byte more than a spool may hold, of a regular file only: opening a FIFO put
    there would wait for a writer, and a device may never end."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SpoolUnreadable("not a regular file: a router writes a file of its own there")
        return f.read(MAX_SPOOL_BYTES + 1)


def set_aside(path: Path, why: str) -> None:
    """Rename an unreadable spool out of the way, and say what to do about it: never over
    one set aside before (the same second's gets a number), which the operator has yet to
    inspect."""
    stamp = f"{path.name}.bad-{int(time.time())}"
    aside, n = path.with_name(stamp), 0
    while aside.exists() or aside.is_symlink():
        n += 1
        aside = path.with_name(f"{stamp}-{n}")
    try:
        os.replace(path, aside)
    except OSError as exc:
        moved = f"not moved ({exc}): move or delete it"
    else:
        moved = str(aside)
    log.error("owed_spool_unreadable", file=str(path), error=why[:500], moved_to=moved,
              advice="the router started without it: the charges it held (tokens keys "
              "spent while the budget counters could not be reached) were not added to "
              "their budgets; inspect it, and delete it once dealt with")  # fmt: skip

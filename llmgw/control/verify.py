"""Checking a log against the control plane's determinism (docs/design.md, invariant 3).

`verify(records)` folds a log and recomputes every batch of decisions the leader
recorded, at its decision point (the state folded up to its `basis_seq`, at its
`ts`), with the reconcile timings that leader recorded in its LeaderElected
(`recorded_timings`), and returns each disagreement as a `Difference`; an empty
list means the log reproduces its own decisions. `digests_agree` folds a log from scratch and
from a snapshot and compares the digests. `llmgw ctl replay --verify` and the
control-plane integration tests call these; the recomputation itself is
`llmgw.core.reconcile.verify` (pure), this module only shapes its report.

Purely computational: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from llmgw.core import events, reconcile, state


class Difference(msgspec.Struct, frozen=True, kw_only=True):
    """One way the log disagrees with itself."""

    kind: str
    """`decision` (a recorded batch the log does not reproduce) or `digest`."""
    detail: str


class Timings(msgspec.Struct, frozen=True, kw_only=True):
    """The reconcile timings each epoch's leader recorded, and the epochs that recorded
    none although they decided (logs from before the timings were recorded)."""

    by_epoch: dict[int, reconcile.ReconcileConfig]
    unrecorded: tuple[int, ...] = ()
    problems: tuple[Difference, ...] = ()
    """Recorded timings this llmgw cannot read (a setting it does not know)."""


def recorded_timings(records: Iterable[tuple[int, events.Event]]) -> Timings:
    """What every LeaderElected of `records` says its leader decides with. Pure."""
    by_epoch: dict[int, reconcile.ReconcileConfig] = {}
    deciding: set[int] = set()
    problems: list[Difference] = []
    unreadable: set[int] = set()
    for seq, event in records:
        if isinstance(event, events.LeaderElected):
            if not event.reconcile:
                continue
            try:
                by_epoch[event.epoch] = msgspec.convert(event.reconcile, reconcile.ReconcileConfig)
            except msgspec.ValidationError as exc:
                unreadable.add(event.epoch)
                problems.append(
                    Difference(
                        kind="timings",
                        detail=f"seq {seq}: leader {event.leader} (epoch {event.epoch}) "
                        f"recorded reconcile timings this llmgw cannot read ({exc}): verify "
                        "with the llmgw version that leader ran",
                    )
                )
        elif isinstance(event, events.ControlEvent) and not isinstance(
            event, reconcile.OBSERVATIONS
        ):
            deciding.add(event.epoch)
    unrecorded = tuple(sorted(deciding - set(by_epoch) - unreadable))
    return Timings(by_epoch=by_epoch, unrecorded=unrecorded, problems=tuple(problems))


def verify(
    records: Iterable[tuple[int, events.Event]],
    *,
    config: reconcile.ReconcileConfig | None = None,
    start: state.ClusterState | None = None,
) -> list[Difference]:
    """Recompute every recorded planning batch of a log; the differences found. Pure.

    `records` are (seq, event) pairs in log order (`bus.Record`s unpacked);
    `start` resumes from a snapshot's state (batches decided before it are skipped).
    Each epoch is checked with the timings its leader recorded; `config` (default:
    the defaults) serves the epochs that recorded none, from older logs.
    """
    log = list(records)
    timings = recorded_timings(log)
    report = reconcile.verify(log, config=config, state=start, by_epoch=timings.by_epoch)
    return [*timings.problems, *(Difference(kind="decision", detail=m) for m in report.mismatches)]


def digests_agree(
    records: Sequence[tuple[int, events.Event]],
    snapshot: tuple[int, bytes] | None = None,
) -> list[Difference]:
    """Fold `records` from scratch and, if given, from `snapshot` (seq, bytes) plus the
    records after it; a Difference when the two digests differ. Pure."""
    scratch, _ = state.fold_records(records)
    if snapshot is None:
        return []
    seq, data = snapshot
    resumed = state.decode_snapshot(data)
    resumed, _ = state.fold_records([r for r in records if r[0] > seq], resumed)
    a, b = state.digest(scratch), state.digest(resumed)
    if a == b:
        return []
    return [
        Difference(
            kind="digest",
            detail=f"folding from scratch gives {a[:12]}, from the snapshot at seq {seq} "
            f"gives {b[:12]}",
        )
    ]

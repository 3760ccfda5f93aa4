"""Verify: replay a log and recompute every recorded planning batch at its decision point."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

import msgspec

from llmgw.core import autoscale, events
from llmgw.core.reconcile.batch import OBSERVATIONS, Decision, ReconcileConfig
from llmgw.core.reconcile.planner import plan
from llmgw.core.state import ClusterState, apply
from llmgw.core.state.scaling import target_replicas


class VerifyReport(msgspec.Struct, kw_only=True):
    batches: int = 0
    """Recorded planning batches recomputed."""
    matched: int = 0
    observations: int = 0
    """Recorded observations (heartbeat-driven: facts, not recomputable)."""
    scalings: int = 0
    """Scaling decisions recomputed from the observation recorded with each."""
    mismatches: list[str] = []
    rejected: list[tuple[int, str]] = []
    """(seq, reason) of events the fold refused while replaying."""

    @property
    def ok(self) -> bool:
        return not self.mismatches


_encode = msgspec.json.Encoder().encode


def _without_id(decision: Decision) -> bytes:
    """A decision's encoding with its id left out: ids carry the leader's random part."""
    return _encode(msgspec.structs.replace(decision, id=""))


def verify(
    records: Iterable[tuple[int, events.Event]],
    *,
    config: ReconcileConfig | None = None,
    state: ClusterState | None = None,
    by_epoch: Mapping[int, ReconcileConfig] | None = None,
) -> VerifyReport:
    """Replay a log and recompute every recorded planning batch at its decision point. Pure.

    A batch is the control events and commands sharing (epoch, basis_seq); it
    must equal `plan` run on the state folded up to basis_seq at the batch's
    `ts`. A recorded prefix of the recomputed batch also matches: a leader may
    die halfway through publishing. `state` resumes from a snapshot. `by_epoch`
    holds the timings each leader recorded; `config` serves the other epochs.
    """
    cfg = config or ReconcileConfig()
    timings = by_epoch or {}
    log = list(records)
    batches: dict[tuple[int, int], list[Decision]] = defaultdict(list)
    report = VerifyReport()
    for _seq, event in log:
        if isinstance(event, OBSERVATIONS):
            report.observations += 1
        elif isinstance(event, events.ControlEvent) and not isinstance(event, events.LeaderElected):
            batches[(event.epoch, event.basis_seq)].append(event)  # type: ignore[arg-type]
    pending = sorted(batches, key=lambda k: (k[1], k[0]))
    st = state if state is not None else ClusterState()
    i = 0
    for seq, event in log:
        while i < len(pending) and pending[i][1] < seq:
            _check(st, pending[i], batches[pending[i]], timings.get(pending[i][0], cfg), report)
            i += 1
        if isinstance(event, events.ScaleDecided):
            _check_scaling(st, seq, event, report)
        reason = apply(st, event, seq)
        if reason is not None:
            report.rejected.append((seq, reason))
    while i < len(pending):
        _check(st, pending[i], batches[pending[i]], timings.get(pending[i][0], cfg), report)
        i += 1
    return report


def _check_scaling(
    state: ClusterState, seq: int, event: events.ScaleDecided, report: VerifyReport
) -> None:
    """Decide again on the observation recorded with a scaling decision."""
    model = state.models.get(event.model)
    spec = model.profile.autoscale if model is not None else None
    if model is None or spec is None:
        return  # the fold refuses it; replay reports that
    report.scalings += 1
    again = autoscale.verify_decision(spec, target_replicas(model), event.observation)
    recorded = (event.to_replicas, event.reason)
    if isinstance(again, str) or again != recorded:
        report.mismatches.append(
            f"scale decision at seq {seq} ({event.model}): recorded {recorded[0]} replicas "
            f"({recorded[1]!r}) but its observation gives "
            + (again if isinstance(again, str) else repr(again))
        )


def _check(
    state: ClusterState,
    key: tuple[int, int],
    recorded: list[Decision],
    cfg: ReconcileConfig,
    report: VerifyReport,
) -> None:
    epoch, basis = key
    if basis < state.last_seq:
        return  # the replay started after this batch's basis (from a snapshot)
    report.batches += 1
    again = plan(state, recorded[0].ts, epoch=epoch, basis_seq=basis, config=cfg).decisions
    for n, (a, b) in enumerate(zip(recorded, again, strict=False)):
        if _without_id(a) != _without_id(b):
            report.mismatches.append(
                f"batch at seq {basis} (epoch {epoch}), decision {n}: recorded "
                f"{_encode(a).decode()} but the log reproduces {_encode(b).decode()}"
            )
            return
    if len(recorded) > len(again):
        extra = _encode(recorded[len(again)]).decode()
        report.mismatches.append(
            f"batch at seq {basis} (epoch {epoch}): recorded {len(recorded)} decisions, the log "
            f"reproduces {len(again)}; first extra: {extra}"
        )
        return
    report.matched += 1

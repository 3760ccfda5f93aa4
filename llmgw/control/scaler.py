"""The leader's autoscaler: the routers' latest load reports, each model's recommendations
over its windows, and the ScaleDecided events they lead to.

It holds what the log does not: the latest report of every router process and of every
node's agent (read from `llmgw-signals` by `llmgw.control.scaling`, each dated no later
than the server stored it; a node's figures count only for the endpoints the log has on
that node, and there over any router's: `llmgw.core.loadreport`) and each model's recent
recommendations. A new leader starts both afresh; `Recommendations` then waits a whole
down window before it scales anything in. Every decision carries the observation it was
made on (llmgw.core.autoscale), so the log alone explains and reproduces it.

Short of GPUs: when a model cannot be placed for want of free GPUs, the autoscaled model
of lowest priority below it with replicas above its `min`, on GPUs of a class the waiting
model accepts, gives one up (a ScaleDecided
naming the model it makes room for), one at a time: none while a retired replica still
holds GPUs, since those are already on their way. A model of lower priority than one
that is short does not scale out meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import msgspec

from llmgw.core import autoscale, events, loadreport, subjects
from llmgw.core.state import ClusterState, ModelState
from llmgw.core.state.scaling import target_replicas

ROUTER_PREFIX = subjects.SIGNALS_ROOT + ".router."
REPORT_MAX_AGE_S = loadreport.MAX_AGE_S
"""A report older than this no longer counts (a router or agent that stopped)."""
REPORT_FORGET_S = 60.0
"""A report older than this is forgotten (the router is gone), and its router is no
longer a Prometheus target."""
SHORT_CODES = frozenset({"too few free GPUs", "no GPUs"})
"""Why a model cannot be placed that taking GPUs from another model can cure."""


class Seen(NamedTuple):
    """A model's observation in the leader's last pass."""

    observation: autoscale.Observation
    reason: str
    """`recommend`'s reason, for a decision (a preemption's) made on it later."""
    at: float


def _priority(model: ModelState) -> int:
    spec = model.profile.autoscale
    return spec.priority if spec is not None else 0


class Scaler:
    def __init__(self, *, max_age_s: float = REPORT_MAX_AGE_S) -> None:
        self.max_age_s = max_age_s
        self.epoch = 0
        """The leader epoch its windows belong to (`restart` on a new one)."""
        self.decided_at = 0.0
        """When it last decided (the leader decides at most once a second)."""
        self.reports: dict[str, loadreport.LoadReport] = {}
        """Subject (one router process, or one node's agent) -> its latest report."""
        self.history: dict[str, autoscale.Recommendations] = {}
        self.last: dict[str, Seen] = {}
        """Model -> what the leader's last pass observed of it: only the models it observed
        then (autoscaled, in the catalog, not pinned), none when no router reported."""

    def clock_moved(self, step_s: float) -> None:
        """The clock's reading was corrected by `step_s`: so is what was read of it here
        (kept as read, a correction back by an hour stopped the autoscaler for an hour)."""
        self.decided_at += step_s
        self.last = {name: seen._replace(at=seen.at + step_s) for name, seen in self.last.items()}
        for history in self.history.values():
            history.shift(step_s)

    def restart(self, epoch: int) -> None:
        """A new epoch: each model's windows start when next seen (the reports received so
        far still count)."""
        self.epoch = epoch
        self.history.clear()

    def note(
        self, subject: str, report: loadreport.LoadReport, *, state: ClusterState | None = None
    ) -> None:
        """Keep `report` as its subject's latest; with `state`, only its entries about the
        log's models and endpoints (the only ones `aggregate` counts): a report may name
        thousands of others, and a router writes a thousand worker subjects, so keeping
        them whole let one router's certificate hold gigabytes in every control-plane
        instance. An endpoint that comes up counts from its routers' next reports."""
        if subjects.signals_owner(subject) is None:
            return  # not one router process's or node's: see subjects.MAX_ROUTER_WORKERS
        if not loadreport.supersedes(report, self.reports.get(subject)):
            return
        if state is not None:
            known = state.endpoints
            report = msgspec.structs.replace(
                report,
                models=tuple(t for t in report.models if t.model in state.models),
                endpoints=tuple(
                    e for e in report.endpoints
                    if (ep := known.get(e.endpoint)) is not None and ep.model == e.model
                ),
            )  # fmt: skip
        self.reports[subject] = report

    def router_targets(self, now: float) -> dict[str, str]:
        """Router name -> `host:port` of its /metrics, from reports of the last minute (its
        workers share one admin port: any of them names it)."""
        out: dict[str, str] = {}
        for subject, r in self.reports.items():
            if subject.startswith(ROUTER_PREFIX) and r.metrics and now - r.ts <= REPORT_FORGET_S:
                out[subject[len(ROUTER_PREFIX) :].rpartition(".")[0]] = r.metrics
        return out

    def _forget(self, now: float) -> None:
        """Drop reports of routers long gone, and any dated ahead of the freshness limit:
        kept, such a report would refuse its subject's next reports (`note` keeps the
        latest by date) until the clock caught up with it."""
        gone = [s for s, r in self.reports.items()
                if now - r.ts > REPORT_FORGET_S or r.ts - now > self.max_age_s]  # fmt: skip
        for subject in gone:
            del self.reports[subject]

    def observations(self, state: ClusterState, now: float) -> dict[str, autoscale.Observation]:
        """What the leader last observed of each model still in the catalog, while no older
        than a report counts (the control plane's /metrics exports these): a model removed,
        pinned, no longer autoscaled, or whose routers all fell silent drops out, and so does
        everything once this instance stops deciding (it no longer leads)."""
        return {
            name: seen.observation
            for name, seen in self.last.items()
            if name in state.models and 0.0 <= now - seen.at <= self.max_age_s
        }

    def signals(self, state: ClusterState, now: float) -> dict[str, autoscale.Signals]:
        """One `Signals` per model of the catalog that is autoscaled or has an endpoint up
        (`loadreport.fleet_signals`: a node's agent has the word on its own engines)."""
        self._forget(now)
        return loadreport.fleet_signals(state, self.reports, now, self.max_age_s)

    def decide(
        self,
        state: ClusterState,
        now: float,
        *,
        epoch: int,
        basis_seq: int,
        unplaceable: Mapping[str, str],
        ids: Callable[[str], str],
    ) -> list[events.ScaleDecided]:
        """At most one decision per model this pass (one preemption at most)."""
        self._forget(now)
        self.last = {}
        routers = [r for s, r in self.reports.items() if s.startswith(ROUTER_PREFIX)]
        if not any(loadreport.is_fresh(r, now, self.max_age_s) for r in routers):
            # No router reports (none runs, or none reaches NATS, while they may well be
            # serving on what they last knew): hold every count rather than read silence
            # as idleness.
            return []
        signals = self.signals(state, now)
        short = self._short(state, unplaceable)
        out: list[events.ScaleDecided] = []
        for name in sorted(signals):
            model = state.models[name]
            spec = model.profile.autoscale
            if spec is None or model.pinned is not None:
                continue
            history = self.history.get(name)
            if history is None:
                # Its windows start when it is first seen: a model just declared is not scaled
                # in before a whole down window of its own.
                history = self.history[name] = autoscale.Recommendations(now)
            current = target_replicas(model)
            # The routers' p90s cover their last window: they speak for this count only
            # once all of it has served that long.
            settled = signals[name].serving >= current and (
                now - model.scaled_ts >= model.startup_s + loadreport.WINDOW_S
            )
            obs, reason = autoscale.observe(
                spec, current, signals[name], history, now, startup_s=model.startup_s,
                settled=settled,
            )  # fmt: skip
            self.last[name] = Seen(obs, reason, now)
            outranked = short is not None and _priority(model) < short[1]
            decided = autoscale.decide(spec, current, obs, reason)
            if decided is None or (outranked and decided[0] > current):
                continue
            out.append(self._event(name, current, decided, obs, now, epoch, basis_seq, ids, out))
        for name in sorted(self.history):
            if name not in signals:
                del self.history[name]
        if short is not None and not out:
            victim = self._victim(state, short)
            if victim is not None:
                out.extend(self._preempt(state, victim, short, now, epoch, basis_seq, ids))
        return out

    def _event(
        self,
        name: str,
        current: int,
        decided: tuple[int, str],
        obs: autoscale.Observation,
        now: float,
        epoch: int,
        basis_seq: int,
        ids: Callable[[str], str],
        out: list[events.ScaleDecided],
    ) -> events.ScaleDecided:
        base = f"scale-{epoch}-{basis_seq}-{len(out)}"
        return events.ScaleDecided(
            id=ids(base), ts=now, epoch=epoch, basis_seq=basis_seq, model=name,
            from_replicas=current, to_replicas=decided[0], reason=decided[1][:2000],
            observation=obs,
        )  # fmt: skip

    def _short(self, state: ClusterState, unplaceable: Mapping[str, str]) -> tuple[str, int] | None:
        """The model of highest priority that waits for GPUs, and its priority."""
        waiting = [
            (_priority(state.models[m]), m)
            for m, code in unplaceable.items()
            if code in SHORT_CODES and m in state.models
        ]
        if not waiting:
            return None
        priority, model = max(waiting)
        return model, priority

    def _victim(self, state: ClusterState, short: tuple[str, int]) -> str | None:
        """The autoscaled model of lowest priority under the short model's that can give a
        replica on GPUs of a class the short model accepts."""
        if any(r.retired and not all(s.released for s in r.shards)
               for r in state.replicas.values()):  # fmt: skip
            return None  # GPUs are already on their way back
        wanted = state.models[short[0]].profile.gpu_class
        classes: dict[str, set[str]] = {}
        for r in state.replicas.values():
            if not r.retired:
                classes.setdefault(r.model, set()).add(r.gpu_class)
        candidates = []
        for name, model in state.models.items():
            spec = model.profile.autoscale
            if spec is None or model.pinned is not None or spec.priority >= short[1]:
                continue
            suits = not wanted or wanted in classes.get(name, set())
            if suits and target_replicas(model) > spec.min:
                candidates.append((spec.priority, name))
        return min(candidates)[1] if candidates else None

    def _preempt(
        self,
        state: ClusterState,
        victim: str,
        short: tuple[str, int],
        now: float,
        epoch: int,
        basis_seq: int,
        ids: Callable[[str], str],
    ) -> list[events.ScaleDecided]:
        model = state.models[victim]
        spec = model.profile.autoscale
        assert spec is not None
        current = target_replicas(model)
        seen = self.last.get(victim)
        if seen is None:
            return []
        obs = msgspec.structs.replace(seen.observation, short_of=short[0], short_priority=short[1])
        decided = autoscale.decide(spec, current, obs, seen.reason)
        if decided is None:
            return []
        return [self._event(victim, current, decided, obs, now, epoch, basis_seq, ids, [])]

"""Autoscaling: a model's scaling rules, what the leader observed, and what it decides.

A model whose profile has `autoscale` has a replica count that follows its load. The
leader aggregates the routers' load reports (llmgw.core.loadreport) into one
`Signals` per model, turns them into a recommendation (`recommend`: the count at which
every signal would be at its target), keeps each model's recommendations over the
stabilization windows (`Recommendations`), and decides (`decide`): up to the lowest
recommendation of the up window, down to the highest of the down window, never more than
`max_step` at once, within `min..max`. A square wave faster than the windows therefore
moves nothing: the up window's lowest recommendation is the trough, the down window's
highest the crest.

The decision is recorded as `ScaleDecided` with the `Observation` it was made on (the
signals, the recommendation and the windows' bounds), so `decide` run again on a replay
gives the same count and the same reason (`llmgw ctl replay --verify`).

A model that takes long to start aims below its targets, by its measured start-up time
over `STARTUP_HORIZON_S` (at most half): it scales out while there is still time for the
new replica to load before the targets are missed.

Purely computational: times are arguments.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Annotated

import msgspec

from llmgw.core.limits import Name

SLO_MEMORY_S = 3600.0
"""How long a count that broke the latency SLO at some load is not returned to at that load."""
STARTUP_HORIZON_S = 600.0
"""A model that takes this long (or longer) to start aims at half its targets."""
TOLERANCE = 0.1
"""A signal within 10% of its target recommends the current count (as Kubernetes' HPA)."""
MAX_REPLICAS = 10_000

MAX_AMOUNT = 1e9
MAX_REQUESTS = 10**15
"""Bounds of what `Signals` records: sums over every router's reports can pass any one
report's bounds, so `aggregate` caps them here (a decision whose observation broke its own
bounds would be one no reader of the log could decode)."""

Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_REPLICAS)]
Amount = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_AMOUNT)]
Window = Annotated[float, msgspec.Meta(ge=0.0, le=86_400.0)]


class Autoscale(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A model's scaling rules (`ModelProfile.autoscale`). A target of 0 is no signal."""

    min: Count = 1
    """Fewest replicas; 0 lets an idle model release its GPUs (the router holds the next
    request while a replica starts)."""
    max: Count = 1
    waiting_per_replica: Amount = 0.0
    """Requests waiting (held by routers for an endpoint, or queued in engines) per replica."""
    running_per_replica: Amount = 0.0
    """Requests the engines run, per replica (a concurrency target)."""
    kv_usage: Amount = 0.0
    """The engines' mean KV-cache usage, 0..1."""
    ttft_p90_s: Amount = 0.0
    """Latency SLO: time to first token, p90 over the routers' last window."""
    itl_p90_s: Amount = 0.0
    """Latency SLO: inter-token latency (a stream's mean gap), p90."""
    up_window_s: Window = 15.0
    """A scale-out goes to the lowest recommendation of this window: load must last."""
    down_window_s: Window = 300.0
    """A scale-in goes to the highest recommendation of this window; an idle model with
    `min: 0` reaches zero after it."""
    max_step: Annotated[int, msgspec.Meta(ge=1, le=MAX_REPLICAS)] = 2
    """Most replicas added or removed by one decision."""
    priority: Annotated[int, msgspec.Meta(ge=-1000, le=1000)] = 0
    """Short of GPUs, a model of higher priority may take replicas of a lower one (never
    below its `min`)."""
    hold_requests: Annotated[int, msgspec.Meta(ge=0, le=100_000)] = 100
    """At zero replicas, requests each router holds while one starts; beyond: 503."""
    hold_s: Window = 120.0
    """How long a held request waits for a replica before its 503 with Retry-After."""

    def problems(self, replicas: int) -> list[str]:
        """What is wrong with these rules for a model declared with `replicas`."""
        out = []
        if self.max < 1:
            out.append("autoscale.max is 0: allow at least 1 replica")
        if self.min > self.max:
            out.append(f"autoscale.min ({self.min}) is above autoscale.max ({self.max})")
        if not self.min <= replicas <= max(self.max, self.min):
            out.append(
                f"replicas ({replicas}) is the count the model starts with: keep it within "
                f"autoscale.min..max ({self.min}..{self.max})"
            )
        targets = (self.waiting_per_replica, self.running_per_replica, self.kv_usage,
                   self.ttft_p90_s, self.itl_p90_s)  # fmt: skip
        if not any(targets):
            out.append(
                "autoscale has no signal: set one or more of waiting_per_replica, "
                "running_per_replica, kv_usage, ttft_p90_s, itl_p90_s"
            )
        if self.kv_usage > 1:
            out.append(f"autoscale.kv_usage is {self.kv_usage}: a fraction, 0 to 1")
        return out


class Signals(msgspec.Struct, frozen=True, kw_only=True):
    """One model's load, aggregated over the routers' latest reports."""

    serving: Count = 0
    """Endpoints of the model the routers reported."""
    waiting: Amount = 0.0
    """Requests routers hold for an endpoint plus those queued in the engines."""
    running: Amount = 0.0
    kv_usage: Amount = 0.0
    ttft_p90_s: Amount = 0.0
    itl_p90_s: Amount = 0.0
    requests: Annotated[int, msgspec.Meta(ge=0, le=MAX_REQUESTS)] = 0
    """Requests the routers received in their last window (a busy model's exceed
    `MAX_REPLICAS`)."""
    routers: Count = 0


class Observation(msgspec.Struct, frozen=True, kw_only=True):
    """What a scaling decision was made on: recorded in the log beside it."""

    signals: Signals
    recommended: Count
    """The count `recommend` gave for these signals."""
    up_floor: Count
    """The lowest recommendation over the up window (this one included)."""
    down_ceiling: Count
    """The highest recommendation over the down window (this one included)."""
    startup_s: Amount = 0.0
    """The model's measured start-up time, which lowered the targets aimed at."""
    short_of: Name = ""
    """A model of higher priority that could not be placed: this one gives up a replica."""
    short_priority: Annotated[int, msgspec.Meta(ge=-1000, le=1000)] = 0
    slo_floor: Count = 0
    """The fewest replicas the latency SLO allows at this load: one more than a count that
    broke it at as many running requests or more, lately (`Recommendations.slo_floor`)."""
    settled: bool = True
    """Every replica of the current count served for a whole latency window: only then do
    the routers' p90s speak for this count (before, they still hold the queue of the last)."""


def headroom(startup_s: float) -> float:
    """The fraction of its targets a model aims at, for its start-up time."""
    return 1.0 - min(0.5, max(startup_s, 0.0) / STARTUP_HORIZON_S)


def _ratio_count(current: int, value: float, target: float) -> int:
    """The count that puts a per-replica `value` (at `current`) at `target`."""
    ratio = value / target
    if abs(ratio - 1.0) <= TOLERANCE:
        return current
    return math.ceil(round(current * ratio, 6))


def recommend(
    spec: Autoscale, current: int, s: Signals, startup_s: float, settled: bool = True
) -> tuple[int, str]:
    """The replica count at which every signal would meet its target, and which signal
    asked for the most (a reason for the log). Unclamped: `decide` bounds it.

    Running requests and KV usage grow with the load, so they say how many replicas it
    needs (as Kubernetes' HPA does with utilisation). Waiting requests and latency only
    say that more are needed: under their targets they show that the current count
    suffices, not that fewer would. So they ask for more above their targets, and below
    them hold the count while there is traffic unless a signal of the first kind is set,
    which then decides how far to scale in. Any traffic keeps one replica. Latency counts
    only once the count is `settled`."""
    h = headroom(startup_s)
    base = max(current, 1)
    busy = bool(s.requests or s.waiting)
    sized = bool(spec.running_per_replica or spec.kv_usage)
    hold = [] if sized or not busy else [(current, "")]
    wants: list[tuple[int, str]] = []
    if spec.running_per_replica:
        t = spec.running_per_replica * h
        wants.append((math.ceil(round(s.running / t, 6)),
                      f"{s.running:g} running, target {t:.3g} per replica"))  # fmt: skip
    if spec.kv_usage and s.serving:
        t = spec.kv_usage * h
        wants.append((_ratio_count(base, s.kv_usage, t),
                      f"KV cache {s.kv_usage:.0%} used, target {t:.0%}"))  # fmt: skip
    if spec.waiting_per_replica:
        t = spec.waiting_per_replica * h
        why = f"{s.waiting:g} waiting, target {t:.3g} per replica"
        if s.waiting > t * base * (1 + TOLERANCE):
            wants.append((max(math.ceil(round(s.waiting / t, 6)), current + 1), why))
        else:
            wants += [(n, why) for n, _ in hold]
    for name, value, slo in (("TTFT", s.ttft_p90_s, spec.ttft_p90_s),
                             ("ITL", s.itl_p90_s, spec.itl_p90_s)):  # fmt: skip
        if not slo or not settled:
            continue
        t = slo * h
        if value > t * (1 + TOLERANCE):
            why = f"{name} p90 {value * 1000:.0f} ms over its SLO {t * 1000:.0f} ms"
            wants.append((max(_ratio_count(base, value, t), current + 1), why))
        elif value > t * 0.8:
            wants.append((current, f"{name} p90 {value * 1000:.0f} ms near its SLO"))
        else:
            wants += [(n, f"{name} p90 {value * 1000:.0f} ms within its SLO") for n, _ in hold]
    if busy:
        wants.append((1, f"{s.requests} requests, {s.waiting:g} waiting"))
    best = max(wants, key=lambda w: w[0], default=(0, ""))
    # Capped: a router's figures can ask for any count, and `Observation.recommended` is
    # bounded (`decide` clamps to `max` anyway, which is within it).
    return (min(best[0], MAX_REPLICAS), best[1]) if best[0] > 0 else (0, "idle: no requests")


def latency_broken(spec: Autoscale, s: Signals, startup_s: float) -> bool:
    """True when a latency signal is over its SLO (as `recommend` aims at it)."""
    h = headroom(startup_s)
    return any(
        slo and value > slo * h * (1 + TOLERANCE)
        for value, slo in ((s.ttft_p90_s, spec.ttft_p90_s), (s.itl_p90_s, spec.itl_p90_s))
    )


def floored(count: int, reason: str, slo_floor: int) -> tuple[int, str]:
    """`recommend`'s count raised to the latency SLO's floor, with the reason why."""
    if slo_floor > count:
        return slo_floor, f"{slo_floor - 1} replicas broke the latency SLO at this load"
    return count, reason


def decide(spec: Autoscale, current: int, obs: Observation, reason: str) -> tuple[int, str] | None:
    """The count to scale to and why, or None to stay. `reason` is `recommend`'s."""
    lo, hi = spec.min, max(spec.max, spec.min)
    if obs.short_of:
        if current <= lo:
            return None
        return current - 1, (
            f"preempted: {obs.short_of} (priority {obs.short_priority}) cannot be placed and "
            f"outranks this model (priority {spec.priority})"
        )
    if current < lo:
        return lo, f"below autoscale.min {lo}"
    if current > hi:
        return hi, f"above autoscale.max {hi}"
    if current == 0 and obs.recommended > 0:
        # From zero no window applies: a request is already waiting for it.
        return min(obs.recommended, spec.max_step, hi), f"from zero: {reason}"
    if obs.up_floor > current:
        to = min(obs.up_floor, current + spec.max_step, hi)
        return (to, f"out: {reason}") if to > current else None
    if obs.down_ceiling < current:
        to = max(obs.down_ceiling, current - spec.max_step, lo)
        if to < current:
            window = f"for {spec.down_window_s:g} s"
            return to, f"in: at most {obs.down_ceiling} needed {window}; now {reason}"
    return None


class Recommendations:
    """One model's recent recommendations, for its stabilization windows (the leader's
    memory: a new leader starts them afresh, and waits a window before scaling in)."""

    def __init__(self, started: float) -> None:
        self.started = started
        self._recent: deque[tuple[float, int]] = deque()
        self._broke: deque[tuple[float, int, float]] = deque(maxlen=64)
        """(when, replicas, running requests) at which the latency SLO was broken."""

    def shift(self, step_s: float) -> None:
        """The clock's reading was corrected by `step_s`: so are the times kept here."""
        self.started += step_s
        self._recent = deque((t + step_s, c) for t, c in self._recent)
        self._broke = deque(((t + step_s, n, r) for t, n, r in self._broke), maxlen=64)

    def broke(self, now: float, count: int, running: float) -> None:
        """`count` replicas missed the latency SLO with `running` requests."""
        self._broke.append((now, count, running))

    def slo_floor(self, now: float, running: float) -> int:
        """One more than the largest count that broke the SLO, lately, at no more load than
        now: running and sizing signals may say fewer suffice, latency showed they do not.
        (Without it, a model sized on running requests at its engines' saturation scales
        in, misses its SLO, scales out, and so on, once a down window.)"""
        return min(MAX_REPLICAS, max((n + 1 for t, n, r in self._broke
                                      if now - t <= SLO_MEMORY_S
                                      and running >= r * (1 - TOLERANCE)),
                                     default=0))  # fmt: skip

    def add(self, now: float, count: int, keep_s: float) -> None:
        self._recent.append((now, count))
        while self._recent and self._recent[0][0] < now - keep_s:
            self._recent.popleft()

    def floor(self, now: float, window_s: float) -> int:
        """The lowest recommendation within `window_s` (the newest one included)."""
        return min(c for t, c in self._recent if t >= now - window_s or t == self._recent[-1][0])

    def ceiling(self, now: float, window_s: float, current: int) -> int:
        """The highest within `window_s`; `current` until a whole window has been seen, so
        a leader that just started does not scale in on a moment's view."""
        top = max(c for t, c in self._recent if t >= now - window_s or t == self._recent[-1][0])
        return top if now - self.started >= window_s else max(top, current)


def observe(
    spec: Autoscale,
    current: int,
    signals: Signals,
    history: Recommendations,
    now: float,
    *,
    startup_s: float = 0.0,
    settled: bool = True,
) -> tuple[Observation, str]:
    """Record this moment's recommendation in `history` and return the observation a
    decision is made on, with `recommend`'s reason."""
    count, reason = recommend(spec, current, signals, startup_s, settled)
    broken = settled and latency_broken(spec, signals, startup_s)
    if current > 0 and signals.running > 0 and broken:
        history.broke(now, current, signals.running)
    floor = history.slo_floor(now, signals.running)
    count, reason = floored(count, reason, floor)
    history.add(now, count, max(spec.up_window_s, spec.down_window_s))
    obs = Observation(
        signals=signals,
        recommended=count,
        up_floor=history.floor(now, spec.up_window_s),
        down_ceiling=history.ceiling(now, spec.down_window_s, current),
        startup_s=round(startup_s, 3),
        slo_floor=floor,
        settled=settled,
    )
    return obs, reason


def verify_decision(
    spec: Autoscale, current: int, obs: Observation
) -> tuple[int, str] | str | None:
    """`decide` again on a recorded observation, as a replay checks it; a string where the
    observation's own recommendation does not follow from its signals."""
    count, reason = recommend(spec, current, obs.signals, obs.startup_s, obs.settled)
    count, reason = floored(count, reason, obs.slo_floor)
    if not obs.short_of and count != obs.recommended:
        return f"its signals recommend {count} replicas, not the {obs.recommended} recorded"
    return decide(spec, current, obs, reason)


__all__ = [
    "Autoscale",
    "Observation",
    "Recommendations",
    "Signals",
    "decide",
    "headroom",
    "observe",
    "recommend",
    "verify_decision",
]

"""The fold's handlers for replica counts: autoscaling decisions, operators' pins, and
each model's measured start-up time (which the autoscaler allows for)."""

from __future__ import annotations

from llmgw.core import events
from llmgw.core.state.model import ClusterState, ModelState, ReplicaState
from llmgw.core.state.rules import Reject, check_epoch

STARTUP_WEIGHT = 0.3
"""Weight of each new start-up measurement in a model's moving average."""
MAX_STARTUP_S = 86_400.0


def target_replicas(model: ModelState) -> int:
    """How many replicas the planner keeps of `model`: its pin, else its autoscaler's count
    within autoscale.min..max, else `replicas`."""
    p = model.profile
    scale = p.autoscale
    if scale is None:
        return p.replicas
    if model.pinned is not None:
        return model.pinned
    n = model.desired if model.desired is not None else p.replicas
    return min(max(n, scale.min), max(scale.max, scale.min))


def _autoscaled(state: ClusterState, name: str, what: str) -> ModelState:
    model = state.models.get(name)
    if model is None:
        raise Reject(f"{what}: model {name!r} is not declared")
    if model.profile.autoscale is None:
        raise Reject(
            f"{what}: model {name!r} has no autoscale section: change its replicas instead"
        )
    return model


def on_scale_decided(state: ClusterState, ev: events.ScaleDecided, seq: int, at: float) -> None:
    check_epoch(state, ev)
    model = _autoscaled(state, ev.model, "scale decision")
    if model.pinned is not None:
        raise Reject(f"scale decision for {ev.model!r}: pinned at {model.pinned} by an operator")
    now = target_replicas(model)
    if ev.from_replicas != now:
        raise Reject(
            f"scale decision for {ev.model!r} from {ev.from_replicas} replicas, but it has {now}"
        )
    model.desired = ev.to_replicas
    model.scaled_ts = float(ev.ts)


def on_scale_pinned(state: ClusterState, ev: events.ScalePinned, seq: int, at: float) -> None:
    model = _autoscaled(state, ev.model, "pin")
    scale = model.profile.autoscale
    assert scale is not None
    if ev.replicas > max(scale.max, scale.min):
        raise Reject(
            f"pin of {ev.model!r} at {ev.replicas}: above its autoscale.max {scale.max}; "
            "raise the max first (llmgw ctl model change)"
        )
    model.pinned = ev.replicas
    model.pinned_by = ev.operator


def on_scale_released(state: ClusterState, ev: events.ScaleReleased, seq: int, at: float) -> None:
    model = _autoscaled(state, ev.model, "release")
    if model.pinned is None:
        return
    # The autoscaler goes on from where the pin held it.
    model.desired = model.pinned
    model.pinned = None
    model.pinned_by = ""
    model.scaled_ts = float(ev.ts)


def note_serving(state: ClusterState, replica: ReplicaState, ts: float) -> None:
    """A replica's last shard began serving: fold its start-up time into its model's."""
    model = state.models.get(replica.model)
    # A restarted generation would count its failure and backoff too: first starts only.
    first = replica.generation == 1 and not replica.retired
    if model is None or not first or not all(s.phase == "serving" for s in replica.shards):
        return
    took = min(max(ts - replica.placed_ts, 0.0), MAX_STARTUP_S)
    old = model.startup_s
    model.startup_s = round(took if old == 0 else old + STARTUP_WEIGHT * (took - old), 3)

"""Plan: from the durable state and the time alone, the decisions that move the fleet."""

from __future__ import annotations

from collections import defaultdict

from llmgw.core import events, placement
from llmgw.core.profile import ModelProfile
from llmgw.core.reconcile.batch import Batch, IdFactory, Outcome, ReconcileConfig
from llmgw.core.reconcile.counting import Counts
from llmgw.core.reconcile.launch import launch_spec
from llmgw.core.refusals import Reason
from llmgw.core.state import (
    TERMINAL,
    ClusterState,
    ModelState,
    ReplicaState,
    ShardState,
    misplaced,
)
from llmgw.core.state.scaling import target_replicas

NODE_AHEAD_S = 60.0
"""How far after the leader's time a node may date a failure and have the restart backoff
count from it. A failure dated later (a node's clock that jumped ahead, or a lie: up to
the year 2514) held the restart back until then, the replica's healthy shards keeping
their GPUs; the backoff then counts from the generation's placement, the leader's own
time (so a crash loop still backs off)."""


def backoff(failures: int, config: ReconcileConfig) -> float:
    """Seconds to wait before restarting a replica that failed `failures` times in a row."""
    exponent = min(max(failures - 1, 0), 30)
    return float(min(config.restart_backoff_s * (2**exponent), config.restart_backoff_max_s))


def orphan_backoff(stops: int, config: ReconcileConfig) -> float:
    """Seconds after the last of `stops` StopShards for an orphan before the next one."""
    exponent = min(max(stops - 1, 0), 30)
    return float(min(config.orphan_stop_retry_s * (2**exponent), config.orphan_stop_retry_max_s))


def plan(
    state: ClusterState,
    now: float,
    *,
    epoch: int,
    basis_seq: int,
    config: ReconcileConfig,
    ids: IdFactory | None = None,
) -> Outcome:
    """Decisions from the durable state and `now` alone (reproducible by `verify`). Pure."""
    p = _Planner(state, now, epoch, basis_seq, config, ids)
    p.run()
    return Outcome(
        decisions=p.b.out, unplaceable=p.unplaceable, unplaceable_codes=p.unplaceable_codes
    )


def _priority(model: ModelState) -> int:
    scale = model.profile.autoscale
    return scale.priority if scale is not None else 0


def _fully_serving(replica: ReplicaState) -> bool:
    return all(s.phase == "serving" for s in replica.shards)


class _Planner:
    def __init__(
        self,
        state: ClusterState,
        now: float,
        epoch: int,
        basis_seq: int,
        config: ReconcileConfig,
        ids: IdFactory | None = None,
    ) -> None:
        self.state = state
        self.now = now
        self.cfg = config
        self.b = Batch(now, epoch, basis_seq, ids)
        self._capacity: placement.Capacity | None = None
        self._counts: Counts | None = None
        self.retired_now: set[str] = set()
        self.placed_now: list[tuple[str, str, str]] = []
        """(model, replica id, replaces) placed in this pass."""
        self.to_replace: dict[str, list[str]] = defaultdict(list)
        """Model -> replicas retired this pass that a new replica should name as replaced."""
        self.unplaceable: dict[str, str] = {}
        self.unplaceable_codes: dict[str, Reason] = {}
        self.downed: set[str] = set()
        self.touched: set[str] = set()
        """Replicas a rule already acted on this pass: no second rule acts on them."""
        self.replacement_of: dict[str, ReplicaState] = {
            r.replaces: r for r in state.replicas.values() if r.replaces and not r.retired
        }

    @property
    def capacity(self) -> placement.Capacity:
        if self._capacity is None:
            self._capacity = placement.Capacity(self.state)
        return self._capacity

    def run(self) -> None:
        state = self.state
        for rid in sorted(state.replicas):
            replica = state.replicas[rid]
            if replica.retired:
                self._finish_retired(replica)
            else:
                self._active(replica)
        # Higher priority first: short of GPUs, it takes them before a lower one can.
        for name in sorted(state.models, key=lambda m: (-_priority(state.models[m]), m)):
            self._count(name)
        for name in sorted(state.nodes):
            node = state.nodes[name]
            if node.liveness == "lost":
                continue
            for orphan in node.orphans:
                # Once, then again only after a growing wait: an agent that does not
                # stop it must not get a StopShard on every pass. (A snapshot written
                # before stops were counted says only `stop_sent`: one stop so far.)
                stops = orphan.stops or (1 if orphan.stop_sent else 0)
                if stops and self.now < orphan.stop_sent_at + orphan_backoff(stops, self.cfg):
                    continue
                self.b.add(
                    events.StopShard,
                    node=name,
                    replica_id=orphan.replica_id,
                    generation=orphan.generation,
                    shard=orphan.shard,
                    grace_s=self.cfg.stop_grace_s,
                    reason="not a replica the control plane placed"
                    if orphan.replica_id not in state.replicas
                    else f"generation {orphan.generation} is not the replica's current one",
                )

    # --- one replica

    def _active(self, r: ReplicaState) -> None:
        state = self.state
        model = state.models.get(r.model)
        if model is None:
            self._retire(r, f"model {r.model} was removed", graceful=True)
            return
        lost = sorted(
            {s.node for s in r.shards if state.nodes[s.node].liveness == "lost" and not s.released}
        )
        if lost:
            self._retire(r, f"node {', '.join(lost)} lost", graceful=False, replace=True)
            return
        broken = [
            s for s in r.shards if s.phase == "failed" or (s.phase == "stopped" and not s.stop_sent)
        ]
        if broken:
            self._broken(r, broken, model.profile)
            return
        if self._moving(r, model.revision, model.changed_ts):
            return
        if self._never_started_surplus(r, target_replicas(model)):
            return
        before = len(self.b.out)
        for shard in r.shards:
            if shard.phase == "placed" and not shard.started and not shard.stop_sent:
                self._start(r.id, r.generation, shard.shard, r, model.profile)
        self._endpoint(r)
        if len(self.b.out) > before:
            self.touched.add(r.id)

    def _never_started_surplus(self, r: ReplicaState, wanted: int) -> bool:
        """Retire `r` if none of its shards was ever started and its model has more
        replicas than it wants (a leader died between placing it and starting it, and the
        model shrank since): it costs nothing to give up, where the surplus pass would
        retire a serving replica instead, since this pass has started this one."""
        if not all(s.phase == "placed" and not s.started and not s.stop_sent for s in r.shards):
            return False
        if self.counts.count(r.model) <= wanted:
            return False
        self._retire(r, f"surplus, never started: {r.model} wants {wanted}", graceful=True)
        return True

    def _endpoint(self, r: ReplicaState) -> None:
        up = r.id in self.state.endpoints
        if _fully_serving(r):
            if not up:
                head = r.shards[0]
                node = self.state.nodes[head.node]
                url = head.endpoint or f"http://{node.address}:{head.port}"
                self.b.add(
                    events.EndpointUp,
                    replica_id=r.id,
                    model=r.model,
                    url=url,
                    node=node.name,
                    api_key=head.api_key,
                )
        elif up:
            phases = ", ".join(sorted({s.phase for s in r.shards}))
            self._endpoint_down(r, f"shards are {phases}")

    def _endpoint_down(self, r: ReplicaState, reason: str) -> None:
        ep = self.state.endpoints.get(r.id)
        if ep is not None and r.id not in self.downed:
            self.downed.add(r.id)
            self.b.add(
                events.EndpointDown, replica_id=r.id, model=r.model, url=ep.url, reason=reason
            )

    def _broken(self, r: ReplicaState, broken: list[ShardState], profile: ModelProfile) -> None:
        """A shard failed or exited: restart in place after a backoff, or give the slot up."""
        state = self.state
        self._endpoint_down(r, f"shard {broken[0].shard} {broken[0].phase}: {broken[0].error}")
        self.touched.add(r.id)
        nodes = [state.nodes[s.node] for s in r.shards]
        if any(n.liveness == "unreachable" for n in nodes):
            return  # its agent cannot hear a restart; lost or recovered decides
        model = state.models[r.model]
        wanted = target_replicas(model)
        if self.counts.count(r.model) > wanted:
            self._retire(r, f"failed, and surplus: {r.model} wants {wanted}", graceful=False)
            return
        if r.revision < model.revision:
            self._retire(
                r,
                f"failed, and model {r.model} changed: placing it anew",
                graceful=False,
                replace=True,
            )
            return
        unhealthy = [
            f"GPU {g} of {s.node} unhealthy"
            for s in r.shards
            for g in s.gpus
            if g in state.nodes[s.node].gpus and not state.nodes[s.node].gpus[g].healthy
        ]
        unhealthy += [m for s in r.shards if (m := misplaced(state.nodes[s.node], r, s))]
        leaving = [n.name for n in nodes if n.draining]
        if unhealthy or leaving:
            why = unhealthy[0] if unhealthy else f"node {leaving[0]} draining"
            self._retire(
                r, f"failed, and {why}: placing it elsewhere", graceful=False, replace=True
            )
            return
        since = max([r.failed_ts, *(s.since for s in broken)])
        if since > self.now + NODE_AHEAD_S:
            since = r.placed_ts
        if self.now < since + backoff(r.failures, self.cfg):
            return
        for s in r.shards:
            if s.phase not in TERMINAL and not s.stop_sent:
                self._stop(r, s, "restarting the replica")
        generation = r.generation + 1
        cause = broken[0].error or broken[0].phase
        self.b.add(
            events.ReplicaPlaced,
            replica_id=r.id,
            model=r.model,
            generation=generation,
            shards=tuple(
                events.ShardAssignment(shard=s.shard, node=s.node, gpus=s.gpus, port=s.port)
                for s in r.shards
            ),
            fabric=r.fabric,
            reason=f"restart after {max(r.failures, 1)} failure(s): {cause}",
        )
        for s in r.shards:
            self._start(r.id, generation, s.shard, r, profile)

    def _moving(self, r: ReplicaState, revision: int, changed_ts: float) -> bool:
        """Rolling move off a draining node or to a changed model; True once retired."""
        state = self.state
        draining = [state.nodes[s.node] for s in r.shards if state.nodes[s.node].draining]
        outdated = r.revision < revision
        if not draining and not outdated:
            return False
        if draining:
            deadline = min(n.drain_since + n.drain_grace_s for n in draining)
            why = f"node {draining[0].name} draining"
        else:
            deadline = changed_ts + self.cfg.change_grace_s
            why = f"model {r.model} changed"
        replacement = self.replacement_of.get(r.id)
        wanted = target_replicas(state.models[r.model])
        if replacement is None and self.counts.count(r.model) > wanted:
            # Surplus anyway: replacing it would only make another surplus replica.
            self._retire(r, f"{why}; surplus: {r.model} wants {wanted}", graceful=True)
            return True
        if replacement is None and self.now < deadline:
            placed = self._place(r.model, replaces=r.id, reason=f"replaces {r.id}: {why}")
            if placed:
                return False  # the original serves on until its replacement does
        # Its replacement serves once its EndpointUp is in the log, not merely when its
        # shards say serving: the original's EndpointDown then follows it in the log, so
        # a router never folds the one without the other and finds no endpoint between.
        ready = replacement is not None and replacement.id in state.endpoints
        if ready or self.now >= deadline:
            detail = "its replacement serves" if ready else "the drain grace period ended"
            self._retire(r, f"{why}; {detail}", graceful=True)
            return True
        return False

    def _retire(
        self, r: ReplicaState, reason: str, *, graceful: bool, replace: bool = False
    ) -> None:
        state = self.state
        self._endpoint_down(r, reason)
        self.b.add(events.ReplicaRetired, replica_id=r.id, reason=reason)
        self.retired_now.add(r.id)
        if self._counts is not None:
            self._counts.retired(r.id)
        self.touched.add(r.id)
        if replace:
            self.to_replace[r.model].append(r.id)
        drain = graceful and _fully_serving(r)
        for s in r.shards:
            if s.released or s.phase in TERMINAL or s.stop_sent:
                continue
            if s.phase == "placed" and not s.started:
                continue  # never started: nothing to stop (the fold frees it)
            if state.nodes[s.node].liveness == "lost":
                continue
            if drain:
                self.b.add(
                    events.DrainShard,
                    node=s.node,
                    replica_id=r.id,
                    generation=r.generation,
                    shard=s.shard,
                    grace_s=self.cfg.shard_drain_s,
                )
            else:
                self._stop(r, s, reason)

    def _finish_retired(self, r: ReplicaState) -> None:
        """A retired replica's leftovers: endpoint still up, shards whose drain window ended."""
        self._endpoint_down(r, f"retired: {r.retired_reason}")
        for s in r.shards:
            if s.released or s.phase in TERMINAL or s.stop_sent:
                continue
            if self.state.nodes[s.node].liveness == "lost":
                continue
            if s.phase == "placed" and not s.started:
                continue
            if s.drain_sent_at is None or self.now >= s.drain_sent_at + self.cfg.shard_drain_s:
                self._stop(r, s, f"retired: {r.retired_reason}")

    def _stop(self, r: ReplicaState, s: ShardState, reason: str) -> None:
        self.b.add(
            events.StopShard,
            node=s.node,
            replica_id=r.id,
            generation=r.generation,
            shard=s.shard,
            grace_s=self.cfg.stop_grace_s,
            reason=reason,
        )

    # --- counts per model

    @property
    def counts(self) -> Counts:
        """Replicas that count toward each model's wanted number: active, not being
        replaced. Every replica placed in this pass counts, replacements too: the original
        a replacement stands for is no longer counted, so leaving it out as well would
        make the count place one more replica per drained one (retired as surplus on the
        next pass, a model load thrown away). Built on first use, from the pass so far."""
        if self._counts is None:
            self._counts = Counts(self.state)
            for rid in self.retired_now:
                self._counts.retired(rid)
            for model, rid, replaces in self.placed_now:
                self._counts.placed(model, rid, replaces)
        return self._counts

    def _count(self, name: str) -> None:
        state = self.state
        profile = state.models[name].profile
        wanted = target_replicas(state.models[name])
        missing = wanted - self.counts.count(name)
        if missing > 0:
            queue = self.to_replace.get(name, [])
            results = placement.place_many(
                state, profile, missing, capacity=self.capacity, sentences=False
            )
            for i, result in enumerate(results):
                if isinstance(result, placement.Unplaceable):
                    self.unplaceable[name] = result.reason
                    self.unplaceable_codes[name] = result.code
                    break
                replaces_id = queue[i] if i < len(queue) else ""
                why = f"replaces {replaces_id}" if replaces_id else f"{name} wants {wanted}"
                self._emit_placement(profile, result, replaces_id, why)
        elif missing < 0:
            existing = [
                state.replicas[rid]
                for rid in self.counts.ids(name)
                if rid in state.replicas and rid not in self.touched
            ]
            # Retire what serves least first, the newest first among equals.
            existing.sort(key=lambda r: (_fully_serving(r), -r.placed_seq, r.id))
            for r in existing[:-missing]:
                self._retire(r, f"surplus: {name} wants {wanted}", graceful=True)

    def _place(self, model: str, *, replaces: str, reason: str) -> bool:
        profile = self.state.models[model].profile
        result = placement.place(self.state, profile, self.now, capacity=self.capacity)
        if isinstance(result, placement.Unplaceable):
            self.unplaceable[model] = result.reason
            self.unplaceable_codes[model] = result.code
            return False
        # (place() has reserved it in this pass's capacity: reserved again, the model's
        # count on that node doubled, and later placements of the pass shunned the node.)
        self._emit_placement(profile, result, replaces, reason)
        return True

    def _emit_placement(
        self, profile: ModelProfile, where: placement.Placement, replaces: str, reason: str
    ) -> None:
        rid = f"r{self.b.next_id()}"
        self.b.add(
            events.ReplicaPlaced,
            replica_id=rid,
            model=profile.name,
            generation=1,
            shards=where.shards,
            replaces=replaces,
            reason=reason,
            fabric=where.fabric,
        )
        self.placed_now.append((profile.name, rid, replaces))
        if self._counts is not None:
            self._counts.placed(profile.name, rid, replaces)
        for sa in where.shards:
            self._start_assignment(rid, 1, sa, where.shards, where.fabric, where.gpu_class, profile)

    def _start(
        self, rid: str, generation: int, shard: int, r: ReplicaState, profile: ModelProfile
    ) -> None:
        layout = tuple(
            events.ShardAssignment(shard=s.shard, node=s.node, gpus=s.gpus, port=s.port)
            for s in r.shards
        )
        self._start_assignment(
            rid, generation, layout[shard], layout, r.fabric, r.gpu_class, profile
        )

    def _start_assignment(
        self,
        rid: str,
        generation: int,
        sa: events.ShardAssignment,
        layout: tuple[events.ShardAssignment, ...],
        fabric: str,
        gpu_class: str,
        profile: ModelProfile,
    ) -> None:
        spec = launch_spec(self.state, profile, sa, layout, fabric=fabric, gpu_class=gpu_class)
        self.b.add(
            events.StartShard,
            node=sa.node,
            replica_id=rid,
            generation=generation,
            shard=sa.shard,
            launch=spec,
        )

"""Cordon, uncordon and drain: what they will do, and how far a drain has come.

`drain_plan(state, node, now)` answers "what will move and where" before the
drain is requested: it marks the node draining in a copy of the state and asks
placement (the same `llmgw.core.placement` the reconciler uses, with one Capacity
so that two moves never take the same GPU) where each active replica on the node
would land. `drain_progress(state, node, originals, now)` is what `drain --wait`
prints while it follows the log: which originals stopped, which replacements
serve, and whether the grace period is over.

Purely computational (the caller folds the log and publishes).
"""

from __future__ import annotations

import msgspec

from llmgw.core import placement, state
from llmgw.ctl.errors import BadInput
from llmgw.ctl.eventlines import clean


class Move(msgspec.Struct, frozen=True, kw_only=True):
    replica: str
    model: str
    gpus: str
    """Where it runs now (`node:gpus` per shard)."""
    to: str = ""
    """Where a replacement would land (`node:gpus` per shard); empty when it cannot."""
    why_not: str = ""

    def render(self) -> str:
        """One line, escaped: the nodes' names are theirs, and why a replica has nowhere
        to go quotes what they reported (GPU classes, fabrics)."""
        if self.to:
            return clean(f"  {self.replica} ({self.model}) {self.gpus} -> {self.to}")
        return clean(f"  {self.replica} ({self.model}) {self.gpus} -> nowhere: {self.why_not}")


def _where(shards: tuple[tuple[str, tuple[int, ...]], ...]) -> str:
    return " ".join(f"{node}:{','.join(str(g) for g in gpus)}" for node, gpus in shards)


def replicas_on(st: state.ClusterState, node: str) -> list[state.ReplicaState]:
    """Active replicas with a shard on `node`, by id."""
    return [
        r
        for _, r in sorted(st.replicas.items())
        if not r.retired and any(s.node == node and not s.released for s in r.shards)
    ]


def drain_plan(st: state.ClusterState, node: str, now: float) -> list[Move]:
    """Where each replica on `node` would move if it drained now. Pure; `st` is not changed."""
    what_if = state.decode_snapshot(state.encode_snapshot(st))
    what_if.nodes[node].draining = True
    capacity = placement.Capacity(what_if)
    moves: list[Move] = []
    for r in replicas_on(what_if, node):
        here = _where(tuple((s.node, s.gpus) for s in r.shards))
        model = what_if.models.get(r.model)
        if model is None:
            moves.append(
                Move(
                    replica=r.id,
                    model=r.model,
                    gpus=here,
                    why_not=f"model {r.model} is no longer declared: it is stopped, not moved",
                )
            )
            continue
        # Reserved in `capacity` as it is chosen (placement.place_many), as in a pass.
        result = placement.place(what_if, model.profile, now, capacity=capacity)
        if isinstance(result, placement.Unplaceable):
            moves.append(Move(replica=r.id, model=r.model, gpus=here, why_not=result.reason))
            continue
        to = _where(tuple((s.node, s.gpus) for s in result.shards))
        moves.append(Move(replica=r.id, model=r.model, gpus=here, to=to))
    return moves


class DrainProgress(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    total: int
    stopped: int
    """Originals whose shards on the node no longer run."""
    replaced: int
    """Originals with a replacement that serves."""
    grace_over: bool
    done: bool
    lines: tuple[str, ...] = ()
    """One per original, escaped: they name the nodes its replacement runs on."""

    def render(self) -> str:
        return clean(
            f"draining {self.node}: {self.stopped}/{self.total} stopped, "
            f"{self.replaced}/{self.total} replaced and serving"
            + ("; grace period over" if self.grace_over else "")
        )


def drain_progress(
    st: state.ClusterState, node: str, originals: list[str], now: float
) -> DrainProgress:
    """How far the drain of `node` has come for the replicas it had when it began. Pure."""
    n = st.nodes.get(node)
    grace_over = bool(n is not None and n.draining and now >= n.drain_since + n.drain_grace_s)
    stopped = replaced = 0
    lines: list[str] = []
    for rid in originals:
        r = st.replicas.get(rid)
        model = r.model if r is not None else ""
        gone = r is None or all(
            s.released or s.phase in state.TERMINAL for s in r.shards if s.node == node
        )
        successors = [x for x in st.replicas.values() if x.replaces == rid and not x.retired]
        serving = [x for x in successors if x.id in st.endpoints]
        # A replica whose model was removed is stopped, never replaced: nothing to wait for.
        unwanted = r is not None and model not in st.models
        stopped += gone
        replaced += bool(serving) or unwanted
        if serving:
            lines.append(
                f"{rid}: replaced by {serving[0].id} on "
                f"{', '.join(s.node for s in serving[0].shards)} (serving)"
            )
        elif successors:
            phases = "/".join(sorted({s.phase for s in successors[0].shards}))
            lines.append(f"{rid}: replacement {successors[0].id} {phases}")
        elif unwanted:
            lines.append(f"{rid}: model {model} removed, not replaced")
        else:
            lines.append(f"{rid}: {'stopped' if gone else 'waiting for a replacement'}")
    total = len(originals)
    done = stopped == total and (replaced == total or grace_over)
    return DrainProgress(
        node=node,
        total=total,
        stopped=stopped,
        replaced=replaced,
        grace_over=grace_over,
        done=done,
        lines=tuple(clean(line) for line in lines),
    )


def require_node(st: state.ClusterState, node: str) -> None:
    """BadInput naming the known nodes unless `node` is registered."""
    if node not in st.nodes:
        known = ", ".join(clean(n) for n in sorted(st.nodes)[:8]) or "none registered yet"
        raise BadInput(f"unknown node {node!r} (known: {known}): see `llmgw ctl nodes`")

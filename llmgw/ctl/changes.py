"""What changed between two points of the log: `llmgw ctl replay --diff A B`.

Compares two folded states, durable part only (heartbeat ages are not history):
nodes' lifecycle, operator flags and GPU health, replicas and their shards,
models, endpoints, and the leader. Each difference is one `Change`, ordered by
scope and key, so a diff across a drain lists exactly what the drain did.

Purely computational.
"""

from __future__ import annotations

from typing import Any

import msgspec

from llmgw.core import state
from llmgw.core.state.scaling import target_replicas
from llmgw.ctl.eventlines import clean


class Change(msgspec.Struct, frozen=True, kw_only=True):
    scope: str
    """node, replica, shard, model, endpoint or cluster."""
    key: str
    field: str
    """A field name, or `added` / `removed`."""
    before: Any = None
    after: Any = None

    def render(self) -> str:
        """One line, escaped: an added node's address or endpoint's URL is the node's own
        text, and a newline in it would add a change of the writer's choosing."""
        return clean(self._render())

    def _render(self) -> str:
        if self.field == "added":
            return f"+ {self.scope} {self.key}" + (f"  {self.after}" if self.after else "")
        if self.field == "removed":
            return f"- {self.scope} {self.key}" + (f"  {self.before}" if self.before else "")
        return (
            f"~ {self.scope} {self.key}: {self.field} {_show(self.before)} -> {_show(self.after)}"
        )


def _show(value: Any) -> str:
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


_NODE_FIELDS = (
    "address",
    "liveness",
    "cordoned",
    "cordon_reason",
    "draining",
    "drain_grace_s",
    "agent_version",
)
_REPLICA_FIELDS = ("model", "generation", "revision", "retired", "retired_reason", "failures")
_SHARD_FIELDS = ("node", "gpus", "port", "phase", "endpoint", "error")


def _fields(
    out: list[Change], scope: str, key: str, a: Any, b: Any, names: tuple[str, ...]
) -> None:
    for name in names:
        before, after = getattr(a, name), getattr(b, name)
        if isinstance(before, tuple):
            before, after = list(before), list(after)
        if before != after:
            out.append(Change(scope=scope, key=key, field=name, before=before, after=after))


def _gpu_health(node: state.NodeState) -> dict[int, list[str]]:
    return {i: list(g.health_problems) for i, g in node.gpus.items() if g.health_problems}


def _summary(r: state.ReplicaState) -> str:
    where = ", ".join(f"{s.node}:{','.join(map(str, s.gpus))}" for s in r.shards)
    text = f"model {r.model} on {where}"
    return text + (f" (replaces {r.replaces})" if r.replaces else "")


def diff(a: state.ClusterState, b: state.ClusterState) -> list[Change]:
    """Every difference from state `a` to state `b`. Purely computational."""
    out: list[Change] = []
    for part in (_nodes, _replicas, _models, _endpoints, _leader):
        part(out, a, b)
    return out


def _nodes(out: list[Change], a: state.ClusterState, b: state.ClusterState) -> None:
    """Nodes added or removed, and each one's fields, GPU health and GPUs."""
    for name in sorted(set(a.nodes) | set(b.nodes)):
        na, nb = a.nodes.get(name), b.nodes.get(name)
        if na is None or nb is None:
            present = nb or na
            assert present is not None
            info = f"{len(present.gpus)} GPUs at {present.address}"
            field = "added" if na is None else "removed"
            out.append(
                Change(
                    scope="node",
                    key=name,
                    field=field,
                    before=None if na is None else info,
                    after=None if nb is None else info,
                )
            )
            continue
        _fields(out, "node", name, na, nb, _NODE_FIELDS)
        ha, hb = _gpu_health(na), _gpu_health(nb)
        if ha != hb:
            out.append(Change(scope="node", key=name, field="unhealthy_gpus", before=ha, after=hb))
        if sorted(na.gpus) != sorted(nb.gpus):
            out.append(
                Change(
                    scope="node",
                    key=name,
                    field="gpus",
                    before=sorted(na.gpus),
                    after=sorted(nb.gpus),
                )
            )


def _replicas(out: list[Change], a: state.ClusterState, b: state.ClusterState) -> None:
    """Replicas added or removed, and each one's fields and shards."""
    for rid in sorted(set(a.replicas) | set(b.replicas)):
        ra, rb = a.replicas.get(rid), b.replicas.get(rid)
        if ra is None and rb is not None:
            out.append(Change(scope="replica", key=rid, field="added", after=_summary(rb)))
            continue
        if rb is None and ra is not None:
            out.append(Change(scope="replica", key=rid, field="removed", before=_summary(ra)))
            continue
        assert ra is not None
        assert rb is not None
        _fields(out, "replica", rid, ra, rb, _REPLICA_FIELDS)
        for sa, sb in zip(ra.shards, rb.shards, strict=False):
            _fields(out, "shard", f"{rid}/{sa.shard}", sa, sb, _SHARD_FIELDS)


def _models(out: list[Change], a: state.ClusterState, b: state.ClusterState) -> None:
    """Models added or removed, and each one's revision and profile fields."""
    for name in sorted(set(a.models) | set(b.models)):
        ma, mb = a.models.get(name), b.models.get(name)
        if ma is None or mb is None:
            field = "added" if ma is None else "removed"
            model = mb or ma
            assert model is not None
            info = f"{target_replicas(model)} replicas, revision {model.revision}"
            out.append(
                Change(
                    scope="model",
                    key=name,
                    field=field,
                    before=None if ma is None else info,
                    after=None if mb is None else info,
                )
            )
            continue
        if ma.revision != mb.revision:
            out.append(
                Change(
                    scope="model", key=name, field="revision", before=ma.revision, after=mb.revision
                )
            )
        pa, pb = msgspec.to_builtins(ma.profile), msgspec.to_builtins(mb.profile)
        for fname in sorted(set(pa) | set(pb)):
            if pa.get(fname) != pb.get(fname):
                out.append(
                    Change(
                        scope="model",
                        key=name,
                        field=fname,
                        before=pa.get(fname),
                        after=pb.get(fname),
                    )
                )


def _endpoints(out: list[Change], a: state.ClusterState, b: state.ClusterState) -> None:
    """Endpoints added, removed or moved."""
    for rid in sorted(set(a.endpoints) | set(b.endpoints)):
        ea, eb = a.endpoints.get(rid), b.endpoints.get(rid)
        if ea == eb:
            continue
        if ea is None and eb is not None:
            out.append(Change(scope="endpoint", key=rid, field="added", after=eb.url))
        elif eb is None and ea is not None:
            out.append(Change(scope="endpoint", key=rid, field="removed", before=ea.url))
        else:
            assert ea is not None
            assert eb is not None
            out.append(Change(scope="endpoint", key=rid, field="url", before=ea.url, after=eb.url))


def _leader(out: list[Change], a: state.ClusterState, b: state.ClusterState) -> None:
    """The leader and its epoch."""
    if (a.epoch, a.leader) != (b.epoch, b.leader):
        out.append(
            Change(
                scope="cluster",
                key="leader",
                field="epoch",
                before=f"{a.leader or '-'} (epoch {a.epoch})",
                after=f"{b.leader or '-'} (epoch {b.epoch})",
            )
        )

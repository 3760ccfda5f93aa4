"""Placement: where a new replica of a model lands, or why it cannot.

The rules (docs/design.md):
- only nodes that are ready, not cordoned and not draining receive replicas;
- only healthy, free GPUs of the requested class (`Gpu.health_problems`), and
  one replica never mixes GPU classes;
- fp8 only on GPUs of compute capability 8.9 or newer;
- a tensor-parallel group stays inside one NVLink domain where one fits
  (a node where it fits beats a node where it would span PCIe);
- a multi-node replica uses nodes that share one RDMA fabric that lists HCAs;
- replicas of one model spread across nodes; ties break by free GPUs left
  (best fit, to keep whole nodes free for big models), then node name.

`place` is used by the reconciler, `explain` by the control service's management API and
`llmgw ctl explain`. A `Capacity` is built once per reconcile pass and updated as that
pass reserves GPUs, so several replicas placed in one pass never share a GPU or a port.

Purely computational: no I/O, no clock; `now` only words the reasons.
"""

from __future__ import annotations

import heapq
from collections import defaultdict

import msgspec

from llmgw.core import catalog, events
from llmgw.core.node_capacity import PORT_BASE as PORT_BASE
from llmgw.core.node_capacity import PORT_LIMIT as PORT_LIMIT
from llmgw.core.node_capacity import NodeCapacity
from llmgw.core.printable import escaped
from llmgw.core.profile import ModelProfile
from llmgw.core.refusals import (
    KnownRefusals,
    Refusals,
    class_sizes,
    quarantined,
    refusal,
    rejected_code,
    summary,
    too_few_nodes,
)
from llmgw.core.refusals import Reason as Reason
from llmgw.core.refusals import impossible as impossible
from llmgw.core.state import ClusterState, NodeState


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    shards: tuple[events.ShardAssignment, ...]
    gpu_class: str
    fabric: str = ""
    nvlink_fit: bool = True
    """Every shard's GPUs share one NVLink domain (or it is a single GPU)."""


class Unplaceable(msgspec.Struct, frozen=True, kw_only=True):
    reason: str
    """One line for logs, `llmgw ctl explain` and /v1/explain."""
    code: Reason = "other"
    """The reason as a stable code: the control plane's metrics label."""
    nodes: dict[str, str] = {}
    """Each candidate node and why it was rejected."""


class NodeVerdict(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    ok: bool
    reason: str


class Explanation(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    placement: Placement | None
    verdict: str
    nodes: tuple[NodeVerdict, ...]

    def render(self) -> str:
        """One line per node, each part escaped: reasons quote what nodes reported (their
        GPU classes, fabrics), and a newline there would add a candidate to the list."""
        lines = [escaped(f"model {self.model}: {self.verdict}")]
        width = max((len(escaped(v.node)) for v in self.nodes), default=4)
        for v in self.nodes:
            mark = "+" if v.ok else "-"
            lines.append(f"  {mark} {escaped(v.node).ljust(width)}  {escaped(v.reason)}")
        return "\n".join(lines)


# --------------------------------------------------------------------------- capacity


class Capacity:
    """What is free now, for one reconcile pass; `reserve` records this pass's placements."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self.nodes: dict[str, NodeCapacity] = {}
        self.rejected = Refusals()
        for name in sorted(state.nodes):
            node = state.nodes[name]
            why = _unusable(node) or quarantined(state, name)
            if why:
                self.rejected.add(name, rejected_code(state, node), why)
            else:
                self.nodes[name] = NodeCapacity(node)
        self.known = KnownRefusals(state, self.nodes, self.rejected.codes)
        # Replicas of each model per node, for spreading.
        self.spread: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for replica in state.replicas.values():
            if not replica.retired:
                for shard in replica.shards:
                    self.spread[replica.model][shard.node] += 1

    def reserve(self, model: str, placement: Placement) -> None:
        self.known.version += 1
        for sa in placement.shards:
            cap = self.nodes[sa.node]
            cap.take(placement.gpu_class, sa.gpus)
            cap.take_port(sa.port)
            self.spread[model][sa.node] += 1


def _unusable(node: NodeState, now: float | None = None) -> str:
    """Why a node gets nothing, whatever it offers; empty when it is usable. (The replay
    verification tests replace this function to alter a placement rule.)"""
    return refusal(node, now)[1]


# --------------------------------------------------------------------------- place


class _Candidate(msgspec.Struct, frozen=True, gc=False):
    key: tuple[bool, int, int, str, str]
    """Sort key: NVLink misfit, replicas of the model already there, GPUs left, name, class."""
    node: str
    gpu_class: str
    gpus: tuple[int, ...]
    fit: bool


def _candidates_on(
    node: NodeState, cap: NodeCapacity, profile: ModelProfile, spread: int
) -> list[_Candidate]:
    """The ways one node can host one shard of `profile` (one per GPU class), best first."""
    per_node = profile.gpus_per_replica // profile.nodes
    by_class = cap.by_class
    if profile.gpu_class:
        free = by_class.get(profile.gpu_class)
        if free is None or len(free) < per_node:
            return []  # the common rejection, kept cheap: most nodes of a busy fleet
        classes: list[str] = [profile.gpu_class]
    else:
        classes = sorted(by_class)
    if profile.nodes > 1 and not any(f.hcas for f in node.fabrics):
        return []
    if cap.port() is None:
        return []
    out: list[_Candidate] = []
    for cls in classes:
        free = by_class.get(cls)
        if not free or len(free) < per_node:
            continue
        if profile.dtype == "fp8" and not catalog.fp8_capable(
            node.gpus[free[0]].compute_capability
        ):
            continue
        picked = cap.pick(cls, per_node)
        if picked is None:
            continue
        gpus, fit = picked
        key = (not fit, spread, len(free) - per_node, node.name, cls)
        out.append(_Candidate(key, node.name, cls, gpus, fit))
    return out


def _all_candidates(
    state: ClusterState, capacity: Capacity, profile: ModelProfile
) -> list[_Candidate]:
    spread = capacity.spread.get(profile.name, {})
    out: list[_Candidate] = []
    for name, cap in capacity.nodes.items():
        out.extend(_candidates_on(state.nodes[name], cap, profile, spread.get(name, 0)))
    out.sort(key=lambda c: c.key)
    return out


def _reasons(state: ClusterState, capacity: Capacity, profile: ModelProfile) -> Refusals:
    """Why each node cannot host a shard of `profile` (only the ones that cannot)."""
    why = Refusals()
    why.sentences.update(capacity.rejected.sentences)
    why.codes.update(capacity.rejected.codes)
    for name, cap in capacity.nodes.items():
        node = state.nodes[name]
        if not _candidates_on(node, cap, profile, 0):
            if profile.nodes > 1 and not any(f.hcas for f in node.fabrics):
                why.add(
                    name,
                    "no shared fabric",
                    "no shared fabric: this node is on no RDMA fabric with HCAs",
                )
            else:
                why.add(name, *_why_not(node, cap, profile))
    return why


# What a node that has GPUs enough of the wanted class lacks, most telling first.
_LACKS: tuple[Reason, ...] = ("below compute capability 8.9", "out of ports", "too few free GPUs")


def _why_not(node: NodeState, cap: NodeCapacity, profile: ModelProfile) -> tuple[Reason, str]:
    per_node = profile.gpus_per_node
    classes = sorted({g.gpu_class for g in node.gpus.values()})
    if not node.gpus:
        return "no GPUs", "no GPUs"
    if profile.gpu_class and profile.gpu_class not in classes:
        return "wrong class", f"wrong class: has {', '.join(classes)}, needs {profile.gpu_class}"
    wanted = [profile.gpu_class] if profile.gpu_class else classes
    sizes = class_sizes(node)
    if all(sizes.get(cls, 0) < per_node for cls in wanted):
        has = ", ".join(f"{sizes[c]} {c}" for c in wanted)
        return (
            "never fits",
            f"too small: has {has}, a shard needs {per_node} of one class on one node",
        )
    parts: list[str] = []
    codes: set[Reason] = set()
    for cls in wanted:
        free = cap.by_class.get(cls, [])
        if profile.dtype == "fp8" and free:
            cc = node.gpus[free[0]].compute_capability
            if not catalog.fp8_capable(cc):
                parts.append(f"dtype fp8 needs compute capability 8.9, {cls} has {cc}")
                codes.add("below compute capability 8.9")
                continue
        if len(free) >= per_node:
            parts.append(f"no free port in {PORT_BASE}-{PORT_LIMIT - 1}")
            codes.add("out of ports")
        else:
            parts.append(f"{len(free)} of {per_node} {cls} free")
            codes.add("too few free GPUs")
    parts.extend(cap.problems)
    return next(c for c in _LACKS if c in codes), "; ".join(parts)


def _single(capacity: Capacity, best: _Candidate) -> Placement:
    cap = capacity.nodes[best.node]
    return Placement(
        shards=(
            events.ShardAssignment(shard=0, node=best.node, gpus=best.gpus, port=cap.port() or 0),
        ),
        gpu_class=best.gpu_class,
        nvlink_fit=best.fit,
    )


def place(
    state: ClusterState,
    profile: ModelProfile,
    now: float = 0.0,
    *,
    capacity: Capacity | None = None,
) -> Placement | Unplaceable:
    """Where one new replica of `profile` lands, or why it cannot. Purely computational.

    The result is reserved in `capacity` (a reconcile pass's, to place several replicas in
    one pass), as `place_many` reserves each of its own.
    """
    result = place_many(state, profile, 1, capacity=capacity)
    return result[0] if result else Unplaceable(reason="nothing asked", code="other")


def place_many(
    state: ClusterState,
    profile: ModelProfile,
    count: int,
    *,
    capacity: Capacity | None = None,
    sentences: bool = True,
) -> list[Placement | Unplaceable]:
    """Up to `count` new replicas of one model, each reserved in `capacity` as it is chosen.

    Stops at the first Unplaceable (it is the last item): capacity only shrinks within a
    pass. Single-node replicas use a heap over the candidates, so placing k replicas on N
    nodes costs O(N + k log N), not O(k N). Without `sentences` (a reconcile pass reads only
    the reason and code), a shape beyond every node's GPUs is refused without them.
    """
    cap = capacity if capacity is not None else Capacity(state)
    if count < 1:
        return []
    per_replica, nodes = profile.gpus_per_replica, profile.nodes
    if per_replica < 1 or nodes < 1 or per_replica % nodes:
        why = "the profile's GPU arithmetic is invalid: fix the catalog entry"
        return [Unplaceable(reason=why, code="other")]
    cap.known.summaries = not sentences
    known = cap.known.refusal(profile)  # (KnownRefusals)
    if known is not None:
        return [Unplaceable(code=known[0], reason=known[1], nodes=known[2])]
    many = _place_many_multi if profile.nodes > 1 else _place_many_single
    out = many(state, cap, profile, count)
    if out and isinstance(last := out[-1], Unplaceable):
        cap.known.remember(profile, (last.code, last.reason, last.nodes))
    return out


def _place_many_multi(
    state: ClusterState, cap: Capacity, profile: ModelProfile, count: int
) -> list[Placement | Unplaceable]:
    out: list[Placement | Unplaceable] = []
    # Candidates per node, refreshed only for the nodes a placement used.
    by_node: dict[str, list[_Candidate]] = defaultdict(list)
    for c in _all_candidates(state, cap, profile):
        by_node[c.node].append(c)
    spread_of = cap.spread[profile.name]
    for _ in range(count):
        result = _place_multi(state, cap, profile, by_node)
        out.append(result)
        if isinstance(result, Unplaceable):
            break
        cap.reserve(profile.name, result)
        for sa in result.shards:
            by_node[sa.node] = _candidates_on(
                state.nodes[sa.node], cap.nodes[sa.node], profile, spread_of[sa.node]
            )
    return out


def _place_many_single(
    state: ClusterState, cap: Capacity, profile: ModelProfile, count: int
) -> list[Placement | Unplaceable]:
    out: list[Placement | Unplaceable] = []
    # Heap entries carry their node's version: a reservation on a node makes
    # its older entries stale (fewer GPUs, one more replica of the model there).
    version: dict[str, int] = defaultdict(int)
    heap = [(c.key, 0, c) for c in _all_candidates(state, cap, profile)]  # sorted: a heap
    spread = cap.spread[profile.name]
    while len(out) < count:
        if not heap:
            out.append(
                _beyond(cap, profile) or _refused(state, profile, _reasons(state, cap, profile))
            )
            break
        _, seen, best = heapq.heappop(heap)
        if seen != version[best.node]:
            continue
        placement = _single(cap, best)
        out.append(placement)
        cap.reserve(profile.name, placement)
        version[best.node] += 1
        node = state.nodes[best.node]
        for c in _candidates_on(node, cap.nodes[best.node], profile, spread[best.node]):
            heapq.heappush(heap, (c.key, version[best.node], c))
    return out


def _place_multi(
    state: ClusterState,
    cap: Capacity,
    profile: ModelProfile,
    by_node: dict[str, list[_Candidate]],
) -> Placement | Unplaceable:
    candidates = [c for name in sorted(by_node) for c in by_node[name]]
    groups: dict[tuple[str, str], list[_Candidate]] = defaultdict(list)
    for c in candidates:
        for f in state.nodes[c.node].fabrics:
            if f.hcas:
                groups[(f.name, c.gpu_class)].append(c)
    best: tuple[tuple[int, int, int, str, str], list[_Candidate]] | None = None
    for (fabric, cls), members in sorted(groups.items()):
        if len(members) < profile.nodes:
            continue
        # A node has one candidate per class, so a group never lists a node twice.
        chosen = heapq.nsmallest(profile.nodes, members, key=lambda c: c.key)
        score = (
            sum(not c.fit for c in chosen),
            sum(c.key[1] for c in chosen),
            sum(c.key[2] for c in chosen),
            fabric,
            cls,
        )
        if best is None or score < best[0]:
            best = (score, chosen)
    if best is None:
        if (beyond := _beyond(cap, profile)) is not None:
            return beyond
        why = _reasons(state, cap, profile)
        short = too_few_nodes(state, profile)
        for c in candidates:
            if c.node not in why and short is not None:
                why.add(c.node, "never fits", f"could host a shard, but {short}")
            elif c.node not in why:
                fabrics = sorted(f.name for f in state.nodes[c.node].fabrics if f.hcas)
                sizes = ", ".join(
                    f"{f} offers {len({m.node for m in groups.get((f, c.gpu_class), [])})}"
                    for f in fabrics
                )
                why.add(
                    c.node,
                    "no shared fabric",
                    f"no shared fabric: a replica needs {profile.nodes} nodes with "
                    f"{profile.gpus_per_node} free {c.gpu_class} on one fabric ({sizes})",
                )
        return _refused(state, profile, why)
    (_, _, _, fabric, cls), chosen = best
    shards = tuple(
        events.ShardAssignment(
            shard=i, node=c.node, gpus=c.gpus, port=cap.nodes[c.node].port() or 0
        )
        for i, c in enumerate(chosen)
    )
    return Placement(
        shards=shards, gpu_class=cls, fabric=fabric, nvlink_fit=all(c.fit for c in chosen)
    )


# --------------------------------------------------------------------------- explain


def explain(state: ClusterState, model: str, now: float) -> Explanation:
    """Every node, and whether a new replica of `model` could land on it and why not.

    Purely computational; the management API and `llmgw ctl explain` render it.
    """
    current = state.models.get(model)
    if current is None:
        return Explanation(
            model=model,
            placement=None,
            verdict=(
                f"model {model!r} is not declared: add it to a models file and run "
                "`llmgw ctl apply -f models.yaml`"
            ),
            nodes=(),
        )
    profile = current.profile
    cap = Capacity(state)
    result = place(state, profile, now, capacity=Capacity(state))
    reasons = _reasons(state, cap, profile).sentences
    if isinstance(result, Unplaceable):
        reasons.update(result.nodes)
    for name in cap.rejected.sentences:
        reasons[name] = _unusable(state.nodes[name], now) or quarantined(state, name)
    fits = {c.node: c for c in _all_candidates(state, cap, profile)}
    landing = {sa.node: sa for sa in result.shards} if isinstance(result, Placement) else {}
    verdicts: list[NodeVerdict] = []
    for name in sorted(state.nodes):
        if name in landing and isinstance(result, Placement):
            verdicts.append(_landing(name, landing[name], result, profile))
        elif name in reasons:
            verdicts.append(NodeVerdict(node=name, ok=False, reason=reasons[name]))
        elif name in fits and not fits[name].fit and profile.gpus_per_node > 1:
            verdicts.append(
                NodeVerdict(
                    node=name,
                    ok=False,
                    reason="NVLink domain too small: the tensor-parallel group would span PCIe",
                )
            )
        else:
            verdicts.append(
                NodeVerdict(node=name, ok=True, reason="could host it; another node ranks first")
            )
    if isinstance(result, Placement):
        verdict = "a new replica lands on " + ", ".join(sa.node for sa in result.shards)
    else:
        verdict = f"unplaceable: {result.reason}"
    return Explanation(
        model=model,
        placement=result if isinstance(result, Placement) else None,
        verdict=verdict,
        nodes=tuple(verdicts),
    )


def _landing(
    name: str, sa: events.ShardAssignment, result: Placement, profile: ModelProfile
) -> NodeVerdict:
    where = f"lands here: GPUs {_ranges(sa.gpus)} ({result.gpu_class}"
    where += f", fabric {result.fabric}, port {sa.port})" if result.fabric else f", port {sa.port})"
    if not result.nvlink_fit and profile.gpus_per_node > 1:
        where += "; NVLink domain too small: the tensor-parallel group spans PCIe"
    return NodeVerdict(node=name, ok=True, reason=where)


def _beyond(cap: Capacity, profile: ModelProfile) -> Unplaceable | None:
    """A shape beyond every node's GPUs refused without judging each (KnownRefusals)."""
    found = cap.known.beyond(profile)
    return None if found is None else Unplaceable(reason=found[1], code=found[0])


def _refused(state: ClusterState, profile: ModelProfile, why: Refusals) -> Unplaceable:
    code, reason = summary(state, profile, why)
    return Unplaceable(reason=reason, code=code, nodes=why.sentences)


def _ranges(gpus: tuple[int, ...]) -> str:
    if len(gpus) > 1 and list(gpus) == list(range(gpus[0], gpus[0] + len(gpus))):
        return f"{gpus[0]}-{gpus[-1]}"
    return ",".join(str(g) for g in gpus)

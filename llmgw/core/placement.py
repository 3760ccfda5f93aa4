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

`place` is used by the reconciler, `explain` by the control service's
management API and `llmgw ctl explain`. A `Capacity` is built once per
reconcile pass and updated as that pass reserves GPUs, so several replicas
placed in one pass never share a GPU or a port.

Purely computational: no I/O, no clock; `now` only words the reasons.
"""

from __future__ import annotations

import heapq
from collections import defaultdict

import msgspec

from llmgw.core import catalog, events
from llmgw.core.profile import ModelProfile
from llmgw.core.state import ClusterState, NodeState

PORT_BASE = 8100
PORT_LIMIT = 9100
"""Each shard takes two ports from [PORT_BASE, PORT_LIMIT): its HTTP port and, on a
multi-node head, the next one for the distributed init (--master-port)."""


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    shards: tuple[events.ShardAssignment, ...]
    gpu_class: str
    fabric: str = ""
    nvlink_fit: bool = True
    """Every shard's GPUs share one NVLink domain (or it is a single GPU)."""


class Unplaceable(msgspec.Struct, frozen=True, kw_only=True):
    reason: str
    """One line for logs and metrics labels' detail."""
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
        lines = [f"model {self.model}: {self.verdict}"]
        width = max((len(v.node) for v in self.nodes), default=4)
        for v in self.nodes:
            mark = "+" if v.ok else "-"
            lines.append(f"  {mark} {v.node.ljust(width)}  {v.reason}")
        return "\n".join(lines)


# --------------------------------------------------------------------------- capacity


class _NodeCap:
    """Free healthy GPUs of one usable node, per class, plus its free ports."""

    __slots__ = ("_port", "by_class", "domains", "name", "picks", "ports", "problems")

    def __init__(self, node: NodeState) -> None:
        self.name = node.name
        by_class: dict[str, list[int]] = {}
        domains: dict[str, dict[int | None, list[int]]] = {}
        self.problems: list[str] = []
        self.picks: dict[tuple[str, int], tuple[tuple[int, ...], bool] | None] = {}
        held = node.holders
        orphaned = {g for orphan in node.orphans for g in orphan.gpus} if node.orphans else ()
        gpus = node.gpus
        # Hot: runs for every node on every pass that places something.
        for index in sorted(gpus):
            if index in held or index in orphaned:
                continue
            gpu = gpus[index]
            if (
                gpu.ecc_uncorrected
                or gpu.foreign_memory_mib
                or gpu.remap_pending
                or gpu.remap_failed
            ):
                self.problems.append(f"GPU {index} unhealthy: {', '.join(gpu.health_problems)}")
                continue
            cls = gpu.gpu_class
            free = by_class.get(cls)
            if free is None:
                by_class[cls] = [index]
                domains[cls] = {gpu.nvlink_domain: [index]}
                continue
            free.append(index)
            members = domains[cls].get(gpu.nvlink_domain)
            if members is None:
                domains[cls][gpu.nvlink_domain] = [index]
            else:
                members.append(index)
        self.by_class = by_class
        self.domains = domains
        """Free healthy GPUs per class and NVLink domain (None: PCIe only)."""
        self.ports = set(node.ports)
        self._port: int | None = None

    def pick(self, gpu_class: str, count: int) -> tuple[tuple[int, ...], bool] | None:
        """`count` free GPUs of a class, one NVLink domain where one fits (best fit).

        Cached until the node's capacity changes: a pass asks the same node the
        same question once per model.
        """
        cache_key = (gpu_class, count)
        if cache_key in self.picks:
            return self.picks[cache_key]
        result = self._pick(gpu_class, count)
        self.picks[cache_key] = result
        return result

    def _pick(self, gpu_class: str, count: int) -> tuple[tuple[int, ...], bool] | None:
        free = self.by_class.get(gpu_class, ())
        if len(free) < count:
            return None
        best: tuple[int, int] | None = None
        for d, members in self.domains.get(gpu_class, {}).items():
            if (
                d is not None
                and len(members) >= count
                and (best is None or (len(members), d) < best)
            ):
                best = (len(members), d)
        if best is not None:
            return tuple(self.domains[gpu_class][best[1]][:count]), True
        return tuple(free[:count]), count == 1

    def take(self, gpu_class: str, gpus: tuple[int, ...]) -> None:
        taken = set(gpus)
        self.by_class[gpu_class] = [g for g in self.by_class[gpu_class] if g not in taken]
        for d, members in self.domains[gpu_class].items():
            self.domains[gpu_class][d] = [g for g in members if g not in taken]
        self.picks.clear()

    def port(self) -> int | None:
        """The lowest free (port, port + 1) pair; cached until `take_port`."""
        if self._port is None:
            self._port = next(
                (
                    p
                    for p in range(PORT_BASE, PORT_LIMIT, 2)
                    if p not in self.ports and p + 1 not in self.ports
                ),
                0,
            )
        return self._port or None

    def take_port(self, port: int) -> None:
        self.ports.update((port, port + 1))
        self._port = None


class Capacity:
    """What is free now, for one reconcile pass; `reserve` records this pass's placements."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self.nodes: dict[str, _NodeCap] = {}
        self.rejected: dict[str, str] = {}
        for name in sorted(state.nodes):
            node = state.nodes[name]
            why = _unusable(node) or _quarantined(state, name)
            if why:
                self.rejected[name] = why
            else:
                self.nodes[name] = _NodeCap(node)
        # Replicas of each model per node, for spreading.
        self.spread: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for replica in state.replicas.values():
            if not replica.retired:
                for shard in replica.shards:
                    self.spread[replica.model][shard.node] += 1

    def reserve(self, model: str, placement: Placement) -> None:
        for sa in placement.shards:
            cap = self.nodes[sa.node]
            cap.take(placement.gpu_class, sa.gpus)
            cap.take_port(sa.port)
            self.spread[model][sa.node] += 1


def _quarantined(state: ClusterState, name: str) -> str:
    """Why a node whose log traffic exceeded its budget gets nothing (see NodeQuarantined)."""
    q = state.quarantined.get(name)
    if q is None:
        return ""
    return f"quarantined ({q.reason})" if q.reason else "quarantined"


def _unusable(node: NodeState, now: float | None = None) -> str:
    if node.liveness == "lost":
        return "lost"
    if node.liveness == "unreachable":
        if now is not None and node.last_heartbeat:
            return f"unreachable (last heartbeat {max(0.0, now - node.last_heartbeat):.0f} s ago)"
        return "unreachable"
    if node.draining:
        return "draining"
    if node.cordoned:
        return f"cordoned ({node.cordon_reason})" if node.cordon_reason else "cordoned"
    return ""


# --------------------------------------------------------------------------- place


class _Candidate(msgspec.Struct, frozen=True, gc=False):
    key: tuple[bool, int, int, str, str]
    """Sort key: NVLink misfit, replicas of the model already there, GPUs left, name, class."""
    node: str
    gpu_class: str
    gpus: tuple[int, ...]
    fit: bool


def _candidates_on(
    node: NodeState, cap: _NodeCap, profile: ModelProfile, spread: int
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


def _reasons(state: ClusterState, capacity: Capacity, profile: ModelProfile) -> dict[str, str]:
    """Why each node cannot host a shard of `profile` (only the ones that cannot)."""
    why = {name: reason for name, reason in capacity.rejected.items()}
    for name, cap in capacity.nodes.items():
        node = state.nodes[name]
        if not _candidates_on(node, cap, profile, 0):
            if profile.nodes > 1 and not any(f.hcas for f in node.fabrics):
                why[name] = "no shared fabric: this node is on no RDMA fabric with HCAs"
            else:
                why[name] = _why_not(node, cap, profile)
    return why


def _why_not(node: NodeState, cap: _NodeCap, profile: ModelProfile) -> str:
    per_node = profile.gpus_per_node
    classes = sorted({g.gpu_class for g in node.gpus.values()})
    if not node.gpus:
        return "no GPUs"
    if profile.gpu_class and profile.gpu_class not in classes:
        return f"wrong class: has {', '.join(classes)}, needs {profile.gpu_class}"
    wanted = [profile.gpu_class] if profile.gpu_class else classes
    sizes = _class_sizes(node)
    if all(sizes.get(cls, 0) < per_node for cls in wanted):
        has = ", ".join(f"{sizes[c]} {c}" for c in wanted)
        return f"too small: has {has}, a shard needs {per_node} of one class on one node"
    parts: list[str] = []
    for cls in wanted:
        free = cap.by_class.get(cls, [])
        if profile.dtype == "fp8" and free:
            cc = node.gpus[free[0]].compute_capability
            if not catalog.fp8_capable(cc):
                parts.append(f"dtype fp8 needs compute capability 8.9, {cls} has {cc}")
                continue
        if len(free) >= per_node:
            parts.append(f"no free port in {PORT_BASE}-{PORT_LIMIT - 1}")
        else:
            parts.append(f"{len(free)} of {per_node} {cls} free")
    parts.extend(cap.problems)
    return "; ".join(parts)


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

    Pass a reconcile pass's `capacity` and `reserve` the result to place
    several replicas in one pass; `place_many` does that for one model.
    """
    result = place_many(state, profile, 1, capacity=capacity)
    return result[0] if result else Unplaceable(reason="nothing asked")


def place_many(
    state: ClusterState,
    profile: ModelProfile,
    count: int,
    *,
    capacity: Capacity | None = None,
) -> list[Placement | Unplaceable]:
    """Up to `count` new replicas of one model, each reserved in `capacity` as it is chosen.

    Stops at the first Unplaceable (it is the last item): capacity only shrinks
    within a pass. Single-node replicas use a heap over the candidates, so
    placing k replicas on N nodes costs O(N + k log N), not O(k N).
    """
    cap = capacity if capacity is not None else Capacity(state)
    out: list[Placement | Unplaceable] = []
    if count < 1:
        return out
    if (
        profile.gpus_per_replica < 1
        or profile.nodes < 1
        or profile.gpus_per_replica % profile.nodes
    ):
        return [
            Unplaceable(reason="the profile's GPU arithmetic is invalid: fix the catalog entry")
        ]
    if profile.nodes > 1:
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
    # Heap entries carry their node's version: a reservation on a node makes
    # its older entries stale (fewer GPUs, one more replica of the model there).
    version: dict[str, int] = defaultdict(int)
    heap = [(c.key, 0, c) for c in _all_candidates(state, cap, profile)]  # sorted: a heap
    spread = cap.spread[profile.name]
    while len(out) < count:
        if not heap:
            why = _reasons(state, cap, profile)
            out.append(Unplaceable(reason=_summary(state, profile, why), nodes=why))
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
        why = _reasons(state, cap, profile)
        short = _too_few_nodes(state, profile)
        for c in candidates:
            if c.node not in why and short is not None:
                why[c.node] = f"could host a shard, but {short}"
            elif c.node not in why:
                fabrics = sorted(f.name for f in state.nodes[c.node].fabrics if f.hcas)
                sizes = ", ".join(
                    f"{f} offers {len({m.node for m in groups.get((f, c.gpu_class), [])})}"
                    for f in fabrics
                )
                why[c.node] = (
                    f"no shared fabric: a replica needs {profile.nodes} nodes with "
                    f"{profile.gpus_per_node} free {c.gpu_class} on one fabric ({sizes})"
                )
        return Unplaceable(reason=_summary(state, profile, why), nodes=why)
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


_CATEGORIES = (
    ("lost", "lost"),
    ("unreachable", "unreachable"),
    ("draining", "draining"),
    ("quarantined", "quarantined"),
    ("cordoned", "cordoned"),
    ("wrong class", "wrong class"),
    ("too small", "never fits"),
    ("could host a shard, but", "never fits"),
    ("no shared fabric", "no shared fabric"),
    ("fp8", "below compute capability 8.9"),
    ("free port", "out of ports"),
    ("no GPUs", "no GPUs"),
    (" free", "too few free GPUs"),
)


def _summary(state: ClusterState, profile: ModelProfile, why: dict[str, str]) -> str:
    """One line: what is impossible and why, if it is, then what each node lacks, counted
    (the last parenthesis is the metrics label's source: `failure_reason`)."""
    need = f"{profile.gpus_per_node} free {profile.gpu_class or 'GPUs of one class'}"
    if profile.nodes > 1:
        need = f"{profile.nodes} nodes on one fabric with {need} each"
    counts: dict[str, int] = defaultdict(int)
    for reason in why.values():
        label = next((lbl for word, lbl in _CATEGORIES if word in reason), "other")
        counts[label] += 1
    top = ", ".join(f"{r}: {n}" for r, n in sorted(counts.items(), key=lambda x: (-x[1], x[0])))
    never = impossible(state, profile) if state.nodes else None
    head = f"{never}; " if never else ""
    return f"{head}no node offers {need} ({top or 'no nodes registered'})"


def _class_sizes(node: NodeState) -> dict[str, int]:
    """GPUs per class of a node, whatever their use or health: what it could ever offer."""
    sizes: dict[str, int] = defaultdict(int)
    for gpu in node.gpus.values():
        sizes[gpu.gpu_class] += 1
    return sizes


def _big_enough(state: ClusterState, profile: ModelProfile) -> list[str]:
    """Registered nodes with enough GPUs of one wanted class for a shard, used or not."""
    per_node = profile.gpus_per_node
    out = []
    for name in sorted(state.nodes):
        sizes = _class_sizes(state.nodes[name])
        wanted = [profile.gpu_class] if profile.gpu_class else list(sizes)
        if any(sizes.get(cls, 0) >= per_node for cls in wanted):
            out.append(name)
    return out


def _too_few_nodes(state: ClusterState, profile: ModelProfile) -> str | None:
    big = _big_enough(state, profile)
    if profile.nodes <= 1 or len(big) >= profile.nodes:
        return None
    cls = profile.gpu_class or "GPUs of one class"
    return (
        f"a replica needs {profile.nodes} nodes with {profile.gpus_per_node} {cls} each and "
        f"the fleet has {len(big)} such node{'' if len(big) == 1 else 's'}"
    )


def impossible(state: ClusterState, profile: ModelProfile) -> str | None:
    """Why no replica of `profile` can ever be placed on the registered hardware, freeing
    every GPU and healing every node; None when it could. Pure.

    "7 of 16 free" would send an operator to free GPUs on a node that has 8: the model
    must change (fewer GPUs, more nodes per replica) or the fleet must grow.
    """
    per_node = profile.gpus_per_node
    cls = profile.gpu_class or "GPUs of one class"
    if not _big_enough(state, profile):
        largest = max(
            (
                n
                for node in state.nodes.values()
                for c, n in _class_sizes(node).items()
                if not profile.gpu_class or c == profile.gpu_class
            ),
            default=0,
        )
        fix = (
            "split it over more nodes (`nodes`) or ask for fewer GPUs"
            if profile.nodes == 1
            else "ask for fewer GPUs per node"
        )
        return (
            f"never fits this fleet: a shard needs {per_node} {cls} on one node and the "
            f"largest node has {largest}: {fix}"
        )
    short = _too_few_nodes(state, profile)
    if short is not None:
        return f"never fits this fleet: {short}: ask for fewer nodes per replica or add nodes"
    return None


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
    reasons = _reasons(state, cap, profile)
    if isinstance(result, Unplaceable):
        reasons.update(result.nodes)
    for name in cap.rejected:
        reasons[name] = _unusable(state.nodes[name], now) or _quarantined(state, name)
    fits = {c.node: c for c in _all_candidates(state, cap, profile)}
    landing = {sa.node: sa for sa in result.shards} if isinstance(result, Placement) else {}
    verdicts: list[NodeVerdict] = []
    for name in sorted(state.nodes):
        if name in landing and isinstance(result, Placement):
            sa = landing[name]
            where = f"lands here: GPUs {_ranges(sa.gpus)} ({result.gpu_class}"
            where += (
                f", fabric {result.fabric}, port {sa.port})"
                if result.fabric
                else f", port {sa.port})"
            )
            if not result.nvlink_fit and profile.gpus_per_node > 1:
                where += "; NVLink domain too small: the tensor-parallel group spans PCIe"
            verdicts.append(NodeVerdict(node=name, ok=True, reason=where))
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


def _ranges(gpus: tuple[int, ...]) -> str:
    if len(gpus) > 1 and list(gpus) == list(range(gpus[0], gpus[0] + len(gpus))):
        return f"{gpus[0]}-{gpus[-1]}"
    return ",".join(str(g) for g in gpus)

"""Why placement refuses: a stable code next to each sentence, the one-line summary of a
refused replica, and what can never fit the registered hardware.

The code is what the control plane counts (`placement_failures{reason=...}`); the sentence
is what people read in logs, `llmgw ctl explain` and /v1/explain. Codes are chosen where
the sentence is written, never parsed back out of it: a cordon reason or a quarantine's
words may say anything.

Purely computational.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from typing import Literal, TypeAlias

from llmgw.core.profile import ModelProfile
from llmgw.core.state import ClusterState, NodeState

Reason = Literal[
    "lost",
    "unreachable",
    "draining",
    "quarantined",
    "cordoned",
    "wrong class",
    "never fits",
    "no shared fabric",
    "below compute capability 8.9",
    "out of ports",
    "no GPUs",
    "too few free GPUs",
    "no nodes",
    "other",
]
"""Why a node cannot host a shard, or (its most common one) why a replica cannot be
placed: "no nodes" when none is registered, "other" when the profile itself is wrong."""


class Refusals:
    """Why each node cannot host a shard of one model: a sentence and a code per node."""

    __slots__ = ("codes", "sentences")

    def __init__(self) -> None:
        self.sentences: dict[str, str] = {}
        self.codes: dict[str, Reason] = {}

    def add(self, node: str, code: Reason, sentence: str) -> None:
        self.sentences[node] = sentence
        self.codes[node] = code

    def __contains__(self, node: object) -> bool:
        return node in self.sentences


def quarantined(state: ClusterState, name: str) -> str:
    """Why a node whose log traffic exceeded its budget gets nothing (see NodeQuarantined)."""
    q = state.quarantined.get(name)
    if q is None:
        return ""
    return f"quarantined ({q.reason})" if q.reason else "quarantined"


def refusal(node: NodeState, now: float | None = None) -> tuple[Reason, str]:
    """Why a node gets nothing, whatever it offers, as a code and a sentence (empty when it
    is usable); `now` words an unreachable node's silence."""
    if node.liveness == "lost":
        return "lost", "lost"
    if node.liveness == "unreachable":
        if now is not None and node.last_heartbeat:
            ago = max(0.0, now - node.last_heartbeat)
            return "unreachable", f"unreachable (last heartbeat {ago:.0f} s ago)"
        return "unreachable", "unreachable"
    if node.draining:
        return "draining", "draining"
    if node.cordoned:
        why = f"cordoned ({node.cordon_reason})" if node.cordon_reason else "cordoned"
        return "cordoned", why
    return "other", ""


def rejected_code(state: ClusterState, node: NodeState) -> Reason:
    """The code of a node placement's `Capacity` refused: unusable, else quarantined."""
    code, why = refusal(node)
    if why:
        return code
    return "quarantined" if node.name in state.quarantined else "other"


def summary(state: ClusterState, profile: ModelProfile, why: Refusals) -> tuple[Reason, str]:
    """One line: what is impossible and why, if it is, then what each node lacks, counted;
    and the most common code among the nodes (ties: the first by name) as its code."""
    never = impossible(state, profile) if state.nodes else None
    return summarised(profile, Counter(why.codes.values()), never)


def summarised(
    profile: ModelProfile, counts: Mapping[Reason, int], never: str | None
) -> tuple[Reason, str]:
    """`summary` of the nodes' codes counted, and what is impossible (None: nothing)."""
    need = f"{profile.gpus_per_node} free {profile.gpu_class or 'GPUs of one class'}"
    if profile.nodes > 1:
        need = f"{profile.nodes} nodes on one fabric with {need} each"
    ranked = sorted(counts.items(), key=lambda x: (-x[1], x[0]))
    top = ", ".join(f"{r}: {n}" for r, n in ranked)
    head = f"{never}; " if never else ""
    code: Reason = ranked[0][0] if ranked else "no nodes"
    return code, f"{head}no node offers {need} ({top or 'no nodes registered'})"


def class_sizes(node: NodeState) -> dict[str, int]:
    """GPUs per class of a node, whatever their use or health: what it could ever offer."""
    sizes: dict[str, int] = defaultdict(int)
    for gpu in node.gpus.values():
        sizes[gpu.gpu_class] += 1
    return sizes


def big_enough(state: ClusterState, profile: ModelProfile) -> list[str]:
    """Registered nodes with enough GPUs of one wanted class for a shard, used or not."""
    per_node = profile.gpus_per_node
    out = []
    for name in sorted(state.nodes):
        sizes = class_sizes(state.nodes[name])
        wanted = [profile.gpu_class] if profile.gpu_class else list(sizes)
        if any(sizes.get(cls, 0) >= per_node for cls in wanted):
            out.append(name)
    return out


def too_few_nodes(state: ClusterState, profile: ModelProfile) -> str | None:
    big = big_enough(state, profile)
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
    if not big_enough(state, profile):
        largest = max(
            (
                n
                for node in state.nodes.values()
                for c, n in class_sizes(node).items()
                if not profile.gpu_class or c == profile.gpu_class
            ),
            default=0,
        )
        return _too_big(profile, largest)
    short = too_few_nodes(state, profile)
    if short is not None:
        return f"never fits this fleet: {short}: ask for fewer nodes per replica or add nodes"
    return None


def _too_big(profile: ModelProfile, largest: int) -> str:
    cls = profile.gpu_class or "GPUs of one class"
    fix = (
        "split it over more nodes (`nodes`) or ask for fewer GPUs"
        if profile.nodes == 1
        else "ask for fewer GPUs per node"
    )
    return (
        f"never fits this fleet: a shard needs {profile.gpus_per_node} {cls} on one node and "
        f"the largest node has {largest}: {fix}"
    )


class Hardware:
    """The registered GPUs summed up once per reconcile pass, for shapes that no node could
    ever host (a typo's `tensor_parallel: 80`, a class no node has): such a refusal costs
    the summary here, where judging each node, for each such model, each pass, cost tens
    of microseconds per node and model (1,000 of them on 1,000 nodes: seconds per pass).
    `beyond_every_node` says what `summary` of every node's judgement says."""

    def __init__(
        self, state: ClusterState, usable: Iterable[str], rejected: Mapping[str, Reason]
    ) -> None:
        self.registered = bool(state.nodes)
        self.largest: dict[str, int] = {}
        """GPU class -> the most of it on one registered node, whatever its state."""
        for node in state.nodes.values():
            for cls, n in class_sizes(node).items():
                self.largest[cls] = max(n, self.largest.get(cls, 0))
        self.rejected = Counter(rejected.values())
        self.kinds: Counter[tuple[bool, bool, frozenset[str]]] = Counter(
            (
                any(f.hcas for f in node.fabrics),
                bool(node.gpus),
                frozenset(g.gpu_class for g in node.gpus.values()),
            )
            for node in (state.nodes[name] for name in usable)
        )
        """Usable nodes by (on a fabric with HCAs, has GPUs, its classes)."""

    def beyond_every_node(self, profile: ModelProfile) -> tuple[Reason, str] | None:
        """The code and summary refusing `profile`, when no registered node has GPUs enough
        of a class it accepts for one shard; None otherwise (judge the nodes)."""
        wanted = profile.gpu_class
        sizes = [self.largest.get(wanted, 0)] if wanted else list(self.largest.values())
        largest = max(sizes, default=0)
        if not self.registered or profile.gpus_per_node <= largest:
            return None
        counts = Counter(self.rejected)
        for (hcas, gpus, classes), n in self.kinds.items():
            if profile.nodes > 1 and not hcas:
                counts["no shared fabric"] += n
            elif not gpus:
                counts["no GPUs"] += n
            elif wanted and wanted not in classes:
                counts["wrong class"] += n
            else:
                counts["never fits"] += n
        return summarised(profile, counts, _too_big(profile, largest))


Known: TypeAlias = tuple[Reason, str, dict[str, str]]
"""A refusal: its code, its summary and each node's sentence (placement's Unplaceable)."""


class KnownRefusals:
    """The refusals a reconcile pass has already worked out, by the shape of what was
    refused (GPU class, GPUs, nodes, dtype: all that whether and why it lands reads).

    Judging every node takes tens of microseconds each, for each waiting model of a full
    fleet, each pass: 1,000 models waiting on 1,000 nodes took 6 s of the leader's event
    loop. A refusal holds until the pass reserves GPUs (`version` counts reservations); a
    shape beyond every node's GPUs can be refused from the `Hardware` alone."""

    def __init__(
        self, state: ClusterState, usable: Iterable[str], rejected: Mapping[str, Reason]
    ) -> None:
        self.version = 0
        self.summaries = False
        """The caller reads only a refusal's code and summary, not each node's sentence."""
        self._args = (state, usable, rejected)
        self._hardware: Hardware | None = None
        self._by_shape: dict[tuple[str, int, int, str], tuple[int, Known]] = {}

    def refusal(self, profile: ModelProfile) -> Known | None:
        """What refused `profile`'s shape since the last reservation, if anything did."""
        hit = self._by_shape.get(_shape(profile))
        return hit[1] if hit is not None and hit[0] == self.version else None

    def beyond(self, profile: ModelProfile) -> tuple[Reason, str] | None:
        """Where `summaries` are enough: the code and summary refusing a shape beyond every
        node's GPUs (`Hardware`, summed up the first time a pass refuses anything)."""
        if not self.summaries:
            return None
        if self._hardware is None:
            self._hardware = Hardware(*self._args)
        return self._hardware.beyond_every_node(profile)

    def remember(self, profile: ModelProfile, refused: Known) -> None:
        self._by_shape[_shape(profile)] = (self.version, refused)


def _shape(p: ModelProfile) -> tuple[str, int, int, str]:
    return (p.gpu_class, p.gpus_per_replica, p.nodes, p.dtype)

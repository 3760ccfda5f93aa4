"""The log read by a person: one line per event, filters, and what touched a node or replica.

`llmgw ctl events` prints `summary(event)` per record, filtered by `matches`;
`llmgw ctl replay --timeline X` keeps the records for which `touches(event, X)`.

Purely computational.
"""

from __future__ import annotations

from llmgw.core import events, printable, subjects


def family(event: events.Event) -> str:
    """node, operator, control or cmd: who wrote it (colours the line on a terminal)."""
    return events.tag_of(type(event)).partition(".")[0]


def _gpus(gpus: tuple[int, ...]) -> str:
    return ",".join(str(g) for g in gpus)


def clean(text: str) -> str:
    """Control characters escaped: text from agents (errors, engine logs) can hold newlines
    that would split a line in two, escape sequences (ESC or the 8-bit CSI) that would
    drive the terminal, or bidirectional overrides that would disguise what it says."""
    return printable.escaped(text)


def summary(event: events.Event) -> str:
    """What the event says, in a few words, on one line."""
    return clean(_summary(event))


def _summary(event: events.Event) -> str:
    for part in (_node_summary, _operator_summary, _control_summary, _command_summary):
        text = part(event)
        if text is not None:
            return text
    return type(event).__name__


def _node_summary(event: events.Event) -> str | None:
    """What a node reported; None for another kind of event."""
    match event:
        case events.NodeRegistered():
            shards = f", {len(event.shards)} shards running" if event.shards else ""
            return f"{event.node} registered at {event.address}: {len(event.gpus)} GPUs{shards}"
        case events.Heartbeat():
            return f"{event.node} heartbeat #{event.seq}"
        case events.ShardStatus():
            text = (
                f"{event.node} {event.replica_id}/{event.shard} g{event.generation} {event.phase}"
            )
            if event.endpoint:
                text += f" {event.endpoint}"
            if event.error:
                text += f": {event.error}"
            return text
    return None


def _operator_summary(event: events.Event) -> str | None:
    """What an operator asked for; None for another kind of event."""
    match event:
        case events.ModelDeclared() | events.ModelChanged():
            p = event.profile
            verb = "declared" if isinstance(event, events.ModelDeclared) else "changed"
            return f"model {p.name} {verb} by {event.operator}: {p.replicas} x {p.engine}"
        case events.ModelRemoved():
            return f"model {event.name} removed by {event.operator}"
        case events.NodeCordoned():
            why = f" ({event.reason})" if event.reason else ""
            return f"{event.node} cordoned by {event.operator}{why}"
        case events.NodeUncordoned():
            return f"{event.node} uncordoned by {event.operator}"
        case events.NodeDrainRequested():
            why = f" ({event.reason})" if event.reason else ""
            return f"{event.node} drain by {event.operator}, grace {event.grace_s:g} s{why}"
        case events.ScalePinned():
            why = f" ({event.reason})" if event.reason else ""
            return f"{event.model} pinned at {event.replicas} by {event.operator}{why}"
        case events.ScaleReleased():
            return f"{event.model} released to its autoscaler by {event.operator}"
    return None


def _control_summary(event: events.Event) -> str | None:
    """What the control plane decided or observed; None for another kind of event."""
    match event:
        case events.ReplicaPlaced():
            where = " ".join(f"{s.node}:{_gpus(s.gpus)}" for s in event.shards)
            rep = f" replacing {event.replaces}" if event.replaces else ""
            return f"{event.replica_id} g{event.generation} of {event.model} on {where}{rep}"
        case events.ReplicaRetired():
            return f"{event.replica_id} retired: {event.reason}"
        case events.NodeUnreachable() | events.NodeLost():
            what = "unreachable" if isinstance(event, events.NodeUnreachable) else "lost"
            return f"{event.node} {what}"
        case events.NodeRecovered():
            return f"{event.node} recovered"
        case events.NodeQuarantined():
            return f"{event.node} quarantined: {event.reason}"
        case events.NodeReleased():
            why = f": {event.reason}" if event.reason else ""
            return f"{event.node} released from quarantine{why}"
        case events.GpuHealthChanged():
            return f"{event.node} GPU health: " + ", ".join(
                f"{h.index} ecc={h.ecc_uncorrected} foreign={h.foreign_memory_mib}MiB"
                + (" remap-pending" if h.remap_pending else "")
                + (" remap-failed" if h.remap_failed else "")
                for h in event.gpus
            )
        case events.ScaleDecided():
            return (
                f"{event.model} scaled {event.from_replicas} -> {event.to_replicas}: {event.reason}"
            )
        case events.EndpointUp():
            return f"{event.replica_id} ({event.model}) up at {event.url}"
        case events.EndpointDown():
            why = f": {event.reason}" if event.reason else ""
            return f"{event.replica_id} ({event.model}) down at {event.url}{why}"
        case events.LeaderElected():
            return f"{event.leader} leads (epoch {event.epoch})"
        case events.LogAttested():
            accepted = sum(b - a + 1 for a, b in (*event.accepted, *event.payload_accepted))
            refused = sum(b - a + 1 for a, b in event.refused)
            return (
                f"attested {event.first_seq}..{event.last_seq}: {accepted} accepted, "
                f"{refused} refused"
            )
    return None


def _command_summary(event: events.Event) -> str | None:
    """A command to an agent; None for another kind of event."""
    match event:
        case events.StartShard():
            return (
                f"start {event.replica_id}/{event.shard} g{event.generation} on {event.node} "
                f"GPUs {_gpus(event.launch.gpus)} port {event.launch.port}"
            )
        case events.StopShard():
            return f"stop {event.replica_id}/{event.shard} g{event.generation} on {event.node}"
        case events.DrainShard():
            return f"drain {event.replica_id}/{event.shard} g{event.generation} on {event.node}"
    return None


def nodes_of(event: events.Event, subject: str = "") -> set[str]:
    """Every node the event is about."""
    found: set[str] = set()
    node = subjects.node_of(subject) if subject else None
    if node:
        found.add(node)
    name = getattr(event, "node", None)
    if isinstance(name, str) and name:
        found.add(name)
    if isinstance(event, events.ReplicaPlaced):
        found.update(s.node for s in event.shards)
    return found


def replicas_of(event: events.Event) -> set[str]:
    """Every replica the event is about (a replacement names the replica it replaces)."""
    found: set[str] = set()
    rid = getattr(event, "replica_id", None)
    if isinstance(rid, str) and rid:
        found.add(rid)
    if isinstance(event, events.ReplicaPlaced) and event.replaces:
        found.add(event.replaces)
    if isinstance(event, events.NodeRegistered):
        found.update(s.replica_id for s in event.shards)
    return found


def model_of(event: events.Event) -> str:
    """The model the event is about, if it names one."""
    model = getattr(event, "model", None)
    if isinstance(model, str):
        return model
    profile = getattr(event, "profile", None)
    if profile is not None:
        return str(profile.name)
    return event.name if isinstance(event, events.ModelRemoved) else ""


def touches(event: events.Event, target: str, subject: str = "") -> bool:
    return target in nodes_of(event, subject) or target in replicas_of(event)


class Timeline:
    """Which events of a log touch a node, a replica or a model (a model's replicas too,
    known from their placements as the log is read in order)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.replicas: set[str] = set()

    def touches(self, event: events.Event, subject: str = "") -> bool:
        if model_of(event) == self.target:
            if isinstance(event, events.ReplicaPlaced):
                self.replicas.add(event.replica_id)
            return True
        return touches(event, self.target, subject) or bool(replicas_of(event) & self.replicas)


def matches(event: events.Event, type_filter: str) -> bool:
    """`--type`: a whole tag (`node.shard`), a family (`operator`), or a tag's kind (`shard`)."""
    return matches_tag(events.tag_of(type(event)), type_filter)


def matches_tag(tag: str, type_filter: str) -> bool:
    family_, _, kind = tag.partition(".")
    return type_filter in (tag, family_, kind) or tag.startswith(type_filter.rstrip(".") + ".")

"""Models declared in the control plane's config file, turned into operator events.

At start (when it becomes leader) the control plane compares the models its
config lists with those folded from the log and publishes the difference:
ModelDeclared for a new name, ModelChanged for a changed profile, ModelRemoved
for a model this config declared earlier and no longer lists. A restart with
the same file therefore writes nothing. Models an operator declared with
`llmgw ctl` are never removed by this: only those whose last declaration came
from a config file, recognised by the `config-` prefix of the event id.

Purely computational; the service (llmgw.control.service) reads the operator
events and publishes what `diff` returns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from llmgw.core import events
from llmgw.core.profile import ModelProfile
from llmgw.core.state import ClusterState

ID_PREFIX = "config-"

ModelEvent = events.ModelDeclared | events.ModelChanged | events.ModelRemoved


def managed(records: Iterable[events.Event]) -> set[str]:
    """Names of models whose last declaration in `records` came from a config file. Pure."""
    out: set[str] = set()
    for event in records:
        match event:
            case events.ModelDeclared() | events.ModelChanged():
                if event.id.startswith(ID_PREFIX):
                    out.add(event.profile.name)
                else:
                    out.discard(event.profile.name)
            case events.ModelRemoved():
                out.discard(event.name)
    return out


def diff(
    wanted: Sequence[ModelProfile],
    state: ClusterState,
    config_managed: set[str],
    *,
    operator: str,
    now: float,
    basis_seq: int,
    ids: Callable[[str], str] | None = None,
) -> list[ModelEvent]:
    """The events that make the log's catalog match `wanted`. Pure.

    Base ids are `config-<operator>-<basis_seq>-<i>`; `ids` turns each into the id
    written (the service appends 128 random bits, so that no other writer can
    pre-publish it and have it dropped as a duplicate). A second control plane
    syncing the same file is harmless: declaring a model again with the same
    profile changes nothing in the fold.
    """
    out: list[ModelEvent] = []

    def next_id() -> str:
        base = f"{ID_PREFIX}{operator}-{basis_seq}-{len(out)}"
        return base if ids is None else ids(base)

    names = {p.name for p in wanted}
    for name in sorted(config_managed - names):
        if name in state.models:
            out.append(events.ModelRemoved(id=next_id(), ts=now, operator=operator, name=name))
    for profile in wanted:
        current = state.models.get(profile.name)
        if current is None:
            out.append(
                events.ModelDeclared(id=next_id(), ts=now, operator=operator, profile=profile)
            )
        elif current.profile != profile:
            out.append(
                events.ModelChanged(id=next_id(), ts=now, operator=operator, profile=profile)
            )
    return out

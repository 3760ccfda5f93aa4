"""models.yaml for `llmgw ctl apply -f`: parse, validate with the catalog, diff against the fleet.

The file lists model profiles (the fields of `llmgw.core.profile.ModelProfile`),
either as a top-level list or under `models:`. It is the desired catalog: a model
in it and not in the log is declared, one whose profile differs is changed, and
(unless `--no-prune`) a declared model missing from it is removed. Every entry is
validated with `llmgw.core.catalog` before anything is written, so a malformed
file is refused as a whole with a message naming the entry and what to change.

Computational but for `read`, which reads the file (the caller publishes the events).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml

from llmgw import config
from llmgw.core import catalog
from llmgw.core.profile import ModelProfile
from llmgw.core.state import ModelState
from llmgw.ctl.errors import BadInput

Action = Literal["declare", "change", "remove"]


class ModelOp(msgspec.Struct, frozen=True, kw_only=True):
    action: Action
    name: str
    profile: ModelProfile | None = None
    changes: tuple[str, ...] = ()
    """For `change`: `field: before -> after`, one per field."""

    def render(self) -> str:
        if self.action == "declare":
            assert self.profile is not None
            p = self.profile
            return (
                f"+ declare {self.name}: {p.replicas} x {p.engine} {p.engine_model} "
                f"({p.gpus_per_replica} GPU{'s' if p.gpus_per_replica != 1 else ''}"
                f"{' ' + p.gpu_class if p.gpu_class else ''})"
            )
        if self.action == "remove":
            return f"- remove {self.name} (its replicas are stopped)"
        lines = [f"~ change {self.name}"]
        lines += [f"    {c}" for c in self.changes]
        return "\n".join(lines)


def read(path: Path) -> list[ModelProfile]:
    """The profiles in the models.yaml at `path`; BadInput when unreadable or malformed."""
    try:
        text = config.read_text(path, "models file")
    except config.ConfigError as exc:
        raise BadInput(str(exc)) from None
    return parse(text, str(path))


def parse(text: str, where: str) -> list[ModelProfile]:
    """The profiles in a models.yaml text; BadInput (one line, what to change) when malformed."""
    try:
        data = config.parse_yaml(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise BadInput(f"{where} is not valid YAML{at}: {problem}; fix the file") from None
    if isinstance(data, Mapping) and "models" in data:
        extra = sorted(set(data) - {"models"})
        if extra:
            raise BadInput(
                f"{where}: unknown top-level key(s) {', '.join(map(str, extra))}: only `models:` "
                "(a list of model profiles) is read"
            )
        data = data["models"]
    if data is None:
        data = []
    if not isinstance(data, list):
        raise BadInput(
            f"{where} must hold a list of model profiles (or `models:` with one), "
            f"not a {type(data).__name__}"
        )
    profiles: list[ModelProfile] = []
    owners: dict[str, ModelProfile] = {}
    """Every name and alias of the entries so far -> its model (`catalog.sharing`)."""
    for i, raw in enumerate(data):
        if not isinstance(raw, Mapping):
            raise BadInput(
                f"{where}: entry {i} is a {type(raw).__name__}, not a mapping of profile fields "
                "(name, engine, replicas, ...)"
            )
        if not isinstance(raw.get("name"), str) or not raw.get("name"):
            raise BadInput(f"{where}: entry {i} has no `name`: give every model its served name")
        owner = owners.get(raw["name"])
        if owner is not None and owner.name == raw["name"]:
            raise BadInput(
                f"{where}: model {raw['name'][:80]!r} is listed twice: merge the entries"
            )
        try:
            profile = catalog.parse(raw, catalog.sharing(_names(raw), owners))
        except catalog.CatalogError as exc:
            raise BadInput(f"{where}: entry {i}: {exc}") from None
        profiles.append(profile)
        for name in catalog.names_of(profile):
            owners.setdefault(name, profile)
    return profiles


def _names(raw: Mapping[str, Any]) -> list[str]:
    """The names an entry claims, as far as its raw mapping says (the profile checks them)."""
    aliases = raw.get("aliases")
    listed = aliases if isinstance(aliases, list) else []
    return [raw["name"], *(a for a in listed if isinstance(a, str))]


def _describe_changes(before: ModelProfile, after: ModelProfile) -> tuple[str, ...]:
    a: dict[str, Any] = msgspec.to_builtins(before)
    b: dict[str, Any] = msgspec.to_builtins(after)
    return tuple(
        f"{name}: {a.get(name)!r} -> {b.get(name)!r}"
        for name in sorted(set(a) | set(b))
        if a.get(name) != b.get(name)
    )


def plan(
    current: Mapping[str, ModelState], wanted: list[ModelProfile], *, prune: bool = True
) -> list[ModelOp]:
    """What applying `wanted` to the declared models does: declares, changes, removals."""
    ops: list[ModelOp] = []
    names = {p.name for p in wanted}
    for p in wanted:
        have = current.get(p.name)
        if have is None:
            ops.append(ModelOp(action="declare", name=p.name, profile=p))
        elif have.profile != p:
            changes = _describe_changes(have.profile, p)
            note = "" if catalog.launch_relevant(have.profile, p) else " (no restart needed)"
            ops.append(
                ModelOp(
                    action="change",
                    name=p.name,
                    profile=p,
                    changes=changes + ((note.strip(),) if note else ()),
                )
            )
    if prune:
        for name in sorted(current):
            if name not in names:
                ops.append(ModelOp(action="remove", name=name))
    # Removals first: a renamed model's alias must be free before the new one claims it.
    return sorted(ops, key=lambda o: (o.action != "remove", o.action, o.name))

"""Simulated inventories: GPUs that do not exist, for tests and the embedded `llmgw up`.

`8xh100-80g` or `8xh100-80g,2xl40s-45g` names GPUs by count and class; a YAML or
JSON file gives them field by field (the shape of `Inventory`). Each group of
a spec shares one NVLink domain, like the GPUs of one HGX board. Pure except
`load`, which reads the file.
"""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import yaml

from llmgw import config
from llmgw.core.inventory import Gpu, Inventory, gpu_class
from llmgw.core.limits import MAX_GPUS

_GROUP = re.compile(r"^(\d+)\s*x\s*([a-z0-9]+)-(\d+)g$")

# Compute capabilities of the classes people simulate (NVIDIA's published values);
# a family missing here gets "9.0", so a simulated fleet does not refuse fp8 by surprise.
_CAPABILITY = {
    "v100": "7.0",
    "t4": "7.5",
    "a100": "8.0",
    "a10": "8.6",
    "a10g": "8.6",
    "a40": "8.6",
    "l4": "8.9",
    "l40": "8.9",
    "l40s": "8.9",
    "rtx4090": "8.9",
    "rtx6000ada": "8.9",
    "h100": "9.0",
    "h200": "9.0",
    "gh200": "9.0",
    "b200": "10.0",
}


class SimSpecError(ValueError):
    """A simulated inventory that cannot be read; the message says the expected form."""


def parse_spec(spec: str) -> tuple[Gpu, ...]:
    """'8xh100-80g[,NxCLASS...]' -> GPUs. Purely computational, no side effects."""
    gpus: list[Gpu] = []
    for domain, group in enumerate(part.strip().lower() for part in spec.split(",")):
        match = _GROUP.match(group)
        if not match:
            raise SimSpecError(
                f"simulated GPUs {group!r}: write COUNTxCLASS such as '8xh100-80g' "
                "(several groups separated by commas), or give a YAML/JSON file"
            )
        count, family, gib = int(match.group(1)), match.group(2), int(match.group(3))
        if not 1 <= count <= 64:
            raise SimSpecError(f"simulated GPUs {group!r}: count must be 1-64")
        if len(gpus) + count > MAX_GPUS:
            raise _too_many(f"simulated GPUs {spec[:40]!r}...")
        name = f"Simulated {family.upper()}"
        memory_mib = gib * 1024
        for _ in range(count):
            index = len(gpus)
            gpus.append(
                Gpu(
                    index=index,
                    uuid=f"GPU-sim-{index:04d}-{family}-{gib}g",
                    name=name,
                    gpu_class=gpu_class(family, memory_mib),
                    memory_mib=memory_mib,
                    compute_capability=_CAPABILITY.get(family, "9.0"),
                    nvlink_domain=domain if count > 1 else None,
                )
            )
    return tuple(gpus)


def load(source: str) -> Inventory:
    """A spec string, or a path to a YAML/JSON file with `gpus:` (and optional `hcas:`)."""
    path = Path(source)
    if not (path.suffix.lower() in {".yaml", ".yml", ".json"} or _is_file(path)):
        return Inventory(gpus=parse_spec(source))
    try:
        data = config.parse_yaml(config.read_text(path, "simulated inventory"))
    except config.ConfigError as exc:
        raise SimSpecError(str(exc)) from None
    except yaml.YAMLError as exc:
        raise SimSpecError(f"simulated inventory {path} is not YAML/JSON: {exc}") from None
    try:
        inventory = msgspec.convert(data or {}, Inventory)
    except msgspec.ValidationError as exc:
        raise SimSpecError(
            f"simulated inventory {path}: {exc} (expected `gpus:` as a list of "
            "index/uuid/name/gpu_class/memory_mib/compute_capability)"
        ) from None
    if len(inventory.gpus) > MAX_GPUS:
        raise _too_many(f"simulated inventory {path}")
    return inventory


def _too_many(what: str) -> SimSpecError:
    return SimSpecError(
        f"{what}: a node has at most {MAX_GPUS} GPUs (its events carry no more): list fewer"
    )


def _is_file(path: Path) -> bool:
    """Whether `path` names a file; a spec too long for a file name (ENAMETOOLONG) is none."""
    try:
        return path.is_file()
    except OSError:
        return False

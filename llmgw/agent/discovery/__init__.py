"""What a GPU node has, as the scheduler will see it: GPUs, NVLink domains, RDMA adapters.

`discover` assembles an `Inventory` from NVML (falling back to nvidia-smi with a
warning), `/sys/class/infiniband`, and the fabrics the operator declared; or
from a simulated inventory. The agent service calls it at start and puts the
result in NodeRegistered; `llmgw agent inventory` prints it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Literal

import msgspec

from llmgw import logs
from llmgw.agent.discovery import infiniband, nvml, simulated, smi
from llmgw.core.inventory import Fabric, FabricKind, Gpu, Hca, Inventory

GpuSource = Literal["nvml", "nvidia-smi", "simulated"]

log = logs.get("llmgw.agent.discovery")


class DiscoveryError(RuntimeError):
    """Neither NVML nor nvidia-smi could list the GPUs."""


class GpuDiscovery(msgspec.Struct, frozen=True, kw_only=True):
    gpus: tuple[Gpu, ...]
    source: GpuSource
    warnings: tuple[str, ...] = ()


class Discovery(msgspec.Struct, frozen=True, kw_only=True):
    """An inventory plus how it was obtained and what went wrong on the way."""

    inventory: Inventory
    source: GpuSource
    warnings: tuple[str, ...] = ()
    hcas_simulated: bool = False
    """The HCAs came from a simulated inventory, not sysfs: there is nothing to re-read."""


def discover_gpus(
    *,
    own_pids: frozenset[int] = frozenset(),
    own_gpus: frozenset[int] = frozenset(),
    nvml_module: Callable[[], ModuleType] = nvml.load,
    smi_discover: Callable[..., tuple[tuple[Gpu, ...], list[str]]] = smi.discover,
) -> GpuDiscovery:
    """GPUs from NVML, else from nvidia-smi with a logged warning, else DiscoveryError.

    The fallback is loud on purpose: on a node meant to have working NVML, a quiet
    downgrade hides a broken driver and costs the scheduler its NVLink topology.
    """
    notes: list[str] = []
    try:
        gpus = nvml.read_gpus(nvml_module(), own_pids=own_pids, own_gpus=own_gpus, warnings=notes)
    except nvml.NvmlError as exc:
        reason = str(exc)
    else:
        for note in notes:
            log.warning("gpu_left_out", detail=note)
        return GpuDiscovery(gpus=gpus, source="nvml", warnings=tuple(notes))
    warning = f"NVML failed ({reason}); falling back to nvidia-smi"
    log.warning("nvml_failed_falling_back_to_nvidia_smi", reason=reason)
    try:
        gpus, more = smi_discover(own_pids=own_pids, own_gpus=own_gpus)
    except smi.SmiError as exc:
        raise DiscoveryError(
            f"no GPUs could be listed: NVML failed ({reason}) and nvidia-smi failed ({exc}). "
            "Check the NVIDIA driver (`nvidia-smi` must work), or run with --sim-gpus"
        ) from None
    for note in more:
        log.warning("nvidia_smi_partial", detail=note)
    return GpuDiscovery(gpus=gpus, source="nvidia-smi", warnings=(warning, *more))


def fabric_problem(hca_names: Iterable[str], hcas: Iterable[Hca]) -> str | None:
    """Why a declared fabric must not be advertised, or None when it can carry a replica.

    Every declared adapter must be present with a port up, and the ports up must be
    of one kind: a replica placed across nodes on a fabric that is not there hangs
    on its first all-reduce, and NCCL does not cross between InfiniBand and RoCE.
    Purely computational.
    """
    names = tuple(hca_names)
    ports: dict[str, list[Hca]] = {name: [] for name in names}
    for hca in hcas:
        if hca.name in ports:
            ports[hca.name].append(hca)
    missing = [name for name in names if not ports[name]]
    if missing:
        return f"HCA {', '.join(missing)} not present"
    down = [name for name in names if not any(h.state.upper() == "ACTIVE" for h in ports[name])]
    if down:
        return f"no port of {', '.join(down)} is ACTIVE"
    kinds = {h.kind for name in names for h in ports[name] if h.state.upper() == "ACTIVE"}
    if len(kinds) > 1:
        return "it mixes InfiniBand and RoCE ports"
    return None


def fabric_kind(hca_names: Iterable[str], hcas: Iterable[Hca]) -> FabricKind:
    """The kind of a usable fabric's ports that are up (see `fabric_problem`)."""
    names = set(hca_names)
    layers = {h.kind for h in hcas if h.name in names and h.state.upper() == "ACTIVE"}
    return "roce" if layers == {"roce"} else "infiniband"


def fabrics(
    declared: Iterable[tuple[str, tuple[str, ...]]],
    hcas: tuple[Hca, ...],
    warnings: list[str] | None = None,
) -> tuple[Fabric, ...]:
    """The declared fabrics this node can use now, with their kind; the operator declares
    them (the wire does not say), discovery decides whether each is there. Each one
    left out gets a line in `warnings`. Purely computational."""
    out: list[Fabric] = []
    for name, names in declared:
        problem = fabric_problem(names, hcas)
        if problem is None:
            out.append(Fabric(name=name, kind=fabric_kind(names, hcas), hcas=names))
        elif warnings is not None:
            warnings.append(
                f'fabric "{name}" is not advertised to the scheduler: {problem}; '
                "this node serves single-node replicas until it is (`ibstat`)"
            )
    return tuple(out)


def discover(
    *,
    sim_gpus: str = "",
    infiniband_root: str | Path = infiniband.DEFAULT_ROOT,
    declared_fabrics: Iterable[tuple[str, tuple[str, ...]]] = (),
    own_pids: frozenset[int] = frozenset(),
    own_gpus: frozenset[int] = frozenset(),
    nvml_module: Callable[[], ModuleType] = nvml.load,
    smi_discover: Callable[..., tuple[tuple[Gpu, ...], list[str]]] = smi.discover,
) -> Discovery:
    """The node's whole inventory; a simulated one replaces the GPUs (and HCAs if it has any)."""
    notes: list[str] = []
    if sim_gpus:
        sim = simulated.load(sim_gpus)
        hcas = sim.hcas or infiniband.read_hcas(infiniband_root)
        usable = fabrics(declared_fabrics, hcas, notes)
        return Discovery(
            inventory=Inventory(gpus=sim.gpus, hcas=hcas, fabrics=usable),
            source="simulated",
            warnings=tuple(notes),
            hcas_simulated=bool(sim.hcas),
        )
    found = discover_gpus(
        own_pids=own_pids, own_gpus=own_gpus, nvml_module=nvml_module, smi_discover=smi_discover
    )
    hcas = infiniband.read_hcas(infiniband_root)
    usable = fabrics(declared_fabrics, hcas, notes)
    return Discovery(
        inventory=Inventory(gpus=found.gpus, hcas=hcas, fabrics=usable),
        source=found.source,
        warnings=(*found.warnings, *notes),
    )

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


def discover_gpus(
    *,
    own_pids: frozenset[int] = frozenset(),
    nvml_module: Callable[[], ModuleType] = nvml.load,
    smi_discover: Callable[..., tuple[tuple[Gpu, ...], list[str]]] = smi.discover,
) -> GpuDiscovery:
    """GPUs from NVML, else from nvidia-smi with a logged warning, else DiscoveryError.

    The fallback is loud on purpose: on a node meant to have working NVML, a quiet
    downgrade hides a broken driver and costs the scheduler its NVLink topology.
    """
    notes: list[str] = []
    try:
        gpus = nvml.read_gpus(nvml_module(), own_pids=own_pids, warnings=notes)
    except nvml.NvmlError as exc:
        reason = str(exc)
    else:
        for note in notes:
            log.warning("gpu_left_out", detail=note)
        return GpuDiscovery(gpus=gpus, source="nvml", warnings=tuple(notes))
    warning = f"NVML failed ({reason}); falling back to nvidia-smi"
    log.warning("nvml_failed_falling_back_to_nvidia_smi", reason=reason)
    try:
        gpus, more = smi_discover(own_pids=own_pids)
    except smi.SmiError as exc:
        raise DiscoveryError(
            f"no GPUs could be listed: NVML failed ({reason}) and nvidia-smi failed ({exc}). "
            "Check the NVIDIA driver (`nvidia-smi` must work), or run with --sim-gpus"
        ) from None
    for note in more:
        log.warning("nvidia_smi_partial", detail=note)
    return GpuDiscovery(gpus=gpus, source="nvidia-smi", warnings=(warning, *more))


def fabric_kind(hca_names: Iterable[str], hcas: Iterable[Hca]) -> FabricKind:
    """RoCE when every seen port of the fabric's adapters runs over Ethernet, else InfiniBand."""
    names = set(hca_names)
    layers = {h.kind for h in hcas if h.name in names}
    return "roce" if layers == {"roce"} else "infiniband"


def fabrics(
    declared: Iterable[tuple[str, tuple[str, ...]]], hcas: tuple[Hca, ...]
) -> tuple[Fabric, ...]:
    """Fabric labels with their kind; the operator declares them: the wire does not say."""
    return tuple(
        Fabric(name=name, kind=fabric_kind(names, hcas), hcas=names) for name, names in declared
    )


def discover(
    *,
    sim_gpus: str = "",
    infiniband_root: str | Path = infiniband.DEFAULT_ROOT,
    declared_fabrics: Iterable[tuple[str, tuple[str, ...]]] = (),
    own_pids: frozenset[int] = frozenset(),
    nvml_module: Callable[[], ModuleType] = nvml.load,
    smi_discover: Callable[..., tuple[tuple[Gpu, ...], list[str]]] = smi.discover,
) -> Discovery:
    """The node's whole inventory; a simulated one replaces the GPUs (and HCAs if it has any)."""
    if sim_gpus:
        sim = simulated.load(sim_gpus)
        hcas = sim.hcas or infiniband.read_hcas(infiniband_root)
        return Discovery(
            inventory=Inventory(gpus=sim.gpus, hcas=hcas, fabrics=fabrics(declared_fabrics, hcas)),
            source="simulated",
        )
    found = discover_gpus(own_pids=own_pids, nvml_module=nvml_module, smi_discover=smi_discover)
    hcas = infiniband.read_hcas(infiniband_root)
    return Discovery(
        inventory=Inventory(gpus=found.gpus, hcas=hcas, fabrics=fabrics(declared_fabrics, hcas)),
        source=found.source,
        warnings=found.warnings,
    )

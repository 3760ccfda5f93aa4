"""A GPU node's hardware inventory as the scheduler sees it.

The agent's discovery fills these from NVML, nvidia-smi and /sys/class/infiniband
(or a simulated inventory); NodeRegistered carries them into the log; placement
reads them from the folded state. Pure data plus the GPU class rule.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec

from llmgw.core.limits import (
    Counter,
    GpuIndex,
    HcaName,
    HcaNames,
    MemoryMib,
    Name,
    Rate,
    SmallInt,
)

FabricKind = Literal["infiniband", "roce"]

_MIB_PER_GIB = 1024

# Words in NVML product names that say who made the card or which line it belongs
# to, not what it is: "NVIDIA GeForce RTX 4080 SUPER" and "RTX 4080 SUPER" are one class.
_VENDOR_WORDS = frozenset({"nvidia", "tesla", "geforce", "quadro", "grid"})
# Words that begin the memory / form-factor tail of a product name ("80GB HBM3",
# "PCIe", "SXM4-80GB", "NVL"); the class carries memory separately, from the driver.
# The edition of a workstation card ("Max-Q Workstation Edition", "Server Edition")
# ends it too: otherwise three editions of one RTX PRO 6000, with the same memory,
# would be three classes, each with a name as long as the product's.
_TAIL = re.compile(
    r"^(\d+gb|pcie|sxm\d*|hbm\d*e?|nvl|mig|generation|with|max|workstation"
    r"|server|edition)$",
    re.IGNORECASE,
)
# The profile of a vGPU, hyphenated to the board's name ("NVIDIA H200-141C", "GRID
# T4-16Q": framebuffer GB and a series letter): kept, it would make `h200141c-141g`.
_VGPU_PROFILE = re.compile(r"(?<=\w)-\d+[a-z]{1,2}\b", re.IGNORECASE)


class Gpu(msgspec.Struct, frozen=True, kw_only=True):
    """One GPU of a node, with the health flags that exclude it from placement."""

    index: GpuIndex
    uuid: Name
    name: Name
    gpu_class: Name
    memory_mib: MemoryMib
    compute_capability: Annotated[str, msgspec.Meta(max_length=16)]
    nvlink_domain: SmallInt | None = None
    """GPUs of one node with the same domain share NVLink; None: PCIe only."""
    ecc_uncorrected: Counter = 0
    """Uncorrected (volatile) ECC errors: a GPU with any is not given new work."""
    foreign_memory_mib: MemoryMib = 0
    """Memory held by processes that are not this agent's engines, including memory
    the driver reports used that no visible process accounts for (containers, vGPU guests)."""
    remap_pending: bool = False
    """A row remap is recorded but not applied: the faulty row stays in use until a GPU reset."""
    remap_failed: bool = False
    """Row remapping failed (no spare rows left): the GPU needs service."""

    @property
    def health_problems(self) -> tuple[str, ...]:
        """Why this GPU must not receive a shard; empty when it is healthy."""
        problems: list[str] = []
        if self.ecc_uncorrected > 0:
            problems.append(f"uncorrected ECC errors ({self.ecc_uncorrected})")
        if self.foreign_memory_mib > 0:
            problems.append(f"{self.foreign_memory_mib} MiB held by a foreign process")
        if self.remap_pending:
            problems.append("row remap pending (reset the GPU to apply it)")
        if self.remap_failed:
            problems.append("row remapping failed (the GPU needs service)")
        return tuple(problems)

    @property
    def healthy(self) -> bool:
        return not self.health_problems


class Hca(msgspec.Struct, frozen=True, kw_only=True):
    """One RDMA adapter port as /sys/class/infiniband reports it."""

    name: HcaName
    port: SmallInt = 1
    state: Name = "ACTIVE"
    rate_gbps: Rate = 0.0
    link_layer: Name = "InfiniBand"

    @property
    def kind(self) -> FabricKind:
        return "roce" if self.link_layer.lower() == "ethernet" else "infiniband"


class Fabric(msgspec.Struct, frozen=True, kw_only=True):
    """An RDMA fabric a node is attached to: nodes sharing a fabric name can run one replica."""

    name: Name
    kind: FabricKind = "infiniband"
    hcas: HcaNames = ()


class Inventory(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a node has that placement needs."""

    gpus: tuple[Gpu, ...] = ()
    fabrics: tuple[Fabric, ...] = ()
    hcas: tuple[Hca, ...] = ()


def gib_from_mib(memory_mib: float) -> int:
    """Whole GiB, rounded half up (never banker's rounding: 22.5 must not become 22)."""
    return int(memory_mib / _MIB_PER_GIB + 0.5)


def gpu_family(name: str) -> str:
    """The model part of an NVML product name: 'NVIDIA H100 80GB HBM3' -> 'h100'."""
    words: list[str] = []
    for word in re.split(r"[\s_-]+", _VGPU_PROFILE.sub(" ", name.strip())):
        if not word or word.lower() in _VENDOR_WORDS:
            continue
        if _TAIL.match(word):
            break
        words.append(re.sub(r"[^a-z0-9]", "", word.lower()))
    return "".join(words) or "gpu"


def gpu_class(name: str, memory_mib: float) -> str:
    """The placement class of a GPU: family and memory in GiB as the driver reports it.

    An L40S is sold as 48 GB but reports 44.99 GiB, so it is `l40s-45g`: the
    number decides whether a model fits, so it must be the driver's, not the box's.
    """
    return f"{gpu_family(name)}-{gib_from_mib(memory_mib)}g"

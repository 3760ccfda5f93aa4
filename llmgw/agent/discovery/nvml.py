"""GPU discovery through NVML (pynvml): the primary source, and the only one with NVLink peers.

`read_gpus` takes the NVML module as an argument so that tests drive it with a
fake module holding recorded values; `load` imports the real pynvml. CI has no
GPU: there the fake replays NVML's answers recorded on an H200 by
`tests/gpu/record_discovery.py`, which also checks, on a real node, that NVML and
nvidia-smi give the same GPUs. Used by `llmgw.agent.discovery.discover_gpus`.
"""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType
from typing import Any

import msgspec

from llmgw.agent.discovery.memory import foreign_mib
from llmgw.agent.discovery.smi import nvlink_domains, within_bounds
from llmgw.core.inventory import Gpu, gpu_class

_MIB = 1024 * 1024


class NvmlError(RuntimeError):
    """NVML could not be loaded or initialised, or a required query failed."""


def load() -> ModuleType:
    """Import pynvml (from `nvidia-ml-py`, NVIDIA's binding; a leftover PyPI `pynvml` wrapper
    warns on import that it is deprecated)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        try:
            return importlib.import_module("pynvml")
        except ImportError as exc:
            raise NvmlError(f"pynvml is not installed ({exc}): pip install nvidia-ml-py") from None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _optional(nv: Any, fn: Any, *args: Any, default: Any = None) -> Any:
    """Call an NVML query that a GPU may not support (ECC on consumer cards, processes)."""
    try:
        return fn(*args)
    except nv.NVMLError:
        return default


def read_gpus(
    nv: Any,
    *,
    own_pids: frozenset[int] = frozenset(),
    own_gpus: frozenset[int] = frozenset(),
    warnings: list[str] | None = None,
) -> tuple[Gpu, ...]:
    """Every GPU with its health flags and NVLink domain, read through the module `nv`.

    NVLink domains come from pairwise P2P status over NVLink, which is true both
    for direct links and through NVSwitch (HGX boards), so one query covers both.
    GPUs in MIG mode are left out, with a line in `warnings`: llmgw places whole
    GPUs by index, and a MIG-enabled GPU is reachable only through MIG UUIDs.
    Foreign memory follows `llmgw.agent.discovery.memory` (`own_gpus`: the GPUs
    our engines hold).
    """
    try:
        nv.nvmlInit()
    except nv.NVMLError as exc:
        raise NvmlError(f"nvmlInit failed: {exc}") from None
    try:
        count = int(nv.nvmlDeviceGetCount())
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        domains = nvlink_domains(_nvlinks(nv, handles))
        gpus = []
        for i, handle in enumerate(handles):
            name = _text(nv.nvmlDeviceGetName(handle))
            mig = _optional(nv, nv.nvmlDeviceGetMigMode, handle, default=(0, 0))
            if mig[0] == nv.NVML_DEVICE_MIG_ENABLE:
                if warnings is not None:
                    warnings.append(
                        f"GPU {i} ({name}) has MIG enabled and is left out: llmgw places whole "
                        f"GPUs; disable MIG (`nvidia-smi -i {i} -mig 0`) to use it"
                    )
                continue
            try:
                gpu = _gpu(nv, i, handle, name, domains.get(i), own_pids, i in own_gpus)
                gpus.append(within_bounds(gpu))
            except (OverflowError, msgspec.ValidationError) as exc:
                # A GPU out of the log's bounds would make every reader refuse the
                # node's registration; nvidia-smi, asked next, reads the same driver.
                raise NvmlError(
                    f"GPU {i} ({name}) reads out of range ({exc}): check it "
                    f"(`nvidia-smi -q -i {i}`)"
                ) from None
        return tuple(gpus)
    except nv.NVMLError as exc:
        raise NvmlError(f"NVML query failed: {exc}") from None
    except AttributeError as exc:
        raise NvmlError(
            f"this pynvml lacks a call llmgw needs ({exc}): upgrade nvidia-ml-py"
        ) from None
    finally:
        _optional(nv, nv.nvmlShutdown)


def _nvlinks(nv: Any, handles: list[Any]) -> dict[int, set[int]]:
    """Each GPU's NVLink peers, from pairwise P2P status (direct links and NVSwitch alike)."""
    count = len(handles)
    links: dict[int, set[int]] = {i: set() for i in range(count)}
    for i in range(count):
        for j in range(i + 1, count):
            status = _optional(
                nv,
                nv.nvmlDeviceGetP2PStatus,
                handles[i],
                handles[j],
                nv.NVML_P2P_CAPS_INDEX_NVLINK,
                default=-1,
            )
            if status == nv.NVML_P2P_STATUS_OK:
                links[i].add(j)
                links[j].add(i)
    return links


def _gpu(
    nv: Any,
    i: int,
    handle: Any,
    name: str,
    domain: int | None,
    own_pids: frozenset[int],
    ours: bool,
) -> Gpu:
    """One whole GPU's size, capability and health, read through `nv`."""
    memory = nv.nvmlDeviceGetMemoryInfo(handle)
    memory_mib = int(memory.total) / _MIB
    major, minor = nv.nvmlDeviceGetCudaComputeCapability(handle)
    ecc = _optional(
        nv,
        nv.nvmlDeviceGetTotalEccErrors,
        handle,
        nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        nv.NVML_VOLATILE_ECC,
        default=0,
    )
    foreign = _foreign_mib(nv, handle, int(memory.used) / _MIB, own_pids, ours)
    # (corrected rows, uncorrected rows, pending, failure); absent on boards
    # without row remapping (before Ampere, consumer cards): nothing to report.
    remap = _optional(nv, nv.nvmlDeviceGetRemappedRows, handle, default=None)
    pending, failed = (bool(remap[2]), bool(remap[3])) if remap else (False, False)
    return Gpu(
        index=i,
        uuid=_text(nv.nvmlDeviceGetUUID(handle)),
        name=name,
        gpu_class=gpu_class(name, memory_mib),
        memory_mib=int(memory_mib),
        compute_capability=f"{int(major)}.{int(minor)}",
        nvlink_domain=domain,
        ecc_uncorrected=int(ecc or 0),
        foreign_memory_mib=foreign,
        remap_pending=pending,
        remap_failed=failed,
    )


def _foreign_mib(
    nv: Any, handle: Any, used_mib: float, own_pids: frozenset[int], ours: bool
) -> int:
    """Memory on the GPU held by no engine of ours (`llmgw.agent.discovery.memory`)."""
    # Compute processes only, as nvidia-smi --query-compute-apps: a display
    # server's few MiB on a workstation card are not another tenant's job.
    processes = _optional(nv, nv.nvmlDeviceGetComputeRunningProcesses, handle, default=[])
    # usedGpuMemory is None where the driver may not say (some vGPU setups):
    # such a process still makes the GPU busy, so it counts as at least 1 MiB.
    listed = [(int(p.pid), max(1, int(p.usedGpuMemory or 0) // _MIB)) for p in processes]
    # ...but a visible desktop's memory is accounted for, not unseen.
    graphics = _optional(nv, nv.nvmlDeviceGetGraphicsRunningProcesses, handle, default=[])
    return foreign_mib(
        used_mib=used_mib,
        processes=listed,
        own_pids=own_pids,
        ours=ours,
        seen_elsewhere_mib=sum(int(p.usedGpuMemory or 0) // _MIB for p in graphics),
    )

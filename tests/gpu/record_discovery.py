"""Run GPU discovery on a real NVIDIA node and record what the driver said.

    python tests/gpu/record_discovery.py OUT_DIR

Nothing in CI has a GPU, so the unit tests drive NVML through a fake module and
nvidia-smi through a script that prints recorded files. This script is how those
recordings are made, and how a node's driver is checked against llmgw's parsers:

1. records, at one moment, the raw answers of every nvidia-smi command discovery
   runs (and `-L`, `-q`) and the NVML values `nvml.read_gpus` reads, as JSON in
   the shape of the unit tests' FakeNvml;
2. runs `discover_gpus` through the real pynvml, and `smi.discover` through the
   real nvidia-smi, and reports where the two disagree;
3. when PyTorch is installed, does both again while another process holds GPU
   memory, so the foreign-memory check runs against a real driver: it must see
   that process, and must not once its pid is declared our own.

It changes nothing on the GPU and exits 1 if the two sources disagree.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402

from llmgw.agent import discovery  # noqa: E402
from llmgw.agent.discovery import nvml, smi  # noqa: E402

HOLD_MIB = 2048
COMMANDS = {
    "query.csv": smi.QUERY_GPUS,
    "apps.csv": smi.QUERY_APPS,
    "topo.txt": smi.TOPOLOGY,
    "L.txt": ("nvidia-smi", "-L"),
    "q.txt": ("nvidia-smi", "-q"),
}


def record_smi(out: Path, tag: str) -> dict[str, str]:
    texts = {}
    for name, argv in COMMANDS.items():
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        text = done.stdout if done.returncode == 0 else f"# exit {done.returncode}\n{done.stderr}"
        (out / f"{tag}.{name}").write_text(text)
        texts[name] = text
    return texts


def record_nvml() -> dict[str, Any]:
    """The values read_gpus reads, in the unit tests' FakeNvml shape."""
    nv = nvml.load()
    nv.nvmlInit()
    try:
        gpus = []
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        nvlink = []
        for i, a in enumerate(handles):
            for j in range(i + 1, len(handles)):
                status = nv.nvmlDeviceGetP2PStatus(a, handles[j], nv.NVML_P2P_CAPS_INDEX_NVLINK)
                if status == nv.NVML_P2P_STATUS_OK:
                    nvlink.append([i, j])
        for h in handles:
            gpu: dict[str, Any] = {
                "name": nvml._text(nv.nvmlDeviceGetName(h)),
                "uuid": nvml._text(nv.nvmlDeviceGetUUID(h)),
                "total": int(nv.nvmlDeviceGetMemoryInfo(h).total),
                "cc": list(nv.nvmlDeviceGetCudaComputeCapability(h)),
            }
            try:
                gpu["mig"] = nv.nvmlDeviceGetMigMode(h)[0] == nv.NVML_DEVICE_MIG_ENABLE
            except nv.NVMLError as exc:
                gpu["mig_error"] = str(exc)
            try:
                gpu["ecc"] = int(
                    nv.nvmlDeviceGetTotalEccErrors(
                        h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
                    )
                )
            except nv.NVMLError as exc:
                gpu["ecc_error"] = str(exc)
            gpu["procs"] = [
                [int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory)]
                for p in nv.nvmlDeviceGetComputeRunningProcesses(h)
            ]
            gpus.append(gpu)
        return {
            "driver": nvml._text(nv.nvmlSystemGetDriverVersion()),
            "gpus": gpus,
            "nvlink": nvlink,
        }
    finally:
        nv.nvmlShutdown()


def compare(label: str, own: frozenset[int]) -> tuple[list[dict[str, Any]], list[str]]:
    """Both sources' GPUs, and the fields where they differ."""
    found = discovery.discover_gpus(own_pids=own)
    by_smi, smi_notes = smi.discover(own_pids=own)
    a = msgspec.to_builtins(found.gpus)
    b = msgspec.to_builtins(by_smi)
    problems = []
    if found.source != "nvml":
        problems.append(f"{label}: discovery fell back to {found.source}: {found.warnings}")
    if len(a) != len(b):
        problems.append(f"{label}: NVML lists {len(a)} GPUs, nvidia-smi {len(b)}")
    for x, y in zip(a, b, strict=False):
        for key in x:
            if x[key] != y.get(key):
                problems.append(
                    f"{label}: GPU {x['index']} {key}: NVML {x[key]!r}, smi {y.get(key)!r}"
                )
    print(f"{label}: NVML {json.dumps(a)}")
    print(f"{label}: smi warnings {smi_notes} nvml warnings {list(found.warnings)}")
    return a, problems


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("discovery-recording")
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"idle": {}, "held": {}}
    problems: list[str] = []
    record_smi(out, "idle")
    report["idle"]["nvml"] = record_nvml()
    report["idle"]["gpus"], p = compare("idle", frozenset())
    problems += p
    holder = None
    try:
        import torch  # noqa: F401
    except ImportError:
        print("no PyTorch: the foreign-memory check is skipped")
    else:
        holder = subprocess.Popen(
            [sys.executable, "-c",
             "import sys, time, torch\n"
             f"x = torch.empty({HOLD_MIB} * 2**20, dtype=torch.uint8, device='cuda')\n"
             "torch.cuda.synchronize(); print('held', flush=True); time.sleep(120)"],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
    try:
        if holder is not None and holder.stdout is not None and holder.stdout.readline():
            time.sleep(1)
            record_smi(out, "held")
            report["held"]["nvml"] = record_nvml()
            report["held"]["pid"] = holder.pid
            gpus, p = compare("held", frozenset())
            problems += p
            seen = gpus[0]["foreign_memory_mib"] if gpus else 0
            if seen < HOLD_MIB:
                problems.append(f"held: {HOLD_MIB} MiB held by pid {holder.pid}, saw {seen} MiB")
            gpus, p = compare("held, pid declared own", frozenset({holder.pid}))
            problems += p
            if gpus and gpus[0]["foreign_memory_mib"] != 0:
                problems.append(f"own pid still counted: {gpus[0]['foreign_memory_mib']} MiB")
            report["held"]["gpus"] = gpus
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
    report["problems"] = problems
    (out / "discovery.json").write_text(json.dumps(report, indent=2))
    print("problems:", problems or "none")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

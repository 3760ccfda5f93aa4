"""NVML parsing with a fake pynvml, and the loud fallback to a real nvidia-smi subprocess.

No GPU here: these tests check what the code makes of NVML's values (invented ones,
and NVML's answers recorded on a real H200), and that a failing NVML downgrades with
a warning.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import structlog

from llmgw.agent import discovery
from llmgw.agent.discovery import nvml, smi

HW = Path(__file__).resolve().parents[1] / "fixtures" / "hw"
GIB = 1024**3


class FakeNvml:
    """The slice of pynvml that discovery calls, holding recorded-looking values."""

    NVML_P2P_CAPS_INDEX_NVLINK = 2
    NVML_P2P_STATUS_OK = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_DEVICE_MIG_ENABLE = 1

    class NVMLError(Exception):
        pass

    def __init__(self, gpus: list[dict[str, Any]], nvlink: set[frozenset[int]]) -> None:
        self.gpus = gpus
        self.nvlink = nvlink
        self.shutdown = False

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shutdown = True

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetP2PStatus(self, a: int, b: int, cap: int) -> int:
        assert cap == self.NVML_P2P_CAPS_INDEX_NVLINK
        return 0 if frozenset({a, b}) in self.nvlink else 4

    def nvmlDeviceGetName(self, h: int) -> Any:
        return self.gpus[h]["name"]

    def nvmlDeviceGetUUID(self, h: int) -> Any:
        return self.gpus[h]["uuid"]

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        total, used = self.gpus[h]["total"], self.gpus[h].get("used", 0)
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetCudaComputeCapability(self, h: int) -> tuple[int, int]:
        return self.gpus[h]["cc"]

    def nvmlDeviceGetTotalEccErrors(self, h: int, kind: int, counter: int) -> int:
        assert (kind, counter) == (1, 0)
        ecc = self.gpus[h].get("ecc")
        if ecc is None:
            raise self.NVMLError("Not Supported")
        return int(ecc)

    def nvmlDeviceGetMigMode(self, h: int) -> tuple[int, int]:
        if "mig" not in self.gpus[h]:
            raise self.NVMLError("Not Supported")
        mig = self.gpus[h]["mig"]
        if isinstance(mig, tuple):  # (current, pending), as pynvml returns them
            return mig
        return (1, 1) if mig else (0, 0)

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        return [SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in self.gpus[h].get("procs", [])]

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: int) -> list[Any]:
        graphics = self.gpus[h].get("graphics", [])
        return [SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in graphics]

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, int, int, int]:
        """(correctable rows, uncorrectable rows, pending, failure), as pynvml returns them."""
        if "remap" not in self.gpus[h]:
            raise self.NVMLError("Not Supported")
        return tuple(self.gpus[h]["remap"])  # type: ignore[return-value]


def h200(i: int, **extra: Any) -> dict[str, Any]:
    # An H200 reports 143771 MiB (nvidia-smi/h200-1gpu-590.query.csv).
    return {
        "name": "NVIDIA H200",
        "uuid": f"GPU-{i}",
        "total": 143771 * 1024 * 1024,
        "cc": (9, 0),
    } | extra


def test_nvml_values_become_gpus() -> None:
    fake = FakeNvml(
        [
            h200(0),
            h200(1, ecc=3),
            h200(2, procs=[(4242, 2 * GIB), (7, None)]),
            {"name": b"NVIDIA L40S", "uuid": b"GPU-3", "total": 46068 * 1024 * 1024, "cc": (8, 9)},
        ],
        nvlink={frozenset({0, 1}), frozenset({1, 2})},
    )
    gpus = nvml.read_gpus(fake, own_pids=frozenset({7}))
    assert [g.gpu_class for g in gpus] == ["h200-140g"] * 3 + ["l40s-45g"]
    assert [g.nvlink_domain for g in gpus] == [0, 0, 0, None]
    assert [g.compute_capability for g in gpus] == ["9.0", "9.0", "9.0", "8.9"]
    assert gpus[1].ecc_uncorrected == 3
    assert not gpus[1].healthy
    assert gpus[2].foreign_memory_mib == 2048  # pid 7 is our own engine
    assert gpus[3].ecc_uncorrected == 0  # "Not Supported" is not an error count
    assert gpus[3].uuid == "GPU-3"
    assert fake.shutdown


def test_mig_enabled_gpu_is_left_out_with_a_warning() -> None:
    fake = FakeNvml([h200(0, mig=False), h200(1, mig=True), h200(2)], set())
    notes: list[str] = []
    gpus = nvml.read_gpus(fake, warnings=notes)
    assert [g.index for g in gpus] == [0, 2]
    assert notes == [
        "GPU 1 (NVIDIA H200) has MIG enabled and is left out: llmgw places whole GPUs; "
        "disable MIG (`nvidia-smi -i 1 -mig 0`) to use it"
    ]


def test_nvml_query_failure_is_an_nvml_error() -> None:
    fake = FakeNvml([h200(0)], set())

    def broken(h: int) -> str:
        raise fake.NVMLError("GPU is lost")

    fake.nvmlDeviceGetName = broken  # type: ignore[method-assign]
    with pytest.raises(nvml.NvmlError, match="GPU is lost"):
        nvml.read_gpus(fake)


@pytest.mark.parametrize(
    "odd",
    [{"ecc": 2**63}, {"total": 2**80}, {"total": 2**1100}, {"cc": (2**60, 0)}],
    ids=["ecc counter", "memory", "memory past a float", "capability"],
)
def test_a_gpu_out_of_the_logs_bounds_is_an_nvml_error(odd: dict[str, Any]) -> None:
    """A value no GPU has (a driver's garbage, a counter's wrap) would make every reader
    refuse the node's registration; it is refused here, naming the GPU, as nvidia-smi's
    reading refuses its row, and the agent never crashes on it."""
    fake = FakeNvml([h200(0), h200(1, **odd)], set())
    with pytest.raises(nvml.NvmlError, match=r"GPU 1 \(NVIDIA H200\) reads out of range"):
        nvml.read_gpus(fake)
    assert fake.shutdown
    assert len(nvml.read_gpus(FakeNvml([h200(0), h200(1)], set()))) == 2


def test_an_old_pynvml_is_an_nvml_error_not_a_crash() -> None:
    fake = FakeNvml([h200(0)], set())
    with pytest.raises(nvml.NvmlError, match="upgrade nvidia-ml-py"):
        nvml.read_gpus(_Without(fake, "nvmlDeviceGetCudaComputeCapability"))


class _Without:
    """The fake with one NVML call missing, as in an old pynvml."""

    def __init__(self, inner: FakeNvml, missing: str) -> None:
        self._inner, self._missing = inner, missing

    def __getattr__(self, name: str) -> Any:
        if name == self._missing:
            raise AttributeError(f"module 'pynvml' has no attribute '{name}'")
        return getattr(self._inner, name)


def fake_smi(
    folder: Path, query: Path, apps: Path | None, topo: Path | None, *, old_driver: bool = False
) -> None:
    """An `nvidia-smi` executable that prints recorded files, so the real subprocess path runs.

    `old_driver` rejects the compute_cap field the way drivers before 510 do.
    """
    script = folder / "nvidia-smi"
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        "args = ' '.join(sys.argv[1:])\n"
        f"if {old_driver!r} and 'compute_cap' in args:\n"
        "    print('Field \"compute_cap\" is not a valid field to query.'); sys.exit(2)\n"
        f"files = {{'--query-gpu': {str(query)!r},"
        f" '--query-compute-apps': {str(apps) if apps else None!r},"
        f" 'topo': {str(topo) if topo else None!r}}}\n"
        "for key, path in files.items():\n"
        "    if args.startswith(key):\n"
        "        if path is None:\n"
        "            print('Unknown Error', file=sys.stderr); sys.exit(3)\n"
        "        sys.stdout.write(open(path).read()); sys.exit(0)\n"
        "sys.exit(2)\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


def failing_pynvml(monkeypatch: pytest.MonkeyPatch) -> Any:
    real = nvml.load()

    def refuse() -> None:
        raise real.NVMLError(real.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setattr(real, "nvmlInit", refuse)
    return real


def test_failing_nvml_falls_back_to_nvidia_smi_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    failing_pynvml(monkeypatch)
    derived = HW / "derived"
    fake_smi(
        tmp_path,
        derived / "rtx4090-x8-535.154.query.csv",
        derived / "rtx4090-x8-535.154.apps.csv",
        HW / "nvidia-smi" / "a10-x4-2nic-xuesong.topo.txt",
    )
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with structlog.testing.capture_logs() as logs:
        found = discovery.discover_gpus()
    assert found.source == "nvidia-smi"
    assert len(found.gpus) == 8
    assert found.gpus[0].foreign_memory_mib == 20322
    assert "NVML failed" in found.warnings[0]
    assert "Driver Not Loaded" in found.warnings[0]
    assert any(e["event"] == "nvml_failed_falling_back_to_nvidia_smi" for e in logs)
    assert all(e["log_level"] == "warning" for e in logs)


def test_fallback_says_what_it_could_not_read(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    failing_pynvml(monkeypatch)
    fake_smi(tmp_path, HW / "nvidia-smi" / "h200-1gpu-590.query.csv", None, None)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    found = discovery.discover_gpus()
    assert found.gpus[0].gpu_class == "h200-140g"
    assert any("foreign GPU memory is seen only in memory.used" in w for w in found.warnings)
    assert any("NVLink domains unknown" in w for w in found.warnings)


def test_no_nvml_and_no_nvidia_smi_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    failing_pynvml(monkeypatch)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(discovery.DiscoveryError, match="--sim-gpus"):
        discovery.discover_gpus()


def test_smi_error_names_the_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake_smi(tmp_path, HW / "nvidia-smi" / "h200-1gpu-590.query.csv", None, None)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(smi.SmiError, match="exited with 3: Unknown Error"):
        smi.run(smi.TOPOLOGY)


def test_the_fake_speaks_real_pynvml() -> None:
    """Every function and constant the NVML reader uses exists in the installed pynvml, with
    the values the fake assumes: a typo there would only show on a GPU machine."""
    real = nvml.load()
    used = [n for n in vars(FakeNvml) if n.startswith(("nvml", "NVML_"))]
    assert len(used) > 10
    missing = [n for n in used if not hasattr(real, n)]
    assert not missing
    for name in used:
        if name.startswith("NVML_"):
            assert getattr(real, name) == getattr(FakeNvml, name), name
    assert issubclass(real.NVMLError, Exception)


def test_old_driver_gets_the_minimal_query(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    failing_pynvml(monkeypatch)
    fake_smi(tmp_path, HW / "nvidia-smi" / "a10g-x4-aws.query.csv", None, None, old_driver=True)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    found = discovery.discover_gpus()
    assert [g.gpu_class for g in found.gpus] == ["a10g-22g"] * 4
    assert any("reduced GPU query" in w and "compute_cap" in w for w in found.warnings), (
        found.warnings
    )


# Recorded on an H200 (driver 580.159.04) by tests/gpu/record_discovery.py, NVML and
# nvidia-smi at the same moment: idle, then while pid `held_pid` held 2 GiB of memory.
H200_RECORDED = HW / "nvidia-smi" / "h200-1gpu-580-llmgw"


def recorded(moment: str) -> tuple[FakeNvml, tuple[str, str, str]]:
    """NVML's recorded answers as a fake, and nvidia-smi's (query, apps, topology) texts."""
    answers = json.loads(H200_RECORDED.with_suffix(".nvml.json").read_text())[moment]
    fake = FakeNvml(answers["gpus"], {frozenset(pair) for pair in answers["nvlink"]})
    at = "" if moment == "idle" else f"{moment}."
    texts = tuple(
        H200_RECORDED.with_suffix(f".{at}{kind}").read_text() for kind in ("query.csv", "apps.csv")
    )
    return fake, (*texts, H200_RECORDED.with_suffix(".topo.txt").read_text())


@pytest.mark.parametrize(("moment", "foreign_mib"), [("idle", 0), ("held", 2566)])
def test_recorded_nvml_and_nvidia_smi_give_the_same_gpus(moment: str, foreign_mib: int) -> None:
    fake, (query, apps, topo) = recorded(moment)
    by_nvml = nvml.read_gpus(fake)
    assert by_nvml == smi.gpus_from_smi(query, apps, topo)
    (gpu,) = by_nvml
    assert (gpu.name, gpu.gpu_class, gpu.memory_mib) == ("NVIDIA H200", "h200-140g", 143771)
    assert (gpu.compute_capability, gpu.nvlink_domain, gpu.ecc_uncorrected) == ("9.0", None, 0)
    assert gpu.uuid == "GPU-16fb8516-9f03-8d84-eb33-9dfbc4d69c74"
    assert gpu.foreign_memory_mib == foreign_mib
    assert gpu.healthy == (foreign_mib == 0)  # another tenant's memory: not placeable


def test_recorded_holder_is_not_foreign_once_it_is_our_own() -> None:
    fake, (query, apps, topo) = recorded("held")
    pid = json.loads(H200_RECORDED.with_suffix(".nvml.json").read_text())["held_pid"]
    own = frozenset({pid})
    assert nvml.read_gpus(fake, own_pids=own)[0].foreign_memory_mib == 0
    assert smi.gpus_from_smi(query, apps, topo, own_pids=own)[0].foreign_memory_mib == 0


# The 4x A100 node whose recorded `nvidia-smi -q` shows a row remap pending on GPU 1
# (00000000:9E:00.0: Remapped Rows Correctable Error 1, Pending Yes).
A100_REMAP = HW / "derived" / "a100-sxm4-80gb-x4-555.query.csv"


def test_pending_row_remap_and_remap_failure_make_a_gpu_unhealthy() -> None:
    """Before: the remapped-rows fields were never asked for, and these GPUs took shards."""
    gpus = smi.gpus_from_smi(A100_REMAP.read_text())
    assert [g.remap_pending for g in gpus] == [False, True, False, False]
    assert [g.index for g in gpus if g.healthy] == [0, 2, 3]
    assert gpus[1].health_problems == ("row remap pending (reset the GPU to apply it)",)
    (failed,) = smi.gpus_from_smi(
        (HW / "derived" / "h100-sxm-1gpu-590.remap-failed.query.csv").read_text()
    )
    assert (failed.remap_failed, failed.remap_pending) == (True, False)
    assert failed.health_problems == ("row remapping failed (the GPU needs service)",)
    # NVML's answer for the same boards: (correctable rows, uncorrectable rows, pending, failure).
    fake = FakeNvml(
        [
            h200(0, remap=(0, 0, 0, 0)),
            h200(1, remap=(1, 0, 1, 0)),
            h200(2, remap=(12, 8, 0, 1)),
            h200(3),
        ],
        set(),
    )
    by_nvml = nvml.read_gpus(fake)
    assert [(g.remap_pending, g.remap_failed) for g in by_nvml] == [
        (False, False),
        (True, False),
        (False, True),
        (False, False),  # "Not Supported" (no row remapper): nothing to report
    ]
    assert [g.index for g in by_nvml if g.healthy] == [0, 3]


def test_remap_fields_are_asked_for_and_na_reads_as_no(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert {"remapped_rows.pending", "remapped_rows.failure", "memory.used"} <= set(smi.GPU_FIELDS)
    failing_pynvml(monkeypatch)
    fake_smi(tmp_path, A100_REMAP, HW / "nvidia-smi" / "h200-1gpu-580-llmgw.apps.csv", None)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    found = discovery.discover_gpus()
    assert [g.index for g in found.gpus if not g.healthy] == [1]
    # Consumer boards and MIG answer "[N/A]": not a pending remap.
    (rtx,) = smi.gpus_from_smi((HW / "nvidia-smi" / "rtx2080super-linux-595.query.csv").read_text())
    assert rtx.healthy


# A vGPU guest's four H200-141C, recorded with `--query-gpu=index,uuid,name,memory.total,
# memory.used`: the memory is held by engines in containers, which the guest's process
# list does not show (a real empty compute-apps list stands for it).
VGPU = HW / "nvidia-smi" / "h200-141c-vgpu-x4.query.csv"
NO_APPS = HW / "nvidia-smi" / "h200-1gpu-580-llmgw.apps.csv"


def test_memory_no_visible_process_accounts_for_is_foreign() -> None:
    """Before: an empty process list meant 0 MiB foreign, with 131470 of 144384 MiB in use."""
    gpus = smi.gpus_from_smi(VGPU.read_text(), NO_APPS.read_text())
    assert {g.gpu_class for g in gpus} == {"h200-141g"}
    assert [g.foreign_memory_mib for g in gpus] == [45662, 131470, 137255, 111082]
    assert not any(g.healthy for g in gpus)
    # The GPUs our own engines hold: their memory is ours even when their pids are not shown.
    ours = smi.gpus_from_smi(VGPU.read_text(), NO_APPS.read_text(), own_gpus=frozenset({1, 2}))
    assert [g.foreign_memory_mib for g in ours] == [45662, 0, 0, 111082]
    # A listed process is not counted twice: what it holds is seen, the rest unseen.
    apps = "gpu_uuid, pid, used_gpu_memory [MiB]\n"
    apps += "GPU-7bdd753d-3af1-11b3-a839-80f10ebdf224, 77, 131000\n"
    listed = smi.gpus_from_smi(VGPU.read_text(), apps, own_pids=frozenset({77}))
    assert listed[1].foreign_memory_mib == 0  # 470 MiB unseen: within the driver's allowance


def test_idle_recordings_have_no_unseen_memory() -> None:
    """The allowance covers every idle recording, a workstation driving a desktop included."""
    for name in (
        "h100-sxm-1gpu-590.query.csv",
        "h200-1gpu-590.query.csv",
        "l40s-1gpu-595.query.csv",
        "a100-pcie-40gb-x2-dl380g11.query.csv",
        "rtx2080super-linux-595.query.csv",
        "rtx2080super-windows-610.query.csv",
        "rtx4080super-linux-595.query.csv",
    ):
        gpus = smi.gpus_from_smi((HW / "nvidia-smi" / name).read_text(), NO_APPS.read_text())
        assert all(g.foreign_memory_mib == 0 for g in gpus), name


def test_nvml_counts_unseen_memory_but_not_a_visible_desktop() -> None:
    used = 131470 * 1024 * 1024
    fake = FakeNvml(
        [
            h200(0, used=used),
            h200(1, used=used),
            h200(2, used=3 * GIB, graphics=[(900, 3 * GIB)]),
        ],
        set(),
    )
    gpus = nvml.read_gpus(fake, own_gpus=frozenset({1}))
    assert [g.foreign_memory_mib for g in gpus] == [131470, 0, 0]


def test_a_gpu_whose_mig_mode_is_still_on_until_reset_is_left_out() -> None:
    """`nvidia-smi -mig 0` sets the pending mode; the current one stays enabled until the
    GPU is reset, and only the current one says whether whole-GPU placement works."""
    fake = FakeNvml([h200(0, mig=(1, 0)), h200(1, mig=(0, 1))], set())
    notes: list[str] = []
    assert [g.index for g in nvml.read_gpus(fake, warnings=notes)] == [1]
    assert len(notes) == 1
    assert notes[0].startswith("GPU 0 (NVIDIA H200) has MIG enabled")


class BrokenNvml(FakeNvml):
    def nvmlInit(self) -> None:
        raise self.NVMLError("Driver Not Loaded")


def test_nvml_warnings_reach_the_discovery() -> None:
    fake = FakeNvml([h200(0, mig=True), h200(1)], set())
    found = discovery.discover_gpus(nvml_module=lambda: fake)
    assert found.source == "nvml"
    assert len(found.warnings) == 1
    assert "has MIG enabled" in found.warnings[0]


def test_the_fallback_gets_our_gpus_and_its_warnings_reach_the_inventory(
    tmp_path: Path,
) -> None:
    """nvidia-smi must know which GPUs our engines hold too (else their memory, unseen from
    a container, reads as another tenant's), and the inventory says NVML failed."""
    asked: dict[str, frozenset[int]] = {}
    gpu = smi.gpus_from_smi((HW / "nvidia-smi" / "h200-1gpu-590.query.csv").read_text())

    def smi_discover(**kwargs: frozenset[int]) -> tuple[tuple[Any, ...], list[str]]:
        asked.update(kwargs)
        return gpu, ["no topology, NVLink domains unknown: test"]

    found = discovery.discover(
        own_pids=frozenset({7}),
        own_gpus=frozenset({0}),
        infiniband_root=tmp_path / "absent",
        nvml_module=lambda: BrokenNvml([], set()),
        smi_discover=smi_discover,
    )
    assert asked == {"own_pids": frozenset({7}), "own_gpus": frozenset({0})}
    assert found.source == "nvidia-smi"
    assert found.inventory.gpus == gpu
    assert found.warnings[0].startswith("NVML failed (nvmlInit failed: Driver Not Loaded)")
    assert found.warnings[1] == "no topology, NVLink domains unknown: test"


def test_the_fallback_says_why_a_mig_gpu_is_left_out(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake_smi(tmp_path, HW / "nvidia-smi" / "h100-sxm-mig-590.query.csv", None, None)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    gpus, notes = smi.discover()
    assert gpus == ()
    assert any("has MIG enabled and is left out" in note for note in notes)


def test_a_foreign_process_whose_memory_nvml_cannot_say_still_makes_the_gpu_busy() -> None:
    fake = FakeNvml([h200(0, procs=[(4242, None)]), h200(1, procs=[(4243, 0)])], set())
    gpus = nvml.read_gpus(fake)
    assert [g.foreign_memory_mib for g in gpus] == [1, 1]


@pytest.mark.parametrize(
    ("mode", "text"),
    [(0o644, "#!/bin/sh\necho\n"), (0o755, "\x7fELF garbage, not a program this machine runs")],
)
def test_an_nvidia_smi_that_cannot_be_executed_is_an_smi_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mode: int, text: str
) -> None:
    """A file without its execute bit, or one that is no program (a broken driver install):
    the refresh in the heartbeat loop expects SmiError, and anything else ended the agent."""
    broken = tmp_path / "nvidia-smi"
    broken.write_text(text)
    broken.chmod(mode)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(smi.SmiError, match="cannot be run"):
        smi.run(smi.TOPOLOGY)
    failing_pynvml(monkeypatch)
    with pytest.raises(discovery.DiscoveryError, match="nvidia-smi failed"):
        discovery.discover_gpus()


def test_a_foreign_process_whose_memory_nvidia_smi_cannot_say_still_makes_the_gpu_busy() -> None:
    """nvidia-smi prints `[N/A]` for a process's memory where the driver may not say (vGPU
    guests, Windows' WDDM): it read as 0 MiB, so on a GPU our engines hold (where unseen
    memory is not counted) the fallback called free a GPU that NVML calls busy."""
    query = (HW / "nvidia-smi" / "h200-1gpu-590.query.csv").read_text()
    uuid = smi.gpus_from_smi(query)[0].uuid
    apps = f"gpu_uuid, pid, used_gpu_memory [MiB]\n{uuid}, 4242, [N/A]\n"
    ours = frozenset({0})
    (by_smi,) = smi.gpus_from_smi(query, apps, own_gpus=ours)
    fake = FakeNvml([h200(0, uuid=uuid, procs=[(4242, None)])], set())
    (by_nvml,) = nvml.read_gpus(fake, own_gpus=ours)
    assert by_smi.foreign_memory_mib == by_nvml.foreign_memory_mib == 1
    assert not by_smi.healthy
    # Our own engine's process with `[N/A]` stays ours.
    (own,) = smi.gpus_from_smi(query, apps, own_pids=frozenset({4242}), own_gpus=ours)
    assert own.foreign_memory_mib == 0


DOWN_RAILS = HW / "derived" / "sysfs-cx7-down-esc8000a" / "sys/class/infiniband"


def test_a_node_with_real_gpus_says_why_a_declared_fabric_is_not_advertised() -> None:
    """The inventory's warnings carry the fabric left out on an NVML node too, not only on a
    simulated one: the recorded ESC8000A's ConnectX-7 ports are all down."""
    found = discovery.discover(
        infiniband_root=DOWN_RAILS,
        declared_fabrics=[("ib-pod-a", ("mlx5_0",))],
        nvml_module=lambda: FakeNvml([h200(0)], set()),
    )
    assert found.source == "nvml"
    assert found.inventory.fabrics == ()
    assert [h.state for h in found.inventory.hcas] == ["DOWN"] * 4
    (warning,) = found.warnings
    assert warning.startswith('fabric "ib-pod-a" is not advertised to the scheduler: no port')


def test_gpus_left_out_and_parts_nvidia_smi_could_not_read_are_logged() -> None:
    """The agent logs each note as a warning where the operator looks (journald), not only in
    the inventory it registers."""
    with structlog.testing.capture_logs() as logs:
        discovery.discover_gpus(nvml_module=lambda: FakeNvml([h200(0, mig=True)], set()))
        discovery.discover_gpus(
            nvml_module=lambda: BrokenNvml([], set()),
            smi_discover=lambda **_: ((), ["no topology, NVLink domains unknown: hung"]),
        )
    by_event = {e["event"]: (e["log_level"], e["detail"]) for e in logs if "detail" in e}
    level, detail = by_event["gpu_left_out"]
    assert (level, detail.split(":")[0]) == (
        "warning",
        "GPU 0 (NVIDIA H200) has MIG enabled and is left out",
    )
    assert by_event["nvidia_smi_partial"] == (
        "warning",
        "no topology, NVLink domains unknown: hung",
    )

"""`llmgw agent inventory` as a real subprocess: simulated GPUs, and the nvidia-smi fallback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.unit.test_discovery_nvml import HW, fake_smi


def inventory(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw", "agent", "inventory", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def test_simulated_inventory_as_json(tmp_path: Path) -> None:
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("node_id: gpu-07\nfabrics:\n  - {name: ib-a, hcas: [mlx5_0, mlx5_7]}\n")
    root = HW / "derived" / "sysfs-h100-cx7-ndr-x8" / "sys/class/infiniband"
    done = inventory(
        "--config", str(cfg), "--sim-gpus", "8xh100-80g", "--infiniband-root", str(root), "--json"
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["node"] == "gpu-07"
    assert report["source"] == "simulated"
    assert [g["gpu_class"] for g in report["gpus"]] == ["h100-80g"] * 8
    assert report["fabrics"] == [
        {"name": "ib-a", "kind": "infiniband", "hcas": ["mlx5_0", "mlx5_7"]}
    ]
    assert len(report["hcas"]) == 9
    assert report["warnings"] == []


def test_table_through_the_nvidia_smi_fallback(tmp_path: Path) -> None:
    # No driver here, so NVML fails for real; nvidia-smi is a script printing recordings.
    derived = HW / "derived"
    fake_smi(
        tmp_path,
        derived / "rtx4090-x8-535.154.query.csv",
        derived / "rtx4090-x8-535.154.apps.csv",
        HW / "nvidia-smi" / "a10-x4-2nic-xuesong.topo.txt",
    )
    env = os.environ | {"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    done = inventory("--infiniband-root", str(tmp_path / "none"), env=env)
    assert done.returncode == 0, done.stderr
    assert "GPUs from nvidia-smi" in done.stdout
    assert "EXCLUDED: 20322 MiB held by a foreign process" in done.stdout
    assert "warning: NVML failed" in done.stdout
    assert "single-node island" in done.stdout
    assert "nvml_failed_falling_back_to_nvidia_smi" in done.stderr


def test_errors_say_what_to_do(tmp_path: Path) -> None:
    done = inventory("--sim-gpus", "eight-h100")
    assert done.returncode == 2
    assert "write COUNTxCLASS such as '8xh100-80g'" in done.stderr
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("fabrics:\n  - {name: ib-a}\n")
    done = inventory("--config", str(cfg), "--sim-gpus", "1xh100-80g")
    assert done.returncode == 2
    assert 'fabric "ib-a" lists no HCAs' in done.stderr

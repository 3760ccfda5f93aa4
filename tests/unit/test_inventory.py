"""GPU classes come from the memory the driver reports, in GiB."""

from __future__ import annotations

import pytest

from llmgw.core.inventory import Gpu, gpu_class


@pytest.mark.parametrize(
    ("name", "mib", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", 81559, "h100-80g"),
        ("NVIDIA L40S", 46068, "l40s-45g"),  # sold as 48 GB, reports 44.99 GiB
        ("NVIDIA A100-SXM4-80GB", 81920, "a100-80g"),
        ("NVIDIA A100-PCIE-40GB", 40960, "a100-40g"),
        ("NVIDIA H200", 143771, "h200-140g"),
        ("NVIDIA H100 NVL", 95830, "h100-94g"),
        ("NVIDIA GeForce RTX 4080 SUPER", 16376, "rtx4080super-16g"),
        ("NVIDIA RTX 6000 Ada Generation", 49140, "rtx6000ada-48g"),
        ("NVIDIA A10G", 23028, "a10g-22g"),
        ("Tesla P100-PCIE-16GB", 16280, "p100-16g"),
        # vGPU profiles and workstation editions (see tests/fixtures/hw/SOURCES.md).
        ("NVIDIA H200-141C", 144384, "h200-141g"),
        ("GRID T4-16Q", 16384, "t4-16g"),
        (
            "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition",
            97887,
            "rtxpro6000blackwell-96g",
        ),
        ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", 97887, "rtxpro6000blackwell-96g"),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", 97887, "rtxpro6000blackwell-96g"),
        ("NVIDIA RTX 2000E Ada Generation", 16380, "rtx2000eada-16g"),
    ],
)
def test_gpu_class(name: str, mib: int, expected: str) -> None:
    assert gpu_class(name, mib) == expected


def test_half_gib_rounds_up_not_to_even() -> None:
    assert gpu_class("NVIDIA A10", 22.5 * 1024) == "a10-23g"


def test_health_problems_name_each_flag() -> None:
    gpu = Gpu(
        index=5,
        uuid="u",
        name="n",
        gpu_class="h100-80g",
        memory_mib=1,
        compute_capability="9.0",
        ecc_uncorrected=2,
        foreign_memory_mib=512,
    )
    assert not gpu.healthy
    assert gpu.health_problems == (
        "uncorrected ECC errors (2)",
        "512 MiB held by a foreign process",
    )


def test_health_problems_name_row_remapping() -> None:
    gpu = Gpu(
        index=0,
        uuid="u",
        name="n",
        gpu_class="a100-80g",
        memory_mib=1,
        compute_capability="8.0",
        remap_pending=True,
        remap_failed=True,
    )
    assert gpu.health_problems == (
        "row remap pending (reset the GPU to apply it)",
        "row remapping failed (the GPU needs service)",
    )

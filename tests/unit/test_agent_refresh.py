"""Re-reading a node's health between heartbeats (llmgw.agent.refresh): the GPUs with
this agent's own engines known, and the fabrics from a sysfs tree that changes."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from llmgw.agent import discovery, refresh
from llmgw.agent.config import FabricConfig
from llmgw.agent.discovery import simulated
from llmgw.core.inventory import Fabric, Inventory


class Engines:
    """The two questions refresh asks the supervisor."""

    def own_pids(self) -> frozenset[int]:
        return frozenset({41, 42})

    def busy_gpus(self) -> frozenset[int]:
        return frozenset({3})


def test_gpus_are_reread_knowing_our_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: dict[str, Any] = {}
    gpus = simulated.parse_spec("4xh100-80g")

    def discover_gpus(**kwargs: Any) -> discovery.GpuDiscovery:
        asked.update(kwargs)
        return discovery.GpuDiscovery(gpus=gpus, source="nvml")

    monkeypatch.setattr(discovery, "discover_gpus", discover_gpus)
    assert asyncio.run(refresh.gpus(Engines())) == gpus  # type: ignore[arg-type]
    assert asked == {"own_pids": frozenset({41, 42}), "own_gpus": frozenset({3})}


def test_a_failed_reread_keeps_the_last_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    def discover_gpus(**kwargs: Any) -> discovery.GpuDiscovery:
        raise discovery.DiscoveryError("no GPUs could be listed")

    monkeypatch.setattr(discovery, "discover_gpus", discover_gpus)
    assert asyncio.run(refresh.gpus(Engines())) is None  # type: ignore[arg-type]


def _port(root: Path, device: str, state: str) -> None:
    folder = root / device / "ports" / "1"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "state").write_text(state)
    (folder / "link_layer").write_text("InfiniBand")


def test_fabrics_change_only_when_the_usable_ones_do(tmp_path: Path) -> None:
    declared = [FabricConfig(name="ib-a", hcas=("mlx5_0",))]
    _port(tmp_path, "mlx5_0", "4: ACTIVE")
    up = Fabric(name="ib-a", kind="infiniband", hcas=("mlx5_0",))
    before = Inventory(fabrics=(up,))
    assert asyncio.run(refresh.fabrics(before, declared, str(tmp_path))) is None
    _port(tmp_path, "mlx5_0", "1: DOWN")  # the cable is pulled
    after = asyncio.run(refresh.fabrics(before, declared, str(tmp_path)))
    assert after is not None
    assert after.fabrics == ()
    assert [(h.name, h.state) for h in after.hcas] == [("mlx5_0", "DOWN")]

"""Re-reading a node's health between heartbeats: GPUs (ECC, row remapping, foreign
memory) for heartbeats and launch validation, and the RDMA fabrics.

A fabric whose ports went down (a cable, the subnet manager) must stop being
advertised, or the scheduler keeps placing multi-node replicas that hang on their
first all-reduce; one that came back is advertised again. Used by
`llmgw.agent.service`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import msgspec

from llmgw import logs
from llmgw.agent import discovery
from llmgw.agent.config import FabricConfig
from llmgw.agent.discovery import infiniband
from llmgw.agent.supervisor import Supervisor
from llmgw.core.inventory import Gpu, Inventory

log = logs.get("llmgw.agent.service")


async def gpus(supervisor: Supervisor) -> tuple[Gpu, ...] | None:
    """The GPUs re-read, or None (logged) when discovery fails."""
    try:
        found = await asyncio.to_thread(
            discovery.discover_gpus,
            own_pids=supervisor.own_pids(),
            own_gpus=supervisor.busy_gpus(),
        )
    except discovery.DiscoveryError as exc:
        log.warning("gpu_health_refresh_failed", error=str(exc))
        return None
    return found.gpus


async def fabrics(
    inventory: Inventory, declared: Sequence[FabricConfig], infiniband_root: str
) -> Inventory | None:
    """`inventory` with the adapters re-read, or None when the usable fabrics are the same."""
    hcas = await asyncio.to_thread(infiniband.read_hcas, infiniband_root)
    notes: list[str] = []
    usable = discovery.fabrics([(f.name, f.hcas) for f in declared], hcas, notes)
    if usable == inventory.fabrics:
        return None
    for note in notes:
        log.warning("fabric_warning", detail=note)
    log.info(
        "fabrics_changed",
        before=[f.name for f in inventory.fabrics],
        after=[f.name for f in usable],
    )
    return msgspec.structs.replace(inventory, hcas=hcas, fabrics=usable)

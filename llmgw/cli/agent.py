"""`llmgw agent`: the GPU node's agent. `llmgw agent inventory` prints what the scheduler would see.

The inventory command runs the same discovery the agent service registers
with (NVML, else nvidia-smi; /sys/class/infiniband; the configured fabrics),
so an operator can check a node before it joins the fleet.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import typer

from llmgw import config, logs
from llmgw.agent import config as agent_config
from llmgw.agent import discovery
from llmgw.agent.discovery import simulated
from llmgw.core.inventory import Fabric, Gpu, Hca

app = typer.Typer(
    help="The agent on every GPU node: discovery, engine launch and supervision.",
    no_args_is_help=True,
)


@app.callback()
def agent() -> None:
    """The agent on every GPU node: discovery, engine launch and supervision."""


class InventoryReport(msgspec.Struct, frozen=True, kw_only=True):
    """`llmgw agent inventory --json`: the node as NodeRegistered would describe it."""

    node: str
    address: str
    source: str
    gpus: tuple[Gpu, ...]
    fabrics: tuple[Fabric, ...]
    hcas: tuple[Hca, ...]
    warnings: tuple[str, ...]


def _table(report: InventoryReport) -> str:
    lines = [f"node {report.node} ({report.address}), GPUs from {report.source}"]
    lines.append(f"{'GPU':>3}  {'class':<16} {'cc':<4} {'NVLink':<6} {'MiB':>7}  health  name")
    for g in report.gpus:
        domain = "-" if g.nvlink_domain is None else str(g.nvlink_domain)
        health = "ok" if g.healthy else "EXCLUDED: " + "; ".join(g.health_problems)
        lines.append(
            f"{g.index:>3}  {g.gpu_class:<16} {g.compute_capability or '?':<4} {domain:<6} "
            f"{g.memory_mib:>7}  {health}  {g.name}"
        )
    if not report.gpus:
        lines.append("  (no GPUs)")
    if report.hcas:
        lines.append("RDMA ports:")
        for h in report.hcas:
            lines.append(f"  {h.name}/{h.port}  {h.kind:<10} {h.state:<8} {h.rate_gbps:g} Gb/s")
    else:
        lines.append("RDMA: none (a single-node island: no multi-node replicas here)")
    for f in report.fabrics:
        lines.append(f"fabric {f.name} ({f.kind}): {', '.join(f.hcas)}")
    lines.extend(f"warning: {w}" for w in report.warnings)
    return "\n".join(lines)


@app.command("inventory")
def inventory(
    config_path: Path | None = typer.Option(None, "--config", help="Agent YAML config."),
    sim_gpus: str | None = typer.Option(
        None, "--sim-gpus", help="Simulated GPUs, e.g. 8xh100-80g, or a YAML/JSON file."
    ),
    infiniband_root: Path | None = typer.Option(
        None, "--infiniband-root", help="Where to read RDMA adapters [/sys/class/infiniband]."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Discover this node's GPUs, NVLink domains and RDMA fabrics as the scheduler sees them."""
    logs.setup("warning")
    try:
        cfg = agent_config.load(config_path)
        found = discovery.discover(
            sim_gpus=sim_gpus if sim_gpus is not None else cfg.sim_gpus,
            infiniband_root=infiniband_root or cfg.infiniband_root,
            declared_fabrics=[(f.name, f.hcas) for f in cfg.fabrics],
        )
    except (
        config.ConfigError,
        discovery.DiscoveryError,
        simulated.SimSpecError,
    ) as exc:
        typer.echo(f"llmgw agent inventory: {exc}", err=True)
        raise typer.Exit(2) from None
    inv = found.inventory
    report = InventoryReport(
        node=cfg.node_id,
        address=cfg.address,
        source=found.source,
        gpus=inv.gpus,
        fabrics=inv.fabrics,
        hcas=inv.hcas,
        warnings=(*found.warnings, *agent_config.fabric_warnings(cfg.fabrics, inv.hcas)),
    )
    if as_json:
        typer.echo(msgspec.json.format(msgspec.json.encode(report), indent=2))
    else:
        typer.echo(_table(report))

"""`llmgw agent`: the GPU node's agent. `llmgw agent inventory` prints what the scheduler would see.

`llmgw agent --config FILE` runs the agent service (`llmgw.agent.service`) until
SIGTERM / SIGINT; engines keep serving after it stops, and the next run adopts
them. It prints one line `llmgw agent NODE started` to stdout once it has
adopted its engines and discovered the node (before NATS is reached: it keeps
trying). `--check` validates the config and exits.

The inventory command runs the same discovery the agent service registers
with (NVML, else nvidia-smi; /sys/class/infiniband; the configured fabrics),
so an operator can check a node before it joins the fleet.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import msgspec
import typer

from llmgw import config, logs, openfiles, sdnotify, tasks
from llmgw.agent import config as agent_config
from llmgw.agent import discovery
from llmgw.agent.discovery import simulated
from llmgw.agent.engines.policy import LaunchPolicy
from llmgw.core.inventory import Fabric, Gpu, Hca

app = typer.Typer(
    help="The agent on every GPU node: discovery, engine launch and supervision. "
    "`llmgw agent --config FILE` runs it until SIGTERM (engines keep serving; the next run "
    "adopts them); `llmgw agent inventory` shows what it would register.",
    no_args_is_help=True,
)


@app.callback(invoke_without_command=True)
def agent(
    ctx: typer.Context,
    config_path: Path | None = typer.Option(
        None, "--config", "-c", help="Agent YAML config: run the agent service with it."
    ),
    check: bool = typer.Option(False, "--check", help="Validate the config and exit."),
) -> None:
    """The agent on every GPU node: discovery, engine launch and supervision.

    `llmgw agent --config /etc/llmgw/agent.yaml` runs the agent (until SIGTERM);
    `llmgw agent inventory` shows what it would register.
    """
    if ctx.invoked_subcommand is not None:
        return
    if config_path is None:
        typer.echo(
            "llmgw agent: give --config FILE to run the agent (see deploy/agent.example.yaml), "
            "or a command such as `llmgw agent inventory`",
            err=True,
        )
        raise typer.Exit(2)
    try:
        cfg = agent_config.load(config_path)
    except config.ConfigError as exc:
        typer.echo(f"llmgw agent: {exc}", err=True)
        raise typer.Exit(2) from None
    problems = agent_config.state_dir_problems(cfg)
    if check:
        # The certificate files, too: --check must not say ok about an agent that could
        # not connect.
        problems += cfg.nats.file_problems("nats")
    if problems:
        typer.echo("\n".join(f"{config_path}: {p}" for p in problems), err=True)
        raise typer.Exit(2)
    if check:
        typer.echo(f"{config_path}: node {cfg.node_id!r}, state in {cfg.state_dir}: ok")
        typer.echo(_launch_summary(cfg.launch))
        return
    logs.setup(cfg.log_level)
    openfiles.at_start()
    try:
        import uvloop

        uvloop.run(_serve(cfg, str(config_path.resolve())))
    except (FileNotFoundError, discovery.DiscoveryError, simulated.SimSpecError) as exc:
        # A certificate path, or no GPUs to be found: the message says what to do.
        typer.echo(f"llmgw agent: {exc}", err=True)
        raise typer.Exit(2) from None


def _launch_summary(policy: LaunchPolicy) -> str:
    """One line: what a StartShard may make this node run."""
    extra_env = sum(len(v) for v in policy.env_allow.values())
    extra_args = sum(len(v) for v in policy.args_allow.values())
    base = "built-in allowlists" if policy.defaults else "no built-in allowlists"
    dirs = ", ".join(policy.file_dirs) or "none"
    return (
        f"launch: engines {', '.join(policy.engines)}; env and engine options: {base}, "
        f"+{extra_env} env entries, +{extra_args} options; files read from: {dirs}"
    )


async def _serve(cfg: agent_config.AgentConfig, source: str = "") -> None:
    from llmgw.agent.service import AgentService

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    tasks.until_stopped(loop, stop, "agent")
    svc = AgentService(cfg, config_source=source)
    run = asyncio.create_task(svc.run(stop))
    started = asyncio.create_task(svc.started.wait())
    await asyncio.wait([run, started], return_when=asyncio.FIRST_COMPLETED)
    if svc.started.is_set():
        sys.stdout.write(f"llmgw agent {cfg.node_id} started\n")
        sys.stdout.flush()
        sdnotify.ready()
    started.cancel()
    await run


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
        None,
        "--infiniband-root",
        help="Where to read RDMA adapters (default: /sys/class/infiniband).",
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

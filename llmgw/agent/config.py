"""The agent's configuration: who the node is, where NATS is, which RDMA fabrics it is on.

Loaded from YAML plus `LLMGW_AGENT__...` environment overrides
(`llmgw.config.load(AgentConfig, path, section="AGENT")`), then completed and
checked by `load`: the node id defaults to the short hostname and must be one
subject token; fabric labels are validated because a wrong one makes the
scheduler place multi-node replicas that hang on their first all-reduce; the
`launch` policy (what an operator's model may make this node run) is checked too.
Used by `llmgw agent` and `llmgw agent inventory`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Mapping
from pathlib import Path

import msgspec

from llmgw import config
from llmgw.agent.engines.common import LaunchContext
from llmgw.agent.engines.policy import LaunchPolicy, policy_errors
from llmgw.bus.settings import NatsConnection
from llmgw.core import placement, subjects
from llmgw.core.inventory import Hca, Inventory
from llmgw.core.profile import Engine
from llmgw.pki.ca import MAX_CN


class FabricConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An RDMA fabric this node is attached to: nodes sharing the name can host one replica."""

    name: str = ""
    hcas: tuple[str, ...] = ()
    """The adapters on this fabric (`mlx5_0`, ...): NCCL_IB_HCA is set to exactly these."""


class NatsConfig(NatsConnection, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """NATS for the agent: its certificate has CN = the node id, OU = node."""


class PortRange(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Ports engines may listen on; a StartShard with a port outside is refused.

    The default is the range the control plane's placement hands out
    (`llmgw.core.placement.PORT_BASE` up to `PORT_LIMIT`): NodeRegistered does not
    carry a port range, so a narrower one here refuses every placement.
    """

    first: config.Port = placement.PORT_BASE
    last: config.Port = placement.PORT_LIMIT - 1


class AdminListener(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The agent's own /metrics and /health (llmgw.agent.metrics): 127.0.0.1 by default."""

    host: str = "127.0.0.1"
    port: config.Port = 9191
    header_timeout_s: float = 10.0
    """Longest wait for a request's line and headers: a connection's first request's from its
    connect (a TLS handshake included), a later one's from its first byte; a client that sends
    them slower gets 408 and its connection is closed (llmgw.http_server)."""


class TracesConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The fleet's OpenTelemetry collector, for engines that trace (vLLM, SGLang)."""

    collector: str
    """`host:port` of an OTLP/gRPC collector (4317 by convention)."""
    insecure: bool = True
    """Plain gRPC, as a collector inside the fleet's network usually listens."""


class AgentConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    node_id: str = ""
    """Defaults to the short hostname; must be one NATS subject token."""
    address: str = ""
    """Host name or IP at which routers reach this node's engines; defaults to the node id."""
    nats: NatsConfig = NatsConfig()
    fabrics: tuple[FabricConfig, ...] = ()
    state_dir: str = "/var/lib/llmgw/agent"
    """Pid files and engine logs: what lets a restarted agent adopt its running engines."""
    engine_ports: PortRange = PortRange()
    engine_host: str = ""
    """Address engines bind to; empty: `address`, the one routers are told. `0.0.0.0` (every
    interface) is an explicit opt-in, for a node whose serving address is not its own
    (behind NAT): engines then answer on every network the node is on, and vLLM's key
    guards only its /v1 routes, so anyone on those networks could bypass the routers."""
    engine_commands: dict[Engine, tuple[str, ...]] = {}
    """How to start each engine, e.g. `vllm: [/opt/vllm/bin/vllm, serve]`; defaults:
    `vllm serve`, `python3 -m sglang.launch_server`, `llama-server`, `<python> -m llmgw sim`."""
    sim_gpus: str = ""
    """`8xh100-80g` or a YAML/JSON inventory file: simulated GPUs instead of discovery."""
    infiniband_root: str = "/sys/class/infiniband"
    stop_grace_s: float = 30.0
    """SIGTERM to SIGKILL, when a StopShard does not say."""
    log_tail_lines: int = 100
    heartbeat_s: float = 5.0
    heartbeat_ttl_s: float = 120.0
    """Heartbeats expire from the log after this (whole seconds): the log does not grow with
    them. Keep it well above the control plane's unreachable_after_s."""
    outbox_max_events: int = 100_000
    """Events kept on disk while NATS is unreachable; past this, superseded registrations are
    dropped first and shard statuses never."""
    outbox_max_bytes: int = 64 * 1024 * 1024
    engine_poll_s: float = 0.5
    """How often the supervisor checks each engine's liveness and readiness."""
    kv_events: bool = True
    """Start vLLM, SGLang and sim engines publishing their KV-cache events, and relay them
    for routers to route on (llmgw.agent.kvrelay); false: routers approximate instead."""
    launch: LaunchPolicy = LaunchPolicy()
    """What a StartShard may make this node run: engines, environment names, engine options
    and the directories options may read files from. Anything else is refused before launch."""
    traces: TracesConfig | None = None
    """Where vLLM and SGLang engines send their traces (they continue a request's W3C
    trace context, which routers forward); none unless set."""
    admin: AdminListener | None = None
    """Where to serve the agent's metrics and health; none unless set."""
    log_level: config.LogLevel = "info"


def short_hostname() -> str:
    return socket.gethostname().split(".", 1)[0]


def validate_fabrics(fabrics: Iterable[FabricConfig]) -> None:
    """Raise ConfigError for the first bad fabric, with what to change. Purely computational."""
    seen: dict[str, int] = {}
    owner: dict[str, str] = {}
    for i, fabric in enumerate(fabrics):
        where = f"fabrics[{i}]"
        if not fabric.name.strip():
            raise config.ConfigError(
                f"{where} has no name: give it the label every node on that fabric shares, "
                f"e.g. `name: ib-pod-a` (nodes with the same name may host one replica together)"
            )
        if fabric.name in seen:
            raise config.ConfigError(
                f'fabric "{fabric.name}" is declared twice '
                f"(fabrics[{seen[fabric.name]}] and {where}): merge their HCAs into one entry"
            )
        seen[fabric.name] = i
        try:
            subjects.check_token(fabric.name, "fabric name")
        except subjects.SubjectTokenError as exc:
            raise config.ConfigError(f"{where}: {exc}") from None
        if not fabric.hcas:
            # Worse than no fabric at all: the scheduler would place multi-node replicas
            # here, and every shard would come up with NCCL unable to find a path.
            raise config.ConfigError(
                f'fabric "{fabric.name}" lists no HCAs: add its adapters under {where}.hcas '
                "(see `ls /sys/class/infiniband`), or remove the fabric"
            )
        for hca in fabric.hcas:
            # One adapter on two fabrics means one label is wrong; the replica would
            # start and then hang on its first all-reduce.
            if hca in owner and owner[hca] != fabric.name:
                raise config.ConfigError(
                    f'HCA "{hca}" is claimed by both fabric "{owner[hca]}" and "{fabric.name}": '
                    "an adapter is cabled to one fabric; remove it from the wrong one"
                )
            owner[hca] = fabric.name


def fabric_warnings(fabrics: Iterable[FabricConfig], seen: Iterable[Hca]) -> list[str]:
    """What discovery contradicts in the declared fabrics: warnings, not errors.

    A declared HCA that is absent (a typo, a missing driver), a port that is not
    ACTIVE, or one fabric mixing InfiniBand and RoCE ports: each can leave NCCL
    without a path, but the node still serves single-node replicas.
    """
    ports: dict[str, list[Hca]] = {}
    for hca in seen:
        ports.setdefault(hca.name, []).append(hca)
    warnings = []
    for fabric in fabrics:
        kinds: set[str] = set()
        for name in fabric.hcas:
            found = ports.get(name)
            if not found:
                warnings.append(
                    f'fabric "{fabric.name}" lists HCA "{name}", which /sys/class/infiniband '
                    "does not show: check the name (`ls /sys/class/infiniband`) and the RDMA driver"
                )
                continue
            kinds.update(h.kind for h in found)
            for h in found:
                if h.state.upper() != "ACTIVE":
                    warnings.append(
                        f'fabric "{fabric.name}": {h.name} port {h.port} is {h.state}, not ACTIVE: '
                        "check its cable and subnet manager (`ibstat`)"
                    )
        if len(kinds) > 1:
            warnings.append(
                f'fabric "{fabric.name}" mixes InfiniBand and RoCE ports: NCCL cannot cross '
                "between them; list only adapters of one kind"
            )
    return warnings


def unseen_hcas(fabrics: Iterable[FabricConfig], seen: Iterable[Hca]) -> list[str]:
    """Only the warnings about declared HCAs that discovery did not find."""
    return [w for w in fabric_warnings(fabrics, seen) if "does not show" in w]


def complete(cfg: AgentConfig, *, hostname: str | None = None) -> AgentConfig:
    """Fill the defaults that depend on the machine, then validate everything."""
    node_id = cfg.node_id or (hostname if hostname is not None else short_hostname())
    try:
        subjects.check_token(node_id, "node id")
    except subjects.SubjectTokenError as exc:
        raise config.ConfigError(f"node_id: {exc}; set node_id in the agent config") from None
    if len(node_id) > MAX_CN:
        raise config.ConfigError(
            f"node_id: {node_id[:24]!r}... is {len(node_id)} characters, and the node's "
            f"certificate names it in at most {MAX_CN} (`llmgw ctl cert issue node` refuses "
            "a longer name): set a shorter node_id in the agent config"
        )
    validate_fabrics(cfg.fabrics)
    ports = cfg.engine_ports
    if not 1 <= ports.first <= ports.last <= 65535:
        raise config.ConfigError(
            f"engine_ports {ports.first}-{ports.last} is not a port range: "
            "use first <= last within 1-65535"
        )
    for engine, command in cfg.engine_commands.items():
        if not command or not command[0].strip():
            raise config.ConfigError(
                f"engine_commands.{engine} is empty: give the executable and its leading "
                "arguments, e.g. [vllm, serve], or remove the entry to use the default"
            )
    if cfg.stop_grace_s < 0 or cfg.log_tail_lines < 1:
        raise config.ConfigError("stop_grace_s must be >= 0 and log_tail_lines >= 1")
    if not (cfg.heartbeat_s > 0 and cfg.engine_poll_s > 0):
        raise config.ConfigError(
            f"heartbeat_s ({cfg.heartbeat_s}) and engine_poll_s ({cfg.engine_poll_s}) must be "
            "positive: they are intervals in seconds"
        )
    if cfg.heartbeat_ttl_s < 1 or cfg.heartbeat_ttl_s < cfg.heartbeat_s:
        raise config.ConfigError(
            f"heartbeat_ttl_s {cfg.heartbeat_ttl_s} must be at least 1 s and at least "
            f"heartbeat_s ({cfg.heartbeat_s}): the server counts TTLs in whole seconds, and a "
            "heartbeat that expires before the next one leaves the node looking silent"
        )
    if cfg.outbox_max_events < 1 or cfg.outbox_max_bytes < 4096:
        raise config.ConfigError(
            "outbox_max_events must be >= 1 and outbox_max_bytes >= 4096: the outbox keeps the "
            "node's events while NATS is unreachable"
        )
    if cfg.traces is not None:
        host, sep, port = cfg.traces.collector.rpartition(":")
        if not (sep and host and "/" not in host and port.isdigit() and 0 < int(port) < 65536):
            raise config.ConfigError(
                f"traces.collector {cfg.traces.collector!r} is not host:port: give the OTLP/gRPC "
                "collector's address, e.g. otel-collector.example.internal:4317"
            )
    if cfg.admin is not None and not cfg.admin.header_timeout_s > 0:
        raise config.ConfigError("admin.header_timeout_s must be above 0 (10 is the default)")
    errors = policy_errors(cfg.launch)
    if errors:
        raise config.ConfigError("; ".join(errors))
    return msgspec.structs.replace(cfg, node_id=node_id, address=cfg.address or node_id)


def state_dir_problems(cfg: AgentConfig) -> list[str]:
    """What stops the agent from making and writing `state_dir`, naming it: for `--check`,
    and before starting (where mkdir ended in a traceback)."""
    path = Path(cfg.state_dir)
    there = next((p for p in (path, *path.parents) if p.exists()), None)
    if there is None:
        return []
    if not there.is_dir():
        where = "is a file" if there == path else f"lies under {there}, a file"
        return [f"state_dir: {path} {where}: give a folder (it is made when missing)"]
    if not os.access(there, os.W_OK | os.X_OK):
        return [f"state_dir: {path}: this user may not write {there}: check its owner and mode"]
    return []


def load(
    path: str | Path | None = None,
    *,
    overrides: Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
    hostname: str | None = None,
) -> AgentConfig:
    """Read, overlay `LLMGW_AGENT__*`, complete and validate the agent's configuration."""
    raw = config.load(AgentConfig, path, section="AGENT", overrides=overrides, environ=environ)
    try:
        return complete(raw, hostname=hostname)
    except config.ConfigError as exc:
        named = config.name_variables(str(exc).split("\n"), "AGENT", environ, overrides=overrides)
        raise config.ConfigError("\n".join(named)) from None


def launch_context(cfg: AgentConfig, inventory: Inventory) -> LaunchContext:
    """What the engine adapters need from this node: bind address, fabrics, ports, commands."""
    return LaunchContext(
        host=cfg.engine_host or cfg.address,
        fabrics=inventory.fabrics,
        port_range=(cfg.engine_ports.first, cfg.engine_ports.last),
        commands=dict(cfg.engine_commands),
        traces=cfg.traces.collector if cfg.traces is not None else "",
        traces_insecure=cfg.traces.insecure if cfg.traces is not None else True,
    )

"""The control plane's configuration: NATS and its certificate, lease, cadences, models, admin.

Loaded by `llmgw control --config FILE` through `llmgw.config.load(ControlConfig, path,
section="CONTROL")`, so `LLMGW_CONTROL__LEASE_TTL_S=5` overrides `lease_ttl_s`. `load`
then checks what a Struct cannot: the instance name is one subject token, the timings
are ordered sensibly, and the models pass the catalog's validation, with messages that
say what to change. deploy/control.example.yaml is a commented example.
"""

from __future__ import annotations

import socket
from pathlib import Path

import msgspec

from llmgw import config
from llmgw.bus import settings
from llmgw.bus.settings import NatsConnection
from llmgw.control.quota import NodeQuota
from llmgw.core import catalog, subjects
from llmgw.core.profile import ModelProfile
from llmgw.core.reconcile import ReconcileConfig


class NatsConfig(NatsConnection, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """NATS for the control plane: its certificate has CN = `name`, OU = control."""

    stream_replicas: int = 1
    """Replicas of the log, the lease and the snapshots: 3 or 5 on a NATS cluster."""
    duplicate_window_s: float = 120.0


class AdminListener(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The read-only management API and /metrics: private (127.0.0.1) by default, or HTTPS
    that admits only operator certificates of the fleet's CA when `cert_file` is set."""

    host: str = "127.0.0.1"
    port: config.Port = 9190
    cert_file: str = ""
    """This listener's server certificate (its SANs must name `host`); empty: plain HTTP."""
    key_file: str = ""
    ca_file: str = ""
    """The fleet's CA: clients must present a certificate it issued with OU=operator."""
    header_timeout_s: float = 10.0
    """Longest wait for a request's line and headers: a connection's first request's from its
    connect (a TLS handshake included), a later one's from its first byte; a client that sends
    them slower gets 408 and its connection is closed (llmgw.http_server)."""


class SnapshotConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """When the leader saves folded state, so that a cold start is snapshot + tail."""

    every_events: int = 10_000
    """After this many events folded since the last snapshot (0: never by count)."""
    every_s: float = 300.0
    """Or after this many seconds, if anything was folded since (0: never by time)."""
    keep: int = 5


class ControlConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str = ""
    """Instance name: the CN of this control plane's certificate (default: short hostname).
    Two control planes need two names, each with its own certificate."""
    nats: NatsConfig = NatsConfig()
    lease_ttl_s: float = 10.0
    """A leader that stops renewing loses the lease after this; a standby then takes over."""
    reconcile_interval_s: float = 1.0
    """Reconcile at least this often (heartbeat ages), besides after every new event."""
    reconcile: ReconcileConfig = ReconcileConfig()
    snapshot: SnapshotConfig = SnapshotConfig()
    node_quota: NodeQuota = NodeQuota()
    """Each node's budget of log traffic: over it, the leader quarantines the node."""
    models: tuple[ModelProfile, ...] = ()
    """Declared in the log at start (ModelDeclared / ModelChanged / ModelRemoved, diffed
    against it): the models this file declared and no longer lists are removed; models an
    operator declared with `llmgw ctl` are left alone."""
    sync_models: bool = True
    """Set false to leave the catalog entirely to `llmgw ctl`."""
    admin: AdminListener = AdminListener()
    log_level: config.LogLevel = "info"


def _short_hostname() -> str:
    return socket.gethostname().split(".", 1)[0]


def validate(cfg: ControlConfig, *, where: str = "control config") -> list[str]:
    """Every problem with `cfg`, each saying what to change. Purely computational."""
    problems: list[str] = []
    try:
        subjects.check_token(cfg.name, "name")
    except subjects.SubjectTokenError as exc:
        problems.append(f"{exc} (set `name`, the CN of this control plane's certificate)")
    if cfg.lease_ttl_s < 1:
        problems.append(
            f"lease_ttl_s is {cfg.lease_ttl_s}: the server counts TTLs in whole seconds, "
            "use 1 or more (10 is a good production value)"
        )
    if cfg.reconcile_interval_s <= 0:
        problems.append("reconcile_interval_s must be above 0 (1.0 is a good value)")
    r = cfg.reconcile
    if r.unreachable_after_s <= 0:
        problems.append("reconcile.unreachable_after_s must be above 0")
    if r.lost_after_s < r.unreachable_after_s:
        problems.append(
            f"reconcile.lost_after_s ({r.lost_after_s}) is below unreachable_after_s "
            f"({r.unreachable_after_s}): a node is lost only after being unreachable; raise it"
        )
    if cfg.snapshot.every_events < 0 or cfg.snapshot.every_s < 0:
        problems.append("snapshot.every_events and snapshot.every_s must be 0 (never) or more")
    nq = cfg.node_quota
    if not nq.window_s > 0 or nq.max_messages < 1 or nq.max_bytes < 1:
        problems.append(
            "node_quota: window_s, max_messages and max_bytes must be above 0 "
            "(600, 5000 and 67108864 are the defaults; set enabled: false to measure nothing)"
        )
    if cfg.snapshot.keep < 1:
        problems.append("snapshot.keep must be at least 1")
    problems += _nats_problems(cfg.nats)
    a = cfg.admin
    if any((a.cert_file, a.key_file, a.ca_file)) and not all((a.cert_file, a.key_file, a.ca_file)):
        problems.append(
            "admin: set all of cert_file, key_file and ca_file for HTTPS with operator "
            "certificates, or none of them for plain HTTP (then keep host 127.0.0.1)"
        )
    if not a.header_timeout_s > 0:
        problems.append("admin.header_timeout_s must be above 0 (10 is the default)")
    owners: dict[str, ModelProfile] = {}
    names: set[str] = set()
    for i, profile in enumerate(cfg.models):
        if profile.name in names:
            problems.append(f"models[{i}]: model {profile.name!r} is listed twice: merge them")
            continue
        names.add(profile.name)
        others = catalog.sharing(catalog.names_of(profile), owners)
        for problem in catalog.problems(profile, others):
            problems.append(f"models[{i}] ({profile.name!r}): {problem}")
        for name in catalog.names_of(profile):
            owners.setdefault(name, profile)
    return [f"{where}: {p}" for p in problems]


def _nats_problems(nats: NatsConfig) -> list[str]:
    problems = nats.problems(
        "nats",
        "the control plane connects with mutual TLS; "
        "issue its certificate with `llmgw ctl cert issue control <name>`",
    )
    if not 1 <= nats.stream_replicas <= 5:
        problems.append(
            f"nats.stream_replicas is {nats.stream_replicas}: JetStream keeps 1 to 5 replicas"
            " (1 on a single server, 3 or 5 on a cluster)"
        )
    if not nats.duplicate_window_s > 0:
        # The server reads 0 as its default of 2 minutes: the stream is made, and every
        # later start finds its window differing from the configured one.
        problems.append("nats.duplicate_window_s must be above 0 seconds (120 is the default)")
    return problems


def file_problems(cfg: ControlConfig) -> list[str]:
    """What is wrong with the files `cfg` names (certificates), for `--check`."""
    problems = cfg.nats.file_problems("nats")
    for field in ("cert_file", "key_file", "ca_file"):
        path = getattr(cfg.admin, field)
        if path:
            problems += settings.file_problem(f"admin.{field}", path)
    return problems


def load(path: str | Path | None) -> ControlConfig:
    """Load, default the name to the short hostname, validate; raises config.ConfigError."""
    cfg = config.load(ControlConfig, path, section="CONTROL")
    if not cfg.name:
        cfg = msgspec.structs.replace(cfg, name=_short_hostname())
    where = str(path) if path is not None else "control config"
    problems = validate(cfg, where=where)
    if problems:
        named = config.name_variables(problems, "CONTROL", where=where)
        raise config.ConfigError("\n".join(named))
    return cfg

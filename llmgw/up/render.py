"""The configuration of every process `llmgw up` starts, as the YAML mappings their own
loaders read (`llmgw control --config`, `llmgw agent --config`, `llmgw router --config`,
`LLMGW_CTL_CONFIG`): `up` runs the very commands an operator would, with files it wrote.

Purely computational: `Plan` says what to run, and each function returns a mapping.
Used by `llmgw.up.running`, which writes them under the state directory (`Layout`).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from llmgw.core.profile import Engine, ModelProfile
from llmgw.pki.identity import Identity
from llmgw.pki.store import CertDir
from llmgw.up.layout import Layout

CONTROL = Identity("control", "control-1")
ROUTER = Identity("router", "router-1")
OPERATOR = Identity("operator", "admin")
# llama-server with several slots per replica; the context is split between the slots.
LLAMACPP_CONTEXT = 4096
LLAMACPP_SLOTS = 4


@dataclass(frozen=True)
class Plan:
    """What one `llmgw up` runs: decided from the command line, before anything starts."""

    layout: Layout
    nodes: int = 2
    gpus: str = "8xh100-80g"
    model: str = "demo"
    replicas: int = 2
    host: str = "127.0.0.1"
    port: int = 8080
    engine: Engine = "sim"
    model_file: str = ""
    llama_server: str = ""
    engine_threads: int = 2

    @property
    def node_ids(self) -> list[str]:
        return [f"node-{i}" for i in range(1, self.nodes + 1)]

    @property
    def identities(self) -> list[Identity]:
        return [CONTROL, ROUTER, OPERATOR, *(Identity("node", n) for n in self.node_ids)]


def node_address(root: Path, index: int) -> str:
    """The loopback address of simulated node `index` (1-based): 127.A.B.(10 + index).

    Every node's engines bind their own address, so the ports placement hands out (from 8100
    on each node) never collide between the nodes of one machine; A.B come from the state
    directory's path, so two `up`s in two directories do not collide either (all of
    127.0.0.0/8 is loopback on Linux). Purely computational.
    """
    digest = zlib.crc32(str(root).encode())
    a = 1 + digest % 254
    b = 1 + (digest // 254) % 254
    return f"127.{a}.{b}.{10 + index}"


def profile(plan: Plan) -> ModelProfile:
    """The one model the embedded fleet serves, as the control plane declares it."""
    if plan.engine == "llamacpp":
        return ModelProfile(
            name=plan.model,
            engine="llamacpp",
            model=plan.model_file,
            replicas=plan.replicas,
            max_model_len=LLAMACPP_CONTEXT,
            engine_args=(
                "--threads",
                str(plan.engine_threads),
                "--parallel",
                str(LLAMACPP_SLOTS),
            ),
            start_timeout_s=60.0,
            load_timeout_s=120.0,
        )
    return ModelProfile(name=plan.model, engine=plan.engine, replicas=plan.replicas)


def _nats(plan: Plan, url: str, identity: Identity) -> dict[str, Any]:
    certs = CertDir(plan.layout.certs)
    return {
        "servers": [url],
        "ca_file": str(certs.ca_cert),
        "cert_file": str(certs.cert(identity)),
        "key_file": str(certs.key(identity)),
    }


def control(plan: Plan, nats_url: str) -> dict[str, Any]:
    return {
        "name": CONTROL.name,
        "nats": _nats(plan, nats_url, CONTROL),
        # One instance: a lease left by a killed previous run lapses quickly.
        "lease_ttl_s": 3,
        "reconcile_interval_s": 0.5,
        "reconcile": {
            "unreachable_after_s": 10,
            "lost_after_s": 30,
            "restart_backoff_s": 2,
            "shard_drain_s": 5,
            "stop_grace_s": 5,
        },
        # The model is declared by `up` with `llmgw ctl apply` once every node has
        # registered (see `models`): declared at start, all its replicas would land on
        # whichever node registered first.
        "models": [],
        "admin": {"host": "127.0.0.1", "port": 0},
        "log_level": "info",
    }


def agent(plan: Plan, nats_url: str, node: str, index: int) -> dict[str, Any]:
    address = node_address(plan.layout.root, index)
    settings: dict[str, Any] = {
        "node_id": node,
        "address": address,
        "nats": _nats(plan, nats_url, Identity("node", node)),
        "state_dir": str(plan.layout.agent_state(node)),
        "sim_gpus": plan.gpus,
        "engine_host": address,
        "heartbeat_s": 2,
        "heartbeat_ttl_s": 60,
        "engine_poll_s": 0.2,
        "stop_grace_s": 5,
        "log_level": "info",
    }
    if plan.llama_server:
        settings["engine_commands"] = {"llamacpp": [plan.llama_server]}
    return settings


def router(plan: Plan, nats_url: str, state_dir: str) -> dict[str, Any]:
    """The router's config: it reads the log as its `router` identity, so the model (one
    description, shared with the scheduler) and its endpoints come from the control plane's
    events, and it keeps routing on the last known endpoints while NATS is down (keeping
    what it owes the budgets meanwhile in `state_dir`)."""
    n = _nats(plan, nats_url, ROUTER)
    return {
        "listen": {"host": plan.host, "port": plan.port},
        "admin": {"host": "127.0.0.1", "port": 0},
        "workers": 1,
        "state_dir": state_dir,
        "log": {
            "servers": n["servers"],
            "ca_file": n["ca_file"],
            "cert_file": n["cert_file"],
            "key_file": n["key_file"],
            "name": ROUTER.name,
        },
        # A private demo on loopback: no API keys. A router others reach needs keys_file.
        "auth": {"allow_anonymous": True},
        "probe_interval_s": 0.5,
        "log_level": "info",
    }


def ctl(plan: Plan, nats_url: str) -> dict[str, Any]:
    n = _nats(plan, nats_url, OPERATOR)
    return {
        "servers": n["servers"],
        "ca_file": n["ca_file"],
        "cert_file": n["cert_file"],
        "key_file": n["key_file"],
    }


def models(plan: Plan) -> dict[str, Any]:
    """The catalog file `llmgw ctl apply -f` declares: the one demo model."""
    return {"models": [msgspec.to_builtins(profile(plan))]}

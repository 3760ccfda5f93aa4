"""Data shared by the engine adapters: what a launch needs from the node, and what it yields."""

from __future__ import annotations

import sys
from collections.abc import Mapping

import msgspec

from llmgw.core.inventory import Fabric
from llmgw.core.profile import Engine

# How each engine is started when the agent config does not say otherwise.
DEFAULT_COMMANDS: Mapping[Engine, tuple[str, ...]] = {
    "vllm": ("vllm", "serve"),
    "sglang": ("python3", "-m", "sglang.launch_server"),
    "llamacpp": ("llama-server",),
    "sim": (sys.executable, "-m", "llmgw", "sim"),
}


class LaunchContext(msgspec.Struct, frozen=True, kw_only=True):
    """What the node adds to a LaunchSpec: its bind address, fabrics, ports and engine commands."""

    host: str = "127.0.0.1"
    """Where engines bind: the node's serving address (`llmgw.agent.config.launch_context`)."""
    fabrics: tuple[Fabric, ...] = ()
    port_range: tuple[int, int] = (1, 65535)
    commands: dict[Engine, tuple[str, ...]] = msgspec.field(default_factory=dict)
    """Overrides of DEFAULT_COMMANDS, e.g. {"vllm": ("/opt/vllm/bin/vllm", "serve")}."""
    traces: str = ""
    """`host:port` of the OTLP/gRPC collector engines that trace send to; empty: none."""
    traces_insecure: bool = True

    def command(self, engine: Engine) -> tuple[str, ...]:
        return tuple(self.commands.get(engine, DEFAULT_COMMANDS[engine]))


class Launch(msgspec.Struct, frozen=True, kw_only=True):
    """An engine process to start: argv, environment additions, and how to tell it is ready."""

    argv: tuple[str, ...]
    env: dict[str, str]
    port: int
    http: bool = True
    """Readiness over HTTP; False for headless multi-node workers, which serve no HTTP."""
    served_name: str = ""
    probe_host: str = "127.0.0.1"
    """Where the agent itself asks /health and /v1/models (the bind address, or loopback)."""
    listens_before_loading: bool = True
    """vLLM, llama.cpp and the sim open their port first and load after; SGLang opens it
    only once the weights are loaded, so for it the start deadline covers loading too."""
    api_key: str = ""
    """The key the engine requires on its API (`Authorization: Bearer`); empty: none.
    Set by `llmgw.agent.engines.keyed`; never logged."""
    kv_events: str = ""
    """The node-local ZMQ address the engine publishes its KV events on (empty: none), and
    its replay socket: set by `llmgw.agent.engines.kv_evented`, read by the KV relay."""
    kv_replay: str = ""

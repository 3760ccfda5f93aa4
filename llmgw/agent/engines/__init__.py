"""Engine adapters: from a StartShard's LaunchSpec to the exact argv and environment of an engine.

One module per engine (vllm, sglang, sim, llamacpp), each a pure function of
the spec; `plan` validates the spec against the node's inventory first
(`llmgw.agent.engines.validation`), because an engine refuses a bad profile
only after minutes of loading; what the node's own launch policy allows is
`llmgw.agent.engines.policy`. The supervisor runs what `plan` returns.
Purely computational, no side effects: the caller (the agent service) acts.
`keyed` adds the API key the supervisor draws for an engine that serves HTTP.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import msgspec

from llmgw.agent.engines import llamacpp, sglang, sim, validation, vllm
from llmgw.agent.engines.common import Launch, LaunchContext
from llmgw.agent.engines.validation import LaunchRefused
from llmgw.core.inventory import Inventory
from llmgw.core.profile import Engine, LaunchSpec

__all__ = [
    "ADAPTERS",
    "API_KEY_ENV",
    "Launch",
    "LaunchContext",
    "LaunchRefused",
    "environment",
    "keyed",
    "kv_evented",
    "plan",
]

Adapter = Callable[[LaunchSpec, LaunchContext], tuple[str, ...]]

ADAPTERS: Mapping[Engine, Adapter] = {
    "vllm": vllm.argv,
    "sglang": sglang.argv,
    "sim": sim.argv,
    "llamacpp": llamacpp.argv,
}


API_KEY_ENV: Mapping[Engine, str] = {
    "vllm": "VLLM_API_KEY",
    "llamacpp": "LLAMA_API_KEY",
    "sim": "LLMGW_SIM_API_KEY",
}
"""Where each engine reads its API key from the environment. SGLang 0.5.23 has no such
variable: it gets `--api-key` on its command line."""


def keyed(spec: LaunchSpec, launch: Launch, api_key: str) -> Launch:
    """`launch` with the engine requiring `api_key` on its API. Purely computational.

    The environment is preferred over argv: a command line is readable by every local
    user (`ps`, /proc/<pid>/cmdline), and vLLM logs its non-default arguments at start.
    The key comes last, after the spec's env and engine_args, so the agent's value wins
    (validation refuses a spec that sets one itself). The supervisor calls it for shard
    0 of a generation, the one routers reach.
    """
    variable = API_KEY_ENV.get(spec.engine)
    if variable is not None:
        return msgspec.structs.replace(
            launch, env={**launch.env, variable: api_key}, api_key=api_key
        )
    return msgspec.structs.replace(
        launch, argv=(*launch.argv, "--api-key", api_key), api_key=api_key
    )


KV_EVENT_ENGINES: frozenset[Engine] = frozenset({"vllm", "sglang", "sim"})
"""Engines that publish their KV cache's block events (`--kv-events-config`); llama.cpp
does not, and routers keep their own approximate index for it."""


def kv_evented(spec: LaunchSpec, launch: Launch, socket_dir: str) -> Launch:
    """`launch` with the engine publishing its KV events on ipc sockets in `socket_dir`.
    Purely computational.

    Only for the shard routers reach (rank 0, serving HTTP) of an engine that has them,
    and not when the operator's engine arguments configure KV events themselves. ipc://
    keeps the events on the node: the agent relays them onto NATS under its own name.
    """
    if spec.engine not in KV_EVENT_ENGINES or spec.node_rank != 0 or not launch.http:
        return launch
    if any(a == "--kv-events-config" or a.startswith("--kv-events-config=") for a in launch.argv):
        return launch
    base = f"ipc://{socket_dir.rstrip('/')}/{spec.port}"
    events_addr, replay_addr = f"{base}.events", f"{base}.replay"
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": events_addr,
        "replay_endpoint": replay_addr,
        "topic": "kv",
    }
    return msgspec.structs.replace(
        launch,
        argv=(*launch.argv, "--kv-events-config", msgspec.json.encode(config).decode()),
        kv_events=events_addr,
        kv_replay=replay_addr,
    )


def environment(spec: LaunchSpec, context: LaunchContext) -> dict[str, str]:
    """What the engine's environment adds to the agent's: the spec's, then GPU and NCCL pinning.

    The agent's values win over the spec's: CUDA_VISIBLE_DEVICES is what keeps two
    shards off one GPU, and NCCL_IB_HCA must be exactly the fabric's adapters.
    """
    env = dict(spec.env)
    # CUDA numbers devices fastest-first by default, NVML and nvidia-smi by PCI bus:
    # without this, index 3 in the inventory is not device 3 for the engine.
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in spec.gpus)
    if spec.fabric:
        fabric = next(f for f in context.fabrics if f.name == spec.fabric)
        # "=" makes NCCL match names exactly: a bare "mlx5_1" would also match mlx5_10.
        # Leaving it open lets NCCL pick an adapter on a fabric where the peer is
        # unreachable, and the job hangs instead of failing.
        env["NCCL_IB_HCA"] = "=" + ",".join(fabric.hcas)
    if context.traces and spec.engine in ("vllm", "sglang"):
        # The OpenTelemetry SDK's own settings: a name to tell engines from routers in a
        # trace (the spec may name it otherwise), and plain gRPC to an in-fleet collector.
        env.setdefault("OTEL_SERVICE_NAME", spec.engine)
        if context.traces_insecure:
            env["OTEL_EXPORTER_OTLP_TRACES_INSECURE"] = "true"
    return env


def plan(
    spec: LaunchSpec,
    inventory: Inventory,
    context: LaunchContext,
    *,
    busy_gpus: frozenset[int] = frozenset(),
) -> Launch:
    """Validate `spec` on this node, then build its command; LaunchRefused lists every reason."""
    validation.check(spec, inventory, context, busy_gpus=busy_gpus)
    argv = ADAPTERS[spec.engine](spec, context)
    return Launch(
        argv=argv,
        env=environment(spec, context),
        port=spec.port,
        http=spec.node_rank == 0 or spec.engine in ("sim", "llamacpp"),
        served_name=spec.served_name,
        probe_host=probe_host(context.host),
        listens_before_loading=spec.engine != "sglang",
    )


def probe_host(bind: str) -> str:
    """The address the agent reaches a local engine at: loopback for a wildcard bind."""
    if bind in ("", "0.0.0.0", "::", "[::]"):
        return "127.0.0.1"
    return bind

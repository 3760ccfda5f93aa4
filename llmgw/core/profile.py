"""Model profiles and launch specifications: the data that crosses from catalog to engine.

A ModelProfile is the one description of a model (placement needs, engine
settings, routing aliases, fallbacks and deadlines); operators declare it and
routers and the control plane both read it from the log. A LaunchSpec is what
one shard of one replica needs to start an engine on one node; StartShard
carries it. Validation lives in `llmgw.core.catalog`. Pure data.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from llmgw.core.autoscale import Autoscale
from llmgw.core.limits import (
    Args,
    Env,
    GpuIndices,
    ModelLen,
    Name,
    Names,
    Parallel,
    Port,
    Replicas,
    ShardIndex,
    SignedSeconds,
    Text,
)

Engine = Literal["vllm", "sglang", "sim", "llamacpp"]
Dtype = Literal["auto", "bfloat16", "float16", "float32", "fp8"]


class Deadlines(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How long a router waits at each phase of a request, in seconds."""

    connect_s: SignedSeconds = 2.0
    headers_s: SignedSeconds = 30.0
    first_token_s: SignedSeconds = 60.0
    idle_s: SignedSeconds = 30.0
    """Longest silence between two streamed chunks: a wedged engine, not a slow one.

    The router cuts a silent stream after idle_s, at most a few milliseconds late."""
    total_s: SignedSeconds = 600.0


class Queueing(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """When a router holds a model's requests back, and how many it lets wait.

    An endpoint is full while this router has `max_inflight_per_endpoint` requests in
    flight on it, or while its engine reports `max_engine_waiting` requests waiting (its
    /metrics, as the probes read it); 0 turns either bound off. While every ready endpoint
    of the model is full, its requests wait in the router's fair queue (priority classes,
    then the keys of a class in turn: llmgw.core.fairqueue) for at most `max_wait_s` and
    the model's total deadline; at most `max_queued` of them per router process, beyond
    which the answer is 503 with Retry-After."""

    max_inflight_per_endpoint: Replicas = 0
    max_engine_waiting: Replicas = 0
    max_queued: Replicas = 256
    max_wait_s: SignedSeconds = 30.0

    @property
    def capped(self) -> bool:
        return self.max_inflight_per_endpoint > 0 or self.max_engine_waiting > 0

    def problems(self) -> list[str]:
        out = []
        for field in ("max_inflight_per_endpoint", "max_engine_waiting", "max_queued"):
            if getattr(self, field) < 0:
                out.append(f"queue.{field} is {getattr(self, field)}: use 0 or more")
        if not self.max_wait_s > 0:
            out.append(f"queue.max_wait_s is {self.max_wait_s}: use a positive number of seconds")
        return out


class ModelProfile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One model as the fleet serves it: where it may run, how to start it, how to route it."""

    name: Name
    """The served model name clients ask for."""
    engine: Engine = "vllm"
    model: Text = ""
    """What the engine loads: a Hugging Face id or a path on the node; defaults to `name`."""
    aliases: Names = ()
    replicas: Replicas = 1
    tensor_parallel: Parallel = 1
    pipeline_parallel: Parallel = 1
    nodes: Parallel = 1
    """Nodes per replica; more than one needs a shared RDMA fabric."""
    gpu_class: Name = ""
    """e.g. `h100-80g`; empty accepts any class (GPUs of one replica still never mix)."""
    dtype: Dtype = "auto"
    max_model_len: ModelLen | None = None
    engine_args: Args = ()
    env: Env = {}
    start_timeout_s: SignedSeconds = 60.0
    """Process start until /health answers."""
    load_timeout_s: SignedSeconds = 1800.0
    """/health until /v1/models lists the model: a 70B model legitimately takes minutes."""
    fallbacks: Names = ()
    tokenizer: Text = ""
    """Where routers find the model's tokenizer (a tokenizer.json, or a directory with it
    and tokenizer_config.json) to key its KV cache's blocks; empty: the model's own
    directory when `model` is a local path (sim models use the sim's tokenizer)."""
    deadlines: Deadlines = Deadlines()
    autoscale: Autoscale | None = None
    """Replicas that follow the load (llmgw.core.autoscale); `replicas` is then the count
    it starts with. None: `replicas`, always."""
    queue: Queueing = Queueing()
    """When routers queue its requests rather than send them (no bound by default)."""

    @property
    def gpus_per_replica(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def gpus_per_node(self) -> int:
        return self.gpus_per_replica // max(self.nodes, 1)

    @property
    def engine_model(self) -> str:
        return self.model or self.name


class LaunchSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Everything one node needs to start one shard of a replica, decided by the control plane."""

    engine: Engine
    model: Text
    served_name: Name
    aliases: Names = ()
    port: Port
    gpus: GpuIndices
    """Indices of this node's GPUs the shard uses (CUDA_VISIBLE_DEVICES)."""
    gpu_class: Name = ""
    tensor_parallel: Parallel = 1
    pipeline_parallel: Parallel = 1
    nnodes: Parallel = 1
    node_rank: ShardIndex = 0
    head_address: Name = ""
    """Multi-node: the rank-0 node's address, which the other ranks dial."""
    head_port: Port = 0
    fabric: Name = ""
    dtype: Dtype = "auto"
    max_model_len: ModelLen | None = None
    engine_args: Args = ()
    env: Env = {}
    """Environment for the engine, NCCL variables of the chosen fabric included."""
    start_timeout_s: SignedSeconds = 60.0
    load_timeout_s: SignedSeconds = 1800.0

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

Engine = Literal["vllm", "sglang", "sim", "llamacpp"]
Dtype = Literal["auto", "bfloat16", "float16", "float32", "fp8"]


class Deadlines(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How long a router waits at each phase of a request, in seconds."""

    connect_s: float = 2.0
    headers_s: float = 30.0
    first_token_s: float = 60.0
    idle_s: float = 30.0
    """Longest silence between two streamed chunks: a wedged engine, not a slow one.

    The router cuts a silent stream after idle_s, at most a few milliseconds late."""
    total_s: float = 600.0


class ModelProfile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One model as the fleet serves it: where it may run, how to start it, how to route it."""

    name: str
    """The served model name clients ask for."""
    engine: Engine = "vllm"
    model: str = ""
    """What the engine loads: a Hugging Face id or a path on the node; defaults to `name`."""
    aliases: tuple[str, ...] = ()
    replicas: int = 1
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    nodes: int = 1
    """Nodes per replica; more than one needs a shared RDMA fabric."""
    gpu_class: str = ""
    """e.g. `h100-80g`; empty accepts any class (GPUs of one replica still never mix)."""
    dtype: Dtype = "auto"
    max_model_len: int | None = None
    engine_args: tuple[str, ...] = ()
    env: dict[str, str] = {}
    start_timeout_s: float = 60.0
    """Process start until /health answers."""
    load_timeout_s: float = 1800.0
    """/health until /v1/models lists the model: a 70B model legitimately takes minutes."""
    fallbacks: tuple[str, ...] = ()
    deadlines: Deadlines = Deadlines()

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
    model: str
    served_name: str
    aliases: tuple[str, ...] = ()
    port: int
    gpus: tuple[int, ...]
    """Indices of this node's GPUs the shard uses (CUDA_VISIBLE_DEVICES)."""
    gpu_class: str = ""
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    nnodes: int = 1
    node_rank: int = 0
    head_address: str = ""
    """Multi-node: the rank-0 node's address, which the other ranks dial."""
    head_port: int = 0
    fabric: str = ""
    dtype: Dtype = "auto"
    max_model_len: int | None = None
    engine_args: tuple[str, ...] = ()
    env: dict[str, str] = {}
    """Environment for the engine, NCCL variables of the chosen fabric included."""
    start_timeout_s: float = 60.0
    load_timeout_s: float = 1800.0

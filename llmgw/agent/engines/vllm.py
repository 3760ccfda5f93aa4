"""vLLM (`vllm serve`, its options checked against vLLM 0.33.0's argument parser).

Multi-node uses the multiprocessing backend: identical commands on every node
but `--node-rank`, `--master-addr/--master-port` pointing at rank 0, and
`--headless` on the other ranks, which serve no HTTP (docs/design.md, "Multi-node
engines").
"""

from __future__ import annotations

from llmgw.agent.engines.common import LaunchContext
from llmgw.core.profile import LaunchSpec


def argv(spec: LaunchSpec, context: LaunchContext) -> tuple[str, ...]:
    """The command line of one vLLM shard. Purely computational, no side effects."""
    args = [*context.command("vllm"), spec.model]
    if spec.node_rank == 0:
        args += ["--served-model-name", spec.served_name, *spec.aliases]
        args += ["--host", context.host, "--port", str(spec.port)]
        if context.traces:
            # vLLM continues a request's W3C trace context (routers forward it).
            args += ["--otlp-traces-endpoint", f"grpc://{context.traces}"]
    args += ["--tensor-parallel-size", str(spec.tensor_parallel)]
    args += ["--pipeline-parallel-size", str(spec.pipeline_parallel)]
    if spec.dtype == "fp8":
        # vLLM's --dtype has no fp8: FP8 is a quantization method (online dynamic FP8).
        args += ["--quantization", "fp8"]
    elif spec.dtype != "auto":
        args += ["--dtype", spec.dtype]
    if spec.max_model_len is not None:
        args += ["--max-model-len", str(spec.max_model_len)]
    if spec.nnodes > 1:
        args += ["--nnodes", str(spec.nnodes), "--node-rank", str(spec.node_rank)]
        args += ["--master-addr", spec.head_address, "--master-port", str(spec.head_port)]
        if spec.node_rank > 0:
            args.append("--headless")
    return (*args, *spec.engine_args)

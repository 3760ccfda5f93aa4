"""SGLang (`python -m sglang.launch_server`, its options checked against 0.5.23).

Full option names only: SGLang's parser accepts unique prefixes, and `--pp`
is ambiguous in 0.5.23. Multi-node: the same command on every node but
`--node-rank`, all dialing `--dist-init-addr` = rank 0; ranks above 0 run
schedulers only, without HTTP (docs/design.md, "Multi-node engines").
"""

from __future__ import annotations

from llmgw.agent.engines.common import LaunchContext
from llmgw.core.profile import LaunchSpec


def argv(spec: LaunchSpec, context: LaunchContext) -> tuple[str, ...]:
    """The command line of one SGLang shard. Purely computational, no side effects."""
    args = [*context.command("sglang"), "--model-path", spec.model]
    args += ["--tp-size", str(spec.tensor_parallel), "--pp-size", str(spec.pipeline_parallel)]
    if spec.dtype == "fp8":
        args += ["--quantization", "fp8"]
    elif spec.dtype != "auto":
        args += ["--dtype", spec.dtype]
    if spec.max_model_len is not None:
        args += ["--context-length", str(spec.max_model_len)]
    if spec.node_rank == 0:
        # --served-model-name takes one name in SGLang; aliases are the router's business.
        args += ["--host", context.host, "--port", str(spec.port)]
        args += ["--served-model-name", spec.served_name]
        # Without it SGLang has no /metrics, and routers score it blind.
        args.append("--enable-metrics")
        if context.traces:
            args += ["--enable-trace", "--otlp-traces-endpoint", context.traces]
    if spec.nnodes > 1:
        args += ["--nnodes", str(spec.nnodes), "--node-rank", str(spec.node_rank)]
        args += ["--dist-init-addr", f"{spec.head_address}:{spec.head_port}"]
    return (*args, *spec.engine_args)

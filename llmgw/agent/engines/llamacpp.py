"""llama.cpp's `llama-server` (checked against 0c1e57098: llama-server-flags.txt).

One node only (no NCCL; validation refuses multi-node and tensor parallel);
several GPUs of one node are used by layer split. `--port` is always given:
the default moved from 8080 to 9931 in newer builds.
"""

from __future__ import annotations

from llmgw.agent.engines.common import LaunchContext
from llmgw.core.profile import LaunchSpec


def argv(spec: LaunchSpec, context: LaunchContext) -> tuple[str, ...]:
    """The command line of a llama-server. Purely computational, no side effects."""
    names = ",".join((spec.served_name, *spec.aliases))
    args = [*context.command("llamacpp"), "--model", spec.model, "--alias", names]
    args += ["--host", context.host, "--port", str(spec.port)]
    # /metrics exists only with --metrics; the web UI is not for a fleet endpoint.
    args += ["--metrics", "--no-webui"]
    if spec.max_model_len is not None:
        args += ["--ctx-size", str(spec.max_model_len)]
    if spec.gpus:
        # "auto" may keep layers on the CPU without saying so; a GPU shard offloads all.
        args += ["--gpu-layers", "all"]
        if len(spec.gpus) > 1:
            args += ["--split-mode", "layer"]
    return (*args, *spec.engine_args)

"""The simulated engine, `llmgw sim` (contract 4): the engine every test and `llmgw up` runs."""

from __future__ import annotations

from llmgw.agent.engines.common import LaunchContext
from llmgw.core.profile import LaunchSpec


def argv(spec: LaunchSpec, context: LaunchContext) -> tuple[str, ...]:
    """The command line of `llmgw sim`. Purely computational, no side effects."""
    args = [*context.command("sim"), "--host", context.host, "--port", str(spec.port)]
    for name in (spec.served_name, *spec.aliases):
        args += ["--served-model-name", name]
    if spec.max_model_len is not None:
        args += ["--max-model-len", str(spec.max_model_len)]
    return (*args, *spec.engine_args)

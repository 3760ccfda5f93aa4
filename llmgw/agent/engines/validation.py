"""Checks a LaunchSpec must pass on this node before any engine starts.

An engine refuses a bad profile only after minutes of loading weights, and some
mistakes (an adapter on the wrong fabric) never fail at all: they hang. So the
agent refuses up front, with every reason at once and what to change.
Purely computational, no side effects; `llmgw.agent.engines.plan` calls it. What the
node's own launch policy allows is `llmgw.agent.engines.policy`.
"""

from __future__ import annotations

from llmgw.agent.engines.common import LaunchContext
from llmgw.core.inventory import Gpu, Inventory
from llmgw.core.profile import LaunchSpec

FP8_MIN_CAPABILITY = (8, 9)


class LaunchRefused(ValueError):
    """A LaunchSpec this node must not start; `reasons` lists every problem found."""

    def __init__(self, reasons: list[str]) -> None:
        self.reasons = tuple(reasons)
        super().__init__("; ".join(reasons))


def capability(value: str) -> tuple[int, int] | None:
    """'8.9' -> (8, 9); anything else -> None (unknown)."""
    major, dot, minor = value.strip().partition(".")
    if not (major.isdigit() and (not dot or minor.isdigit())):
        return None
    return int(major), int(minor or 0)


def _cpu_only(spec: LaunchSpec) -> bool:
    """llama.cpp and the simulator can run without a GPU (a CPU node, a test machine)."""
    return (
        spec.engine in ("llamacpp", "sim")
        and not spec.gpus
        and spec.tensor_parallel * spec.pipeline_parallel == 1
        and spec.nnodes == 1
    )


def _arithmetic(spec: LaunchSpec) -> list[str]:
    tp, pp, nodes = spec.tensor_parallel, spec.pipeline_parallel, spec.nnodes
    if min(tp, pp, nodes) < 1:
        return [
            f"tensor_parallel ({tp}), pipeline_parallel ({pp}) and nnodes ({nodes}) must be >= 1"
        ]
    problems = []
    if (tp * pp) % nodes:
        problems.append(
            f"tensor_parallel x pipeline_parallel = {tp * pp} GPUs cannot be split evenly over "
            f"{nodes} nodes: make it a multiple of the node count"
        )
    elif not _cpu_only(spec) and len(spec.gpus) != tp * pp // nodes:
        problems.append(
            f"this shard has {len(spec.gpus)} GPUs but tensor_parallel {tp} x pipeline_parallel "
            f"{pp} over {nodes} node(s) needs {tp * pp // nodes} per node"
        )
    if len(set(spec.gpus)) != len(spec.gpus):
        problems.append(f"GPU indices repeat in {list(spec.gpus)}: each GPU can be used once")
    if not 0 <= spec.node_rank < nodes:
        problems.append(f"node_rank {spec.node_rank} is outside 0..{nodes - 1}")
    return problems


def _multi_node(spec: LaunchSpec, context: LaunchContext) -> list[str]:
    if spec.nnodes == 1:
        return []
    problems = []
    if spec.engine == "llamacpp":
        problems.append(
            "llama.cpp cannot run one replica over several nodes (no NCCL): use nodes: 1"
        )
    if not spec.head_address:
        problems.append("a multi-node shard needs head_address: the rank-0 node's address")
    if not 1 <= spec.head_port <= 65535:
        problems.append(f"head_port {spec.head_port} is not a port (1-65535)")
    if not spec.fabric:
        problems.append(
            "a multi-node shard needs a fabric: without one NCCL may pick any adapter, "
            "and a peer it cannot reach hangs the first all-reduce"
        )
    return problems


def _fabric(spec: LaunchSpec, context: LaunchContext) -> list[str]:
    if not spec.fabric:
        return []
    names = [f.name for f in context.fabrics]
    fabric = next((f for f in context.fabrics if f.name == spec.fabric), None)
    if fabric is None:
        return [
            f'this node is not on fabric "{spec.fabric}" (it has {names or "none"}): '
            "place the replica on nodes that declare it, or add it to this agent's fabrics"
        ]
    if not fabric.hcas:
        return [f'fabric "{spec.fabric}" lists no HCAs on this node: add them to the agent config']
    return []


def _gpus(spec: LaunchSpec, gpus: dict[int, Gpu], busy: frozenset[int]) -> list[str]:
    problems = []
    chosen = []
    for index in spec.gpus:
        gpu = gpus.get(index)
        if gpu is None:
            problems.append(f"GPU {index} does not exist on this node (it has {sorted(gpus)})")
            continue
        chosen.append(gpu)
        if gpu.health_problems:
            problems.append(f"GPU {index} is unhealthy: {', '.join(gpu.health_problems)}")
        if index in busy:
            problems.append(f"GPU {index} is already used by another shard on this node")
    classes = sorted({g.gpu_class for g in chosen})
    if len(classes) > 1:
        # A tensor-parallel group runs at the pace of its slowest member, and
        # memory plans assume one size: mixed GPUs fail late or run badly.
        problems.append(
            f"GPUs of different classes in one shard ({', '.join(classes)}): use one class"
        )
    if spec.gpu_class and chosen and classes != [spec.gpu_class]:
        problems.append(
            f"the shard asks for {spec.gpu_class} but GPUs {list(spec.gpus)} are {classes}"
        )
    if spec.dtype == "fp8":
        for gpu in chosen:
            cap = capability(gpu.compute_capability)
            if cap is None or cap < FP8_MIN_CAPABILITY:
                # Below 8.9 engines fall back to weight-only FP8 (Marlin) silently and slower.
                what = gpu.compute_capability or "unknown"
                problems.append(
                    f"fp8 needs compute capability 8.9 or newer (Ada, Hopper); GPU {gpu.index} "
                    f"({gpu.gpu_class}) has {what}: use dtype bfloat16 or place on newer GPUs"
                )
    return problems


API_KEY_FLAGS = ("--api-key", "--api-key-file")
API_KEY_VARIABLES = ("VLLM_API_KEY", "LLAMA_API_KEY", "LLAMA_ARG_API_KEY_FILE", "LLMGW_SIM_API_KEY")


def option_name(token: str) -> str:
    """The option `token` sets, as vLLM and llama.cpp read it (`_` and `-` alike in
    option names): `--api_key=k` is `--api-key`."""
    flag = token.split("=", 1)[0]
    return "--" + flag[2:].replace("_", "-") if flag.startswith("--") else flag


def _api_key(spec: LaunchSpec) -> list[str]:
    """The agent gives every engine its own key, which routers learn from the log: a key
    set by the model would lock the routers out (or open the engine to whoever knows it)."""
    problems = []
    flags = [a for a in spec.engine_args if option_name(a) in API_KEY_FLAGS]
    if flags:
        problems.append(
            f"engine_args set {', '.join(sorted(set(flags)))}: the agent sets each engine's "
            "API key itself; remove it from the model"
        )
    variables = sorted(v for v in spec.env if v in API_KEY_VARIABLES)
    if variables:
        problems.append(
            f"env sets {', '.join(variables)}: the agent sets each engine's API key itself; "
            "remove it from the model"
        )
    return problems


def _not_options(spec: LaunchSpec) -> list[str]:
    """The model and its names go on the engine's command line as values: one that begins
    with `-` would be read as an option (`--trust-remote-code` as an alias turns it on past
    this node's launch policy), one with `@` as a file of arguments."""
    out = []
    for what, value in (("model", spec.model), ("served name", spec.served_name),
                        *(("alias", a) for a in spec.aliases)):  # fmt: skip
        if value[:1] in ("-", "@"):
            out.append(
                f"the {what} {value[:80]!r} begins with {value[0]!r}, which the engine would "
                "read as an option: name models and aliases without a leading - or @"
            )
    return out


def check(
    spec: LaunchSpec,
    inventory: Inventory,
    context: LaunchContext,
    *,
    busy_gpus: frozenset[int] = frozenset(),
) -> None:
    """Raise LaunchRefused listing every reason `spec` cannot start on this node."""
    problems: list[str] = []
    if not spec.model.strip():
        problems.append("the shard names no model to load")
    if not spec.served_name.strip():
        problems.append("the shard has no served model name")
    problems += _not_options(spec)
    first, last = context.port_range
    if not first <= spec.port <= last:
        problems.append(f"port {spec.port} is outside this agent's engine ports {first}-{last}")
    problems += _arithmetic(spec)
    problems += _api_key(spec)
    problems += _multi_node(spec, context)
    problems += _fabric(spec, context)
    if spec.engine == "llamacpp":
        if spec.tensor_parallel > 1:
            problems.append(
                "llama.cpp has no tensor parallelism: set pipeline_parallel to the GPU count "
                "(layer split) and tensor_parallel to 1"
            )
        if spec.dtype == "fp8":
            problems.append("llama.cpp has no fp8 weights: use a GGUF quantization")
    problems += _gpus(spec, {g.index: g for g in inventory.gpus}, busy_gpus)
    if problems:
        raise LaunchRefused(problems)

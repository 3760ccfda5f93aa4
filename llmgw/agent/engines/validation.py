"""Checks a LaunchSpec must pass on this node before any engine starts.

An engine refuses a bad profile only after minutes of loading weights, and some
mistakes (an adapter on the wrong fabric) never fail at all: they hang. So the
agent refuses up front, with every reason at once and what to change.
Purely computational, no side effects; `llmgw.agent.engines.plan` calls it.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping, Sequence
from typing import Literal

import msgspec

from llmgw.agent.engines.common import LaunchContext
from llmgw.core.inventory import Gpu, Inventory
from llmgw.core.profile import Engine, LaunchSpec

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


def _api_key(spec: LaunchSpec) -> list[str]:
    """The agent gives every engine its own key, which routers learn from the log: a key
    set by the model would lock the routers out (or open the engine to whoever knows it)."""
    problems = []
    flags = [a for a in spec.engine_args if a.split("=", 1)[0] in API_KEY_FLAGS]
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


# --------------------------------------------------------------------------- launch policy
#
# What an operator's model profile (its `env` and `engine_args`, carried in every
# StartShard) may make this node run. The operator's certificate reaches every node;
# the node's own config bounds what that certificate can do there.

PolicyScope = Literal["all", "vllm", "sglang", "llamacpp", "sim"]

ENGINES: tuple[Engine, ...] = ("vllm", "sglang", "llamacpp", "sim")

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ENV_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\*?")
_NUMBER = re.compile(r"-(\d|\.\d)")
_REFUSED = "\x00refused"
_HF_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")

_COMMON_ENV = (
    "CUDA_*",
    "NCCL_*",
    "HF_*",
    "OMP_NUM_THREADS",
    "TOKENIZERS_PARALLELISM",
    "PYTORCH_CUDA_ALLOC_CONF",
)

DEFAULT_ENV_ALLOW: Mapping[Engine, tuple[str, ...]] = {
    "vllm": (*_COMMON_ENV, "VLLM_*"),
    "sglang": (*_COMMON_ENV, "SGLANG_*"),
    # Not LLAMA_ARG_*: those are llama-server's options by another name.
    "llamacpp": ("CUDA_*", "GGML_*", "HF_TOKEN", "OMP_NUM_THREADS"),
    "sim": ("LLMGW_SIM__*",),
}
"""Exact names and `PREFIX_*` patterns each engine may be given by default."""

# Names a built-in pattern matches but that load code, name files or directories
# (which the engine reads, writes or imports from), or loosen the engine's own
# safety switches. A pattern never admits them; an exact name in launch.env_allow does.
_CODE_OR_FILE_PARTS = (
    "PRELOAD",
    "PLUGIN",
    "INJECTION",
    "TRUST_REMOTE_CODE",
    "INSECURE",
    "LIBRARY",
    "MODULE",
    "EXTENSION",
    "DEV_MODE",
    "RUNTIME_LORA",
)
_CODE_OR_FILE_SUFFIXES = (
    "_PATH",
    "_FILE",
    "_DIR",
    "_ROOT",
    "_HOME",
    "_CACHE",
    "_LIB",
    "_LIBS",
    "_CMD",
    "_COMMAND",
    "_API_KEY",
)


def loads_code(name: str) -> bool:
    """True for an env name that a built-in pattern must not admit (see above). Pure."""
    upper = name.upper()
    return any(part in upper for part in _CODE_OR_FILE_PARTS) or upper.endswith(
        _CODE_OR_FILE_SUFFIXES
    )


_VLLM_ARGS = (
    "--gpu-memory-utilization",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--block-size",
    "--kv-cache-dtype",
    "--kv-cache-memory-bytes",
    "--num-gpu-blocks-override",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--disable-prefix-caching",
    "--prefix-caching-hash-algo",
    "--enable-chunked-prefill",
    "--no-enable-chunked-prefill",
    "--disable-chunked-prefill",
    "--long-prefill-token-threshold",
    "--enforce-eager",
    "--no-enforce-eager",
    "--max-cudagraph-capture-size",
    "--cudagraph-capture-sizes",
    "--quantization",
    "--seed",
    "--revision",
    "--tokenizer",
    "--tokenizer-revision",
    "--max-logprobs",
    "--logprobs-mode",
    "--disable-sliding-window",
    "--chat-template",
    "--chat-template-content-format",
    "--default-chat-template-kwargs",
    "--response-role",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "--reasoning-parser",
    "--enable-prompt-tokens-details",
    "--enable-force-include-usage",
    "--return-tokens-as-token-ids",
    "--max-log-len",
    "--uvicorn-log-level",
    "--disable-uvicorn-access-log",
    "--disable-log-stats",
    "--disable-fastapi-docs",
    "--sse-keep-alive-interval",
    "--enable-expert-parallel",
    "--data-parallel-size",
    "--disable-custom-all-reduce",
    "--distributed-timeout-seconds",
    "--attention-backend",
    "--scheduling-policy",
    "--async-scheduling",
    "--no-async-scheduling",
    "--stream-interval",
    "--performance-mode",
    "--optimization-level",
    "--cpu-offload-gb",
    "--language-model-only",
    "--limit-mm-per-prompt",
    "--mm-processor-cache-gb",
    "--override-generation-config",
)

_SGLANG_ARGS = (
    "--mem-fraction-static",
    "--max-running-requests",
    "--max-queued-requests",
    "--max-total-tokens",
    "--chunked-prefill-size",
    "--max-prefill-tokens",
    "--schedule-policy",
    "--schedule-conservativeness",
    "--page-size",
    "--kv-cache-dtype",
    "--disable-radix-cache",
    "--enable-mixed-chunk",
    "--disable-overlap-schedule",
    "--random-seed",
    "--revision",
    "--tokenizer-path",
    "--chat-template",
    "--reasoning-parser",
    "--tool-call-parser",
    "--attention-backend",
    "--prefill-attention-backend",
    "--decode-attention-backend",
    "--sampling-backend",
    "--grammar-backend",
    "--disable-cuda-graph",
    "--cuda-graph-max-bs-decode",
    "--enable-torch-compile",
    "--torch-compile-max-bs",
    "--disable-custom-all-reduce",
    "--enable-dp-attention",
    "--dp-size",
    "--ep-size",
    "--moe-runner-backend",
    "--moe-a2a-backend",
    "--quantization",
    "--log-level",
    "--log-level-http",
    "--enable-cache-report",
    "--stream-interval",
    "--dist-timeout",
    "--watchdog-timeout",
    "--skip-server-warmup",
    "--allow-auto-truncate",
    "--stream-response-default-include-usage",
    "--show-time-cost",
    "--decode-log-interval",
    "--cpu-offload-gb",
    "--enable-deterministic-inference",
)

_LLAMACPP_ARGS = (
    "--threads",
    "--threads-batch",
    "--threads-http",
    "--batch-size",
    "--ubatch-size",
    "--flash-attn",
    "--cache-type-k",
    "--cache-type-v",
    "--parallel",
    "--cont-batching",
    "--no-cont-batching",
    "--cache-prompt",
    "--no-cache-prompt",
    "--cache-reuse",
    "--kv-offload",
    "--no-kv-offload",
    "--tensor-split",
    "--main-gpu",
    "--seed",
    "--temp",
    "--top-k",
    "--top-p",
    "--min-p",
    "--repeat-penalty",
    "--presence-penalty",
    "--frequency-penalty",
    "--rope-scaling",
    "--rope-scale",
    "--rope-freq-base",
    "--rope-freq-scale",
    "--yarn-orig-ctx",
    "--swa-full",
    "--context-shift",
    "--no-context-shift",
    "--jinja",
    "--no-jinja",
    "--reasoning-format",
    "--reasoning-budget",
    "--chat-template",
    "--chat-template-file",
    "--chat-template-kwargs",
    "--slot-prompt-similarity",
    "--timeout",
    "--embedding",
    "--rerank",
    "--pooling",
    "--verbose",
    "--log-disable",
)

_SIM_ARGS = (
    "--block-size",
    "--num-blocks",
    "--max-num-seqs",
    "--seed",
    "--decode-base-ms",
    "--decode-per-seq-ms",
    "--prefill-per-token-ms",
    "--eos-min-tokens",
    "--eos-max-tokens",
    "--embedding-dim",
    "--stall-at",
    "--stall-s",
    "--fail-status",
    "--die-mid-stream",
    "--after-tokens",
    "--fault-count",
    "--count",
    "--shutdown-timeout-s",
    "--log-level",
)

DEFAULT_ARGS_ALLOW: Mapping[Engine, tuple[str, ...]] = {
    "vllm": _VLLM_ARGS,
    "sglang": _SGLANG_ARGS,
    "llamacpp": _LLAMACPP_ARGS,
    "sim": _SIM_ARGS,
}
"""Engine options an operator may add by default: tuning, sampling and logging only.

Chosen from each engine's full option list (vLLM 0.33.0, SGLang 0.5.23, llama.cpp
0c1e57098). Left out on purpose: anything that imports code or a plugin
(`--worker-extension-cls`, `--worker-cls`, `--*-plugin`, `--logits-processors`,
`--middleware`, `--trust-remote-code`, `--model-class-overrides`, `--custom-weight-loader`,
`--forward-hooks`), reads options or data from arbitrary files (`--config`, `--lora-*`,
`--grammar-file`, `--*-config-file`), writes files (`--log-file`, `--slot-save-path`,
`--crash-dump-folder`), lets requests read the node's disk (`--allowed-local-media-path`,
`--media-path`), reaches other machines (`--rpc`, `--tool-server`, `--otlp-traces-endpoint`),
and what the agent owns (host, port, API key, parallelism, served names).
"""

FILE_ARGS: Mapping[Engine, Mapping[str, str]] = {
    "vllm": {"--chat-template": "template", "--tokenizer": "name_or_path"},
    "sglang": {"--chat-template": "name_or_path", "--tokenizer-path": "name_or_path"},
    "llamacpp": {"--chat-template-file": "path"},
    "sim": {},
}
"""Allowed options whose value may be a file the engine reads: only under launch.file_dirs.

`template`: inline Jinja (it has `{`, `}` or a newline) or a file; `name_or_path`: a
Hugging Face id (`org/name`) or a file; `path`: always a file.
"""


class LaunchPolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a StartShard may make this node run (the agent config's `launch` section).

    A shard asking for anything else is refused before launch, with the setting to
    change, and reported as a failed ShardStatus.
    """

    engines: tuple[Engine, ...] = ENGINES
    """Engines this node may start."""
    defaults: bool = True
    """Start from the built-in allowlists (env names per engine: CUDA_*, NCCL_*, HF_*,
    VLLM_* / SGLANG_* ... without those that load code or name files; engine options:
    tuning, sampling and logging flags). False: only what env_allow and args_allow list."""
    env_allow: dict[PolicyScope, tuple[str, ...]] = {}
    """Environment names a launch may set besides the defaults, per engine or under `all`:
    exact names (`LD_PRELOAD` is admitted only so) or `PREFIX_*` patterns."""
    args_allow: dict[PolicyScope, tuple[str, ...]] = {}
    """Engine options a launch may pass besides the defaults, per engine or under `all`,
    in their full spelling (`--max-num-seqs`); values are not restricted."""
    file_dirs: tuple[str, ...] = ()
    """Absolute directories from which options such as `--chat-template` may read files."""


def _where(source: str) -> str:
    return f"agent config {source}" if source else "the agent config"


def _listed(
    policy: LaunchPolicy,
    table: Mapping[Engine, tuple[str, ...]],
    engine: Engine,
    extra: Mapping[PolicyScope, tuple[str, ...]],
) -> tuple[str, ...]:
    base = table[engine] if policy.defaults else ()
    return (*base, *extra.get("all", ()), *extra.get(engine, ()))


def env_allowed(policy: LaunchPolicy, engine: Engine, name: str) -> bool:
    """True when a launch of `engine` may set `name` on this node. Purely computational."""
    if not _ENV_NAME.fullmatch(name):
        return False
    configured = (*policy.env_allow.get("all", ()), *policy.env_allow.get(engine, ()))
    defaults = DEFAULT_ENV_ALLOW[engine] if policy.defaults else ()
    if name in configured or name in defaults:
        return True
    for entry in (*defaults, *configured):
        if entry.endswith("*") and name.startswith(entry[:-1]) and not loads_code(name):
            return True
    return False


def _flag_name(token: str) -> str:
    flag = token.split("=", 1)[0]
    # vLLM and llama.cpp treat `_` and `-` alike in option names.
    return flag[:2] + flag[2:].replace("_", "-") if flag.startswith("--") else flag


def _is_value(token: str) -> bool:
    return not token.startswith("-") or bool(_NUMBER.match(token)) or token == "-"


def _file_value(kind: str, value: str, dirs: tuple[str, ...]) -> str | None:
    """The file `value` names when it is not under `dirs`; None when it is fine."""
    if kind == "template" and any(c in value for c in "{}\n"):
        return None
    if kind == "name_or_path" and _HF_ID.fullmatch(value) and ".." not in value:
        return None
    if value.startswith("/"):
        path = posixpath.normpath(value)
        for d in dirs:
            root = posixpath.normpath(d)
            if path == root or path.startswith(root.rstrip("/") + "/"):
                return None
        return path
    return value


def args_problems(
    policy: LaunchPolicy, engine: Engine, args: Sequence[str], source: str = ""
) -> list[str]:
    """Why `args` (a profile's engine_args) may not run on this node. Purely computational."""
    allowed = set(_listed(policy, DEFAULT_ARGS_ALLOW, engine, policy.args_allow))
    files = FILE_ARGS[engine]
    where = _where(source)
    problems: list[str] = []
    flag = ""  # the option the next values belong to; _REFUSED after a refused one
    for token in args:
        if token.startswith("@"):
            problems.append(
                f"engine argument {token!r} would read arguments from a file: "
                "give the options themselves"
            )
            continue
        if "\x00" in token:
            problems.append(f"engine argument {token!r} contains a NUL byte")
            continue
        if _is_value(token):
            if flag == _REFUSED:
                continue
            if not flag:
                problems.append(
                    f"engine argument {token!r} is not an option (a value without one before "
                    "it): the model is the profile's `model`, options start with --"
                )
            elif flag in files:
                problems += _file_problem(flag, files[flag], token, policy, where)
            continue
        flag = _flag_name(token)
        if flag not in allowed:
            problems.append(
                f"engine argument {flag} is not allowed by this node's "
                f"launch.args_allow.{engine} ({where}): add it there if this node should run it"
            )
            flag = _REFUSED
            continue
        if "=" in token and flag in files:
            problems += _file_problem(flag, files[flag], token.split("=", 1)[1], policy, where)
    return problems


def _file_problem(flag: str, kind: str, value: str, policy: LaunchPolicy, where: str) -> list[str]:
    outside = _file_value(kind, value, policy.file_dirs)
    if outside is None:
        return []
    dirs = list(policy.file_dirs) or "none"
    return [
        f"engine argument {flag} names the file {outside!r}, which is not under this node's "
        f"launch.file_dirs ({dirs}; {where}): give an absolute path under one of them, "
        "or add its directory there if this node should read it"
    ]


def env_problems(
    policy: LaunchPolicy, engine: Engine, env: Mapping[str, str], source: str = ""
) -> list[str]:
    """Why `env` (a profile's environment) may not be set on this node. Purely computational."""
    where = _where(source)
    problems = []
    for name, value in env.items():
        if not env_allowed(policy, engine, name):
            problems.append(
                f"env {name} is not allowed by this node's launch.env_allow ({where}): "
                "add it there if this node should run it"
            )
        elif "\x00" in value:
            problems.append(f"env {name} has a NUL byte in its value")
    return problems


def check_policy(spec: LaunchSpec, policy: LaunchPolicy, *, source: str = "") -> None:
    """Raise LaunchRefused when `spec` asks for what this node's launch policy does not allow."""
    if spec.engine not in policy.engines:
        raise LaunchRefused(
            [
                f"engine {spec.engine} is not allowed by this node's launch.engines "
                f"({_where(source)}): add it there if this node should run it"
            ]
        )
    problems = env_problems(policy, spec.engine, spec.env, source)
    problems += args_problems(policy, spec.engine, spec.engine_args, source)
    if problems:
        raise LaunchRefused(problems)


def policy_errors(policy: LaunchPolicy) -> list[str]:
    """What is wrong with a `launch` section itself, each with what to change. Pure."""
    errors = []
    if not policy.engines:
        errors.append(
            "launch.engines is empty: this node would refuse every shard; list the engines "
            f"it may run ({', '.join(ENGINES)})"
        )
    for scope, names in policy.env_allow.items():
        for name in names:
            if not _ENV_PATTERN.fullmatch(name) or name == "*":
                errors.append(
                    f"launch.env_allow.{scope}: {name!r} is neither an environment name "
                    "(LETTERS_DIGITS_UNDERSCORES) nor a PREFIX_* pattern"
                )
    for scope, flags in policy.args_allow.items():
        for flag in flags:
            if not flag.startswith("-") or _is_value(flag) or "=" in flag or flag.strip() != flag:
                errors.append(
                    f"launch.args_allow.{scope}: {flag!r} is not an option name: give the full "
                    "spelling without a value, e.g. --max-num-seqs"
                )
    for d in policy.file_dirs:
        if not d.startswith("/") or posixpath.normpath(d) == "/":
            errors.append(
                f"launch.file_dirs: {d!r} must be an absolute directory other than / "
                "(engines may read files under it)"
            )
    return errors

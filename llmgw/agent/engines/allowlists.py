"""The built-in allowlists of a node's launch policy: what a model profile's `env` and
`engine_args` may set by default, engine by engine, and which options name files.

Data, with one pure predicate (`loads_code`); `llmgw.agent.engines.policy` applies them.
"""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.core.profile import Engine

ENGINES: tuple[Engine, ...] = ("vllm", "sglang", "llamacpp", "sim")

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
    # A Python package imported by name (SGLANG_EXTERNAL_MODEL_PACKAGE and
    # SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE register the model classes they hold).
    "PACKAGE",
    # Where the engine's processes meet their peers (SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE,
    # NCCL_COMM_ID): set elsewhere, a process off this node could join the engine's group.
    "INIT_METHOD",
    "COMM_ID",
    # What writes users' prompts and answers, or the process's memory, where the node's
    # operator did not ask: VLLM_DEBUG_LOG_API_SERVER_RESPONSE logs every answer, core
    # dumps hold whatever the engine held (CUDA_COREDUMP_PIPE, CUDA_ENABLE_COREDUMP_ON_*),
    # VLLM_TRACE_FUNCTION traces every call to files; VLLM_LOGGING_STREAM's `ext://`
    # imports the module it names, VLLM_LOGGING_CONFIG* configures logging from outside.
    "LOG_API",
    "COREDUMP",
    "TRACE_FUNCTION",
    "LOGGING_STREAM",
    "LOGGING_CONFIG",
    # Another model hub than the one the node's operator chose (VLLM_USE_MODELSCOPE,
    # SGLANG_USE_MODELSCOPE); a quantization config read from the path given
    # (VLLM_HUMMING_*_QUANT_CONFIG).
    "MODELSCOPE",
    "QUANT_CONFIG",
    # Where a library sends what it holds (HF_ENDPOINT would take the node's Hugging Face
    # token to another host) or reads files from.
    "ENDPOINT",
    "_URL",
    "PROXY",
    # Where hf-xet (Hugging Face downloads) writes its log: HF_XET_LOG_DEST is a file it
    # appends to or a folder whose old files it deletes, HF_XET_LOG_PREFIX the name of the
    # file in it (`../` leaves it), HF_XET_LOG_DIR_* how much of that folder it deletes.
    "XET_LOG",
    "_DEST",
)
_CODE_OR_FILE_SUFFIXES = (
    # Without the underscore: the interpreter's and the system's own run the words together
    # (PYTHONPATH, PYTHONHOME, PYTHONPLATLIBDIR, PATH, CPATH, HOME, TMPDIR).
    "PATH",
    "_FILE",
    "DIR",
    "_DIRECTORY",
    "_FOLDER",
    "_ROOT",
    "HOME",
    "_CACHE",
    "_LIB",
    "_LIBS",
    "_CMD",
    "_COMMAND",
    "_API_KEY",
    # Addresses: of a server the engine reports to (VLLM_USAGE_STATS_SERVER), or the
    # engine's own and its peers' (VLLM_HOST_IP, VLLM_DP_MASTER_IP, NCCL_RAS_ADDR,
    # VLLM_NIXL_SIDE_CHANNEL_HOST, which opens a port on that address).
    "_SERVER",
    "_HOST",
    "_IP",
    "_ADDR",
)


# The dynamic loader's settings, every one: LD_AUDIT loads libraries as LD_PRELOAD does,
# LD_PROFILE and LD_DEBUG_OUTPUT write files.
_CODE_OR_FILE_PREFIXES = ("LD_",)

# Names the words above miss: Python's start-up (a user site folder whose .pth files run,
# a bytecode folder read before the sources, a module imported by name, a script run
# first) and what a shell runs before its command.
_CODE_OR_FILE_NAMES = frozenset(
    {
        "PYTHONUSERBASE",
        "PYTHONPYCACHEPREFIX",
        "PYTHONSTARTUP",
        "PYTHONBREAKPOINT",
        "PYTHONWARNINGS",
        "PYTHONINSPECT",
        "PYTHONEXECUTABLE",
        "PYTHON_PRESITE",
        "PYTHON_HISTORY",
        "BASH_ENV",
        "ENV",
    }
)


def loads_code(name: str) -> bool:
    """True for an env name that a pattern, built-in or configured, must not admit (see
    above). Pure."""
    upper = name.upper()
    return (
        any(part in upper for part in _CODE_OR_FILE_PARTS)
        or upper.endswith(_CODE_OR_FILE_SUFFIXES)
        or upper.startswith(_CODE_OR_FILE_PREFIXES)
        or upper in _CODE_OR_FILE_NAMES
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
    "--load-s",
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
`--crash-dump-folder`), writes users' prompts and answers to the engine's log (vLLM's
`--enable-log-requests`, llama-server's `--verbose`, which logs every request's and
response's body; a failed shard reports that log's tail to the fleet), lets requests
read the node's disk (`--allowed-local-media-path`, `--media-path`), reaches other
machines (`--rpc`, `--tool-server`, `--otlp-traces-endpoint`), and what the agent owns
(host, port, API key, parallelism, served names).
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
